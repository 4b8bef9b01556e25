"""Line-level outcomes of an action script (flowrl_ray.envs.forms.credit), by hand on a shipped
form: which gold action each line addresses and whether it is that action."""

from flowrl_ray.envs.forms import FormCatalog, FormTask, gold_actions
from flowrl_ray.envs.forms.credit import LineOutcome, gold_slots, line_outcomes, slot_outcomes

CATALOG = FormCatalog.load()
# clinical_study_enrollment: text, email, tel, number, radio, a checkbox group, a select, a yes/no box
TASK = FormTask(task_id="heldout_values/clinical_study_enrollment/0/0", form_id="clinical_study_enrollment",
                url="/forms/clinical_study_enrollment", instruction="(by hand)", split="heldout_values",
                ground_truth_fields={"participant": "Ann Berg", "age": 42, "sex": "Female",
                                     "conditions": ["Asthma", "Diabetes"], "consent": True})


def test_a_tasks_slots_follow_its_gold_script():
    slots = gold_slots(TASK, CATALOG)
    assert [s.key for s in slots] == ["field:participant name", "field:age", "field:sex", "option:asthma",
                                      "option:diabetes", "field:i have read the consent form", "submit"]
    assert [s.verb for s in slots] == ["fill", "fill", "select", "check", "check", "check", "click"]
    assert len(slots) == len(gold_actions(TASK, CATALOG).splitlines())


def test_each_line_is_scored_against_the_gold_action_it_addresses():
    script = "\n".join([
        'fill "Participant name" "Ann Berg"',         # 0 right
        'fill "age" "42.0"',                          # 1 right: label folded, the number normalised
        'select "Sex" "Male"',                        # 2 wrong value
        'check "Asthma"',                             # 3 right: a group's option
        'check "Hypertension"',                       # 4 an option the task does not tick: no slot
        '',                                           # 5 blank
        'fill "Phone number" "555"',                  # 6 a field the task leaves empty: no slot
        'uncheck "I have read the consent form"',     # 7 wrong verb
        'click "Enrol"',                              # 8 the submit slot, wrong text
        'garbage "x',                                 # 9 not an action
        'click "enroll"',                             # 10 right (case folded)
    ])
    assert line_outcomes(TASK, script, CATALOG) == [
        LineOutcome(0, "field:participant name", True), LineOutcome(1, "field:age", True),
        LineOutcome(2, "field:sex", False), LineOutcome(3, "option:asthma", True),
        LineOutcome(4, None, False), LineOutcome(5, None, False), LineOutcome(6, None, False),
        LineOutcome(7, "field:i have read the consent form", False), LineOutcome(8, "submit", False),
        LineOutcome(9, None, False), LineOutcome(10, "submit", True)]
    # a slot is right when some line writes its gold action; "option:diabetes" has no line
    assert slot_outcomes(TASK, script, CATALOG) == {
        "field:participant name": True, "field:age": True, "field:sex": False, "option:asthma": True,
        "option:diabetes": False, "field:i have read the consent form": False, "submit": True}


def test_the_gold_script_is_right_on_every_line():
    outcomes = line_outcomes(TASK, gold_actions(TASK, CATALOG), CATALOG)
    assert all(o.right for o in outcomes) and len(outcomes) == 7
    assert all(slot_outcomes(TASK, gold_actions(TASK, CATALOG), CATALOG).values())
    assert line_outcomes(TASK, "", CATALOG) == [LineOutcome(0, None, False)]
