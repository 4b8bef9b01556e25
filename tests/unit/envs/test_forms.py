"""The forms family without a browser: specs, the server (real HTTP, in process), tasks, the action
parser (fuzzed), the reward, the settings, the `forms` verbs in process. The browser tests are in
tests/integration/test_forms_browser.py, `flowrl-ray forms serve` as a subprocess in
tests/e2e/test_forms.py."""

from __future__ import annotations

import json
import random
import string
import urllib.error
import urllib.parse
import urllib.request
from types import SimpleNamespace

import pytest

from flowrl_ray.config import ConfigError
from flowrl_ray.envs.forms import (EpisodeResult, FormCatalog, FormServer, FormSpecError, RewardWeights,
                                   gold_actions, load_form_spec, load_tasks, parse_actions, render_form,
                                   score_episode, spec, task_from_id, validate_submission)
from flowrl_ray.envs.forms.actions import ARITY, format_action
from flowrl_ray.envs.forms.scorer import FormsSettings
from flowrl_ray.envs.forms.spec import FIELD_TYPES
from flowrl_ray.envs.forms.tasks import POOLS, format_value, pool


@pytest.fixture(scope="module")
def catalog() -> FormCatalog:
    return FormCatalog.load()


def env_cfg(split="train", **kwargs):
    return SimpleNamespace(family="forms", id=split, kwargs=kwargs)


# --------------------------------------------------------------------------- specs

def test_shipped_forms_cover_the_issue(catalog):
    assert len(catalog) >= 25
    assert len({f.domain for f in catalog}) >= 8
    types = {fld.type for f in catalog for fld in f.fields}
    assert types == set(FIELD_TYPES)
    assert 3 <= len(catalog.ids(heldout=True)) < len(catalog) // 2
    assert len({f.domain for f in catalog if f.heldout}) == len(catalog.ids(heldout=True))   # spread out


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


GOOD = {"id": "my_form", "title": "My form", "domain": "custom",
        "fields": [{"name": "who", "label": "Who", "type": "text", "required": True},
                   {"name": "size", "label": "Size", "type": "select", "options": ["S", "M", "L"]}]}


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d.pop("title"), "key 'title': missing"),
    (lambda d: d.update(id="Bad Id"), "key 'id'"),
    (lambda d: d.update(colour="red"), "key 'colour': unknown key"),
    (lambda d: d["fields"][1].update(type="slider"), "key 'fields[size].type'"),
    (lambda d: d["fields"][1].update(options=["S"]), "key 'fields[size].options'"),
    (lambda d: d["fields"][0].update(required="yes"), "key 'fields[who].required'"),
    (lambda d: d["fields"][0].update(sample="nonsense_pool"), "key 'fields[who].sample'"),
    (lambda d: d["fields"][1].update(label="who"), "key 'fields[size].label'"),      # duplicate label
    (lambda d: d["fields"].append({"name": "n", "label": "N", "type": "number", "min": 5, "max": 1}),
     "key 'fields[n].max'"),
    (lambda d: d["fields"].append({"name": "d", "label": "D", "type": "date", "min": "tomorrow"}),
     "key 'fields[d].min'"),
    (lambda d: d["fields"].append({"label": "No name", "type": "text"}), "key 'fields[2].name'"),
])
def test_malformed_spec_names_file_and_key(tmp_path, mutate, key):
    data = json.loads(json.dumps(GOOD))
    mutate(data)
    path = _write(tmp_path, "mine.json", data)
    with pytest.raises(FormSpecError) as e:
        load_form_spec(path)
    assert str(path) in str(e.value) and key in str(e.value)


def test_user_forms_dir_adds_forms_and_reports_errors(tmp_path):
    _write(tmp_path, "mine.json", GOOD)
    cat = FormCatalog.load(tmp_path)
    assert "my_form" in cat and len(cat) == len(FormCatalog.load()) + 1
    assert any(t.form_id == "my_form" for t in load_tasks("train", forms_dir=tmp_path, per_form=1))
    _write(tmp_path, "broken.json", "{not json")
    with pytest.raises(FormSpecError, match="broken.json: not valid JSON"):
        FormCatalog.load(tmp_path)
    (tmp_path / "broken.json").unlink()
    _write(tmp_path, "dup.json", dict(GOOD, id="job_application"))
    with pytest.raises(FormSpecError, match="dup.json: key 'id': form id 'job_application' is already defined"):
        FormCatalog.load(tmp_path)
    with pytest.raises(FormSpecError, match="does not exist"):
        FormCatalog.load(tmp_path / "nope")


