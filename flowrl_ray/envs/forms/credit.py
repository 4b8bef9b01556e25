"""Line-level outcomes of an action script: which gold action each written line addresses and
whether it is that action. They let an algorithm credit a field's match to the tokens of the
line that wrote it (Flow-GRPO's ``advantage: line``) instead of one outcome for the whole script.

A task's *slots* are its gold actions (:func:`~flowrl_ray.envs.forms.tasks.gold_actions`): one
per gold field (``fill`` / ``select`` / ``check`` / ``uncheck`` of its label), one per ticked
option of a checkbox group (``check`` of the option) and the submit click. A written line
addresses the slot whose key its verb and first argument name:

    fill | select "<label>" ...     -> "field:<label>"        (labels case- and space-folded)
    check | uncheck "<label>"       -> "field:<label>", else "option:<label>" (a group's option)
    click "<anything>"              -> "submit"

and it is *right* when it is the slot's gold action: the same verb, the same label, and (for fill
and select) a value equal to the gold value after the reward's normalisation
(:func:`~flowrl_ray.envs.forms.reward.normalize_value`: "42" = "42.0", case and spaces folded).
This is the field-accuracy rule applied line by line, before the browser runs the script: a
right line fills its field right whatever the other lines do (a later line for the same field
can still overwrite it; the reward, read from the submission, then differs).

Lines are the script split at ``"\\n"`` (0-based, blank ones included), so a token's line is the
number of newlines before it. A line that is not an action, or names no slot of the task (a
field the task leaves empty, a label the form lacks), addresses none.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowrl_ray.envs.forms.actions import parse_actions
from flowrl_ray.envs.forms.reward import normalize_value
from flowrl_ray.envs.forms.spec import FormCatalog, normalize_label
from flowrl_ray.envs.forms.tasks import FormTask, gold_action_list

SUBMIT = "submit"


@dataclass(frozen=True)
class GoldSlot:
    """One gold action of a task: its key, verb and (fill/select) field and value."""
    key: str
    verb: str
    field: object | None = None          # the FieldSpec whose value a fill/select writes
    value: object | None = None          # the gold value (compared after normalize_value)


@dataclass(frozen=True)
class LineOutcome:
    line: int                            # 0-based, in text.split("\n")
    slot: str | None                     # the key of the slot the line addresses, None: none
    right: bool                          # the line is that slot's gold action


def gold_slots(task: FormTask, catalog: FormCatalog) -> list[GoldSlot]:
    """The task's slots in the order of :func:`gold_actions`' lines (the form's field order,
    then the submit click)."""
    slots = []
    for f, verb, args in gold_action_list(task, catalog):
        if f is None:
            slots.append(GoldSlot(SUBMIT, verb, value=normalize_label(args[0])))
        elif f.is_group:
            slots.append(GoldSlot("option:" + normalize_label(args[0]), verb))
        else:
            slots.append(GoldSlot("field:" + normalize_label(args[0]), verb, f, args[1] if len(args) > 1 else None))
    return slots


def line_outcomes(task: FormTask, text: str, catalog: FormCatalog) -> list[LineOutcome]:
    """One :class:`LineOutcome` per line of ``text`` (``text.split("\\n")``)."""
    slots = {s.key: s for s in gold_slots(task, catalog)}
    out = []
    for i, raw in enumerate(text.split("\n")):
        actions = parse_actions(raw).actions
        if not actions:
            out.append(LineOutcome(i, None, False))
            continue
        a = actions[0]                  # (a line holding \r or another line break parses as more)
        if a.verb == "click":
            key = SUBMIT
        else:
            key = "field:" + normalize_label(a.label)
            if key not in slots and a.verb in ("check", "uncheck"):
                key = "option:" + normalize_label(a.label)
        slot = slots.get(key)
        if slot is None:
            out.append(LineOutcome(i, None, False))
            continue
        if slot.verb != a.verb:
            right = False
        elif a.verb == "click":
            right = normalize_label(a.label) == slot.value
        elif a.verb in ("fill", "select"):
            right = normalize_value(slot.field, a.value) == normalize_value(slot.field, slot.value)
        else:
            right = True                # check / uncheck of the right label
        out.append(LineOutcome(i, key, right))
    return out


def slot_outcomes(task: FormTask, text: str, catalog: FormCatalog) -> dict[str, bool]:
    """{slot key: some line of ``text`` is that slot's gold action}, over every slot of the task."""
    right = {s.key: False for s in gold_slots(task, catalog)}
    for o in line_outcomes(task, text, catalog):
        if o.right:
            right[o.slot] = True
    return right