def test_rendered_html_binds_every_label(catalog):
    form = catalog["conference_registration"]
    page = render_form(form, episode="abc123")
    assert 'name="_episode" value="abc123"' in page and "novalidate" in page
    for f in form.fields:
        if f.type in ("radio",) or f.is_group:
            assert f"<legend>{f.label}</legend>" in page
            for i, opt in enumerate(f.options):
                assert f'<label for="f-{f.name}-{i}">{opt}</label>' in page
        else:
            assert f'for="f-{f.name}"' in page and f'id="f-{f.name}"' in page
    assert f'<button type="submit" id="submit">{form.submit}</button>' in page


# --------------------------------------------------------------------------- server (real HTTP)

def _post(url: str, data: dict) -> tuple[int, str]:
    body = urllib.parse.urlencode(data, doseq=True).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_server_validates_and_records_by_episode_key(catalog):
    form = catalog["loan_application"]
    good = {"applicant": "Ada Brennan", "email": "ada@example.com", "phone": "415-555-0101", "income": "52000",
            "amount": "15000", "term": "36", "purpose": "Car", "credit_check": "on"}
    with FormServer(catalog) as srv:
        assert srv.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(srv.url + "/", timeout=10) as r:
            index = r.read().decode()
        assert index.count('href="/forms/') == len(catalog)
        with urllib.request.urlopen(srv.form_url(form.id, "k0"), timeout=10) as r:
            assert 'value="k0"' in r.read().decode()
        status, page = _post(srv.form_url(form.id), dict(good, _episode="k1"))
        assert status == 200 and "Submission accepted" in page
        missing = {k: v for k, v in good.items() if k not in ("applicant", "credit_check")}
        status, page = _post(srv.form_url(form.id), dict(missing, _episode="k2"))
        assert status == 422 and "Submission rejected" in page and "Applicant name: required" in page
        bad = dict(good, _episode="k3", email="not-an-email", income="lots", term="7", phone="12")
        assert _post(srv.form_url(form.id), bad)[0] == 422
        [s1] = srv.store.take("k1")
        assert s1.accepted and s1.values["income"] == 52000 and s1.values["credit_check"] is True
        [s2] = srv.store.get("k2")
        assert not s2.accepted and "I consent to a credit check: must be checked" in s2.errors
        with urllib.request.urlopen(srv.url + "/submissions/k3", timeout=10) as r:
            [s3] = json.loads(r.read())
        assert len(s3["errors"]) == 4
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(srv.url + "/forms/unknown", timeout=10)
    assert srv._httpd is None                                   # stopped cleanly


def test_validation_rules(catalog):
    form = catalog["conference_registration"]
    values, errors = validate_submission(form, {
        "full_name": ["Ada"], "email": ["a@b.co"], "affiliation": ["X"], "attendance": ["online"],
        "sessions": ["Tutorials", "Industry panel"], "arrival": ["2031-01-01"], "conduct": ["on"]})
    assert values["attendance"] == "Online"                   # options match case-insensitively
    assert values["sessions"] == ["Tutorials", "Industry panel"]
    assert errors == ["Arrival date: must be on or before 2026-10-31"]
    _, errors = validate_submission(form, {"sessions": ["Karaoke"]})
    assert "Sessions: 'Karaoke' is not one of the options" in errors
    assert "I accept the code of conduct: must be checked" in errors


# --------------------------------------------------------------------------- tasks

def test_tasks_deterministic_and_rebuilt_from_id(catalog):
    a = load_tasks("train", seed=3, per_form=4)
    b = load_tasks("train", seed=3, per_form=4)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
    assert [t.instruction for t in a] != [t.instruction for t in load_tasks("train", seed=4, per_form=4)]
    for t in a[::7]:
        assert task_from_id(t.task_id, catalog) == t
    with pytest.raises(ValueError):
        task_from_id("train/job_application/x/1", catalog)


def test_splits_disjoint(catalog):
    train = load_tasks("train")
    heldout = load_tasks("heldout")
    assert len(train) == 32 * len(catalog.ids(heldout=False))
    held_forms = set(catalog.ids(heldout=True))
    assert not held_forms & {t.form_id for t in train}
    assert {t.form_id for t in heldout if t.split == "heldout_forms"} == held_forms
    assert {t.split for t in heldout} == {"heldout_values", "heldout_forms"}
    # free-text values never cross the split: pools are disjoint and every record has a name
    for name in POOLS:
        assert not set(pool(name, False)) & set(pool(name, True))
    train_text = {v for t in train for v in t.ground_truth_fields.values() if isinstance(v, str)}
    for t in heldout:
        form = catalog[t.form_id]
        names = [f.name for f in form.fields if f.sample in ("full_name", "company", "title", "university")]
        assert names and all(t.ground_truth_fields.get(n) not in train_text for n in names if n in t.ground_truth_fields)
    records = {json.dumps(t.ground_truth_fields, sort_keys=True) for t in train}
    assert not records & {json.dumps(t.ground_truth_fields, sort_keys=True) for t in heldout}


def test_instructions_state_values_labels_url_and_vary(catalog):
    tasks = load_tasks("train", per_form=6)
    for t in tasks:
        form = catalog[t.form_id]
        low = t.instruction.lower()
        assert form.path in t.instruction and form.submit.lower() in low
        for name, value in t.ground_truth_fields.items():
            f = form.field(name)
            assert f.label.lower() in low
            for v in value if isinstance(value, list) else ([] if isinstance(value, bool) else [value]):
                assert format_value(f, v).lower() in low
        required = {f.name for f in form.fields if f.required}
        assert required <= set(t.ground_truth_fields)
    openers = {t.instruction.split(" ")[0] for t in tasks}
    assert len(openers) >= 4
    orders = {tuple(n for n in sorted(t.ground_truth_fields, key=lambda n: t.instruction.lower().find(
        catalog[t.form_id].field(n).label.lower()))) for t in tasks if t.form_id == "job_application"}
    assert len(orders) > 1                                        # field order varies


def test_gold_actions_parse_and_validate_on_the_server(catalog):
    for t in load_tasks("heldout", per_form=2):
        text = gold_actions(t, catalog)
        parsed = parse_actions(text)
        assert parsed.unparseable == 0 and parsed.actions[-1].verb == "click"
        # the gold values pass the server's validation
        form = catalog[t.form_id]
        posted = {}
        for name, v in t.ground_truth_fields.items():
            form.field(name)                 # every gold field is one of the form's (raises if not)
            posted[name] = v if isinstance(v, list) else ["on" if v is True else str(v)]
        _, errors = validate_submission(form, posted)
        assert errors == [], (t.task_id, errors)


# --------------------------------------------------------------------------- parser

def test_parser_grammar():
    p = parse_actions('fill "Full name" "Ada \\"the\\" Brennan"\n\n  SELECT \'Term\' "Fall"  \ncheck "I agree"\n'
                      'uncheck "News"\nclick "Submit"\nfill "only one"\nclick "a" "b"\njump "x"\nfill "a""b"\n'
                      'fill "unterminated\nclick Submit\n')
    assert [(a.verb, a.args) for a in p.actions] == [
        ("fill", ("Full name", 'Ada "the" Brennan')), ("select", ("Term", "Fall")), ("check", ("I agree",)),
        ("uncheck", ("News",)), ("click", ("Submit",))]
    assert p.unparseable == 6 and [n for n, _ in p.bad_lines] == [7, 8, 9, 10, 11, 12]
    assert parse_actions(None).unparseable == 1 and parse_actions(b'click "x"').actions[0].label == "x"
    for verb, n in ARITY.items():
        args = tuple(random.Random(n).choice(['a"b', "c\\d", "plain", ""]) for _ in range(n))
        [a] = parse_actions(format_action(verb, *args)).actions
        assert (a.verb, a.args) == (verb, args)                   # format_action round-trips


def _random_line(rng: random.Random) -> str:
    pieces = ['fill', 'select', 'check', 'uncheck', 'click', '"', "'", "\\", " ", "\t", "\n", "\r\n", '""',
              '"Full name"', "\x00", "\u2028", "\ud800", "é", "🙂", "fill \"", "\\\"", "x" * 50]
    alphabet = string.printable + "\x00\x85\u2028\u00a0\ufeff"
    if rng.random() < 0.5:
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))


def test_parser_never_raises_on_random_and_adversarial_input():
    rng = random.Random(0)
    inputs = [_random_line(rng) for _ in range(5000)]
    inputs += ['"' * 10_000, "\\" * 10_001, 'fill "' + "\\" * 9_999, "\n" * 10_000, "fill " + '"a" ' * 5_000,
               'click "' + "x" * 100_000 + '"', "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(5_000))]
    for text in inputs:
        p = parse_actions(text)
        assert p.unparseable >= 0 and len(p.bad_lines) <= 20
        assert all(a.verb in ARITY and len(a.args) == ARITY[a.verb] for a in p.actions)
        assert p.unparseable + len(p.actions) <= len(text.splitlines())


# --------------------------------------------------------------------------- reward

def _result(actions=5, executed=5, unparseable=0, submitted=True, accepted=True, values=None, reason=""):
    r = EpisodeResult(task_id="t", form_id="loan_application", actions=actions, executed=executed,
                      unparseable_lines=unparseable, submitted=submitted, accepted=accepted, reason=reason)
    r.submitted_values = dict(values or {})
    return r


GOLD = {"applicant": "Ada Brennan", "email": "ada@example.com", "income": 52000, "term": "36",
        "purpose": "Car", "credit_check": True}


def test_reward_hand_made_cases(catalog):
    form, w = catalog["loan_application"], RewardWeights()
    perfect = score_episode(_result(values={**GOLD, "applicant": "  ada   BRENNAN ", "income": "52000.0"}), form, GOLD, w)
    assert (perfect.reward, perfect.task_completion, perfect.field_accuracy, perfect.execution_completeness) == (1, 1, 1, 1)
    assert perfect.success
    one_wrong = score_episode(_result(values={**GOLD, "purpose": "Education"}), form, GOLD, w)
    assert one_wrong.field_accuracy == pytest.approx(5 / 6) and not one_wrong.field_matches["purpose"]
    assert one_wrong.reward == pytest.approx(0.4 + 0.4 * 5 / 6 + 0.2) and not one_wrong.success
    not_submitted = score_episode(_result(executed=4, submitted=False, accepted=False), form, GOLD, w)
    assert not_submitted.task_completion == 0 and not_submitted.field_accuracy == 0
    assert not_submitted.reward == pytest.approx(0.2 * 4 / 5)
    rejected = score_episode(_result(accepted=False, values={k: v for k, v in GOLD.items() if k != "credit_check"}),
                             form, GOLD, w)
    assert rejected.reward == pytest.approx(0.4 * 5 / 6 + 0.2)
    garbage_lines = score_episode(_result(actions=2, executed=2, unparseable=6, values=GOLD), form, GOLD, w)
    assert garbage_lines.execution_completeness == pytest.approx(0.25)
    for reason in ("no_actions", "browser_crash", "timeout"):
        gated = score_episode(_result(reason=reason, values=GOLD), form, GOLD, w)
        assert gated.reward == 0 and gated.task_completion == 0 and gated.reason == reason
    free = score_episode(_result(values=GOLD), form, None, w)
    assert free.field_accuracy is None and free.reward == pytest.approx(0.6)
    custom = score_episode(_result(values=GOLD), form, GOLD, RewardWeights(1.0, 0.0, 0.0))
    assert custom.reward == 1.0


def test_reward_normalisation(catalog):
    form = catalog["conference_registration"]
    gold = {"sessions": ["Tutorials", "Industry panel"], "arrival": "2026-01-05", "email": "A@B.co"}
    r = score_episode(_result(values={"sessions": ["industry panel", "tutorials"], "arrival": "2026-01-05",
                                      "email": "a@b.co"}), form, gold, RewardWeights())
    assert r.field_accuracy == 1.0
    phone = catalog["loan_application"].field("phone")
    from flowrl_ray.envs.forms import normalize_value
    assert normalize_value(phone, "(415) 555-0101") == normalize_value(phone, "415-555-0101")


def test_reward_weights_validation():
    """The weights are a typed part of env.kwargs: a partial mapping keeps the other defaults."""
    s = FormsSettings.from_env_cfg(env_cfg(reward_weights={"field_accuracy": 1}))
    assert s.reward_weights == RewardWeights(0.4, 1.0, 0.2)
    for bad, msg in (({"speed": 1}, "env.kwargs.reward_weights.speed"),
                     ({"task_completion": -1}, "env.kwargs.reward_weights.task_completion"),
                     ({"task_completion": float("nan")}, "env.kwargs.reward_weights.task_completion"),
                     ({"task_completion": 0, "field_accuracy": 0, "execution_completeness": 0}, "at least one"),
                     ([1, 2], "env.kwargs.reward_weights': expected a mapping")):
        with pytest.raises(ConfigError, match=msg):
            FormsSettings.from_env_cfg(env_cfg(reward_weights=bad))


# --------------------------------------------------------------------------- settings

@pytest.mark.parametrize("kwargs, key", [
    ({"pages": 0}, "env.kwargs.pages"),
    ({"pages": "4"}, "env.kwargs.pages"),
    ({"action_timeout_s": -1}, "env.kwargs.action_timeout_s"),
    ({"rollout_timeout_s": 1, "action_timeout_s": 5}, "env.kwargs.rollout_timeout_s"),
    ({"restart_every": -5}, "env.kwargs.restart_every"),
    ({"reward_weights": {"accuracy": 1}}, "env.kwargs.reward_weights.accuracy"),
    ({"page": 4}, "unknown config key 'env.kwargs.page'; did you mean 'env.kwargs.pages'"),
    ({"forms_dir": ""}, "env.kwargs.forms_dir': must be a path"),
    ({"action_timeout_s": float("inf")}, "env.kwargs.action_timeout_s': must be a finite number"),
    ({"forms_dir": "/nonexistent/forms"}, "env.kwargs.forms_dir"),
])
def test_settings_errors_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("(", r"\(")):
        spec(env_cfg(**kwargs))


def test_settings_defaults_and_split():
    s = FormsSettings.from_env_cfg(env_cfg())
    assert (s.pages, s.action_timeout_s, s.rollout_timeout_s, s.restart_every) == (4, 5.0, 30.0, 200)
    assert s.reward_weights == RewardWeights(0.4, 0.4, 0.2)
    assert spec(env_cfg("heldout")).obs_shape == (1,)
    with pytest.raises(ConfigError, match="config key 'env.id'"):
        spec(env_cfg("Pendulum-v1"))


def test_family_is_registered():
    from flowrl_ray.envs import env_family
    assert env_family("forms").make_scorer is not None


# --------------------------------------------------------------------------- CLI (no browser)

def test_cli_tasks_and_list(capsys, tmp_path):
    from flowrl_ray.cli import main
    assert main(["forms", "tasks", "--split", "heldout_forms", "--per-form", "1", "--gold"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == len(FormCatalog.load().ids(heldout=True)) and all(r["gold_actions"] for r in rows)
    assert set(rows[0]) == {"task_id", "form_id", "url", "instruction", "ground_truth_fields", "split", "gold_actions"}
    assert main(["forms", "list"]) == 0 and "job_application" in capsys.readouterr().out
    _write(tmp_path, "bad.json", {"id": "x"})
    assert main(["forms", "list", "--forms-dir", str(tmp_path)]) == 2
    assert "bad.json: key 'fields'" in capsys.readouterr().err
    assert main(["forms", "run", "job_application", "--actions", str(tmp_path / "none.txt")]) == 2
    assert main(["forms", "run", "job_application", "--actions", str(tmp_path / "bad.json"),
                 "--task", "train/bug_report/0/1"]) == 2
    assert "not 'job_application'" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["serve", "run", "tasks", "list"])
def test_cli_forms_subcommands_explain_themselves(sub, capsys):
    from flowrl_ray.cli import main
    with pytest.raises(SystemExit) as e:
        main(["forms", sub, "--help"])
    assert e.value.code == 0 and f"usage: flowrl-ray forms {sub}" in capsys.readouterr().out


def test_forms_serve_stops_cleanly_on_a_ctrl_c_that_arrives_with_the_printed_url(monkeypatch, capsys):
    """A Ctrl-C delivered while the URL is being printed, before the serving loop is reached, is a
    clean stop (exit 0, the server closed), not an escaped KeyboardInterrupt."""
    import signal

    from flowrl_ray.envs.forms import cli as forms_cli
    monkeypatch.setattr(signal, "signal", lambda *a: None)        # keep this process's handlers
    urls = []

    def print_then_interrupt(*args, **kwargs):
        text = " ".join(map(str, args))
        print(text, **kwargs)
        if "Ctrl-C stops" in text:
            urls.append(text.split(" forms at ")[1].split("/ ")[0])
            raise KeyboardInterrupt
    monkeypatch.setattr(forms_cli, "print", print_then_interrupt, raising=False)
    args = SimpleNamespace(forms_dir=None, host="127.0.0.1", port=0)
    try:
        code = forms_cli.cmd_forms_serve(args)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped the serving command")
    assert code == 0
    assert "stopping the form server" in capsys.readouterr().out and len(urls) == 1
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(urls[0] + "/", timeout=2)
