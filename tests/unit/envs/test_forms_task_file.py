"""Tasks from a file in FormFactory's layout (``env.kwargs.task_file``): the round trip of
``flowrl-ray forms tasks``, a FormFactory line, every malformed line named by file, line and key.
A scorer serving the file's tasks in a real browser: tests/integration/test_forms_task_file.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from flowrl_ray.config import ConfigError
from flowrl_ray.envs.forms import FormCatalog, gold_actions, spec
from flowrl_ray.envs.forms.task_file import TaskFileError, load_task_file

CATALOG = FormCatalog.load()
FORM = CATALOG[CATALOG.ids()[0]]


def _write(tmp_path, rows, name="tasks.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _gold_record(task) -> dict:
    return {"instruction": task.instruction, "url": f"http://127.0.0.1:5050{task.url}",
            "ground_truth_fields": task.ground_truth_fields}


def test_the_forms_tasks_output_loads_back_unchanged(tmp_path, capsys):
    from flowrl_ray.cli import main
    assert main(["forms", "tasks", "--split", "eval", "--per-form", "2", "--gold"]) == 0
    lines = capsys.readouterr().out.splitlines()
    path = _write(tmp_path, lines)
    tasks = load_task_file(path, CATALOG)
    assert [t.to_dict() for t in tasks] == [{k: v for k, v in json.loads(line).items() if k != "gold_actions"}
                                            for line in lines]
    assert {t.split for t in tasks} == {"heldout_values", "heldout_forms"}


def test_a_formfactory_line_with_a_full_url_and_no_id(tmp_path):
    from flowrl_ray.envs.forms.tasks import load_tasks
    task = load_tasks("rl", per_form=1, catalog=CATALOG)[0]
    path = _write(tmp_path, ["", json.dumps(_gold_record(task)), "  "], name="formfactory_train.jsonl")
    (loaded,) = load_task_file(path, CATALOG)
    assert loaded.task_id == "file/formfactory_train/2" and loaded.split == "train"
    assert loaded.form_id == task.form_id and loaded.url == task.url
    assert loaded.ground_truth_fields == task.ground_truth_fields
    assert gold_actions(loaded, CATALOG) == gold_actions(task, CATALOG)


def _fields(form) -> dict:
    from flowrl_ray.envs.forms.tasks import load_tasks
    return next(t for t in load_tasks("rl", per_form=4, catalog=CATALOG) if t.form_id == form.id).ground_truth_fields


@pytest.mark.parametrize("line,message", [
    ("{not json", r"tasks.jsonl:2: not valid JSON"),
    ('["a list"]', r"tasks.jsonl:2: expected a JSON object"),
    (json.dumps({"url": FORM.path, "ground_truth_fields": {}}), r"tasks.jsonl:2: key 'instruction' is missing"),
    (json.dumps({"instruction": 3, "url": FORM.path, "ground_truth_fields": {}}),
     r"tasks.jsonl:2: key 'instruction' must be a str"),
    (json.dumps({"instruction": "x", "url": "/forms/no_such_form", "ground_truth_fields": {}}),
     r"tasks.jsonl:2: key 'url': '/forms/no_such_form' names no form"),
    (json.dumps({"instruction": "x", "url": FORM.path, "ground_truth_fields": {"no_such_field": "a"}}),
     r"tasks.jsonl:2: key 'ground_truth_fields.no_such_field': form .* has no such field"),
    (json.dumps({"instruction": "x", "url": FORM.path, "ground_truth_fields": {}}),
     r"tasks.jsonl:2: key 'ground_truth_fields': the form would refuse this record: .*required"),
])
def test_each_malformed_line_is_named_by_file_line_and_key(tmp_path, line, message):
    good = {"instruction": "x", "url": FORM.path, "ground_truth_fields": _fields(FORM)}
    path = _write(tmp_path, [json.dumps(good), line])
    with pytest.raises(TaskFileError, match=message):
        load_task_file(path, CATALOG)


def test_a_value_the_form_refuses_and_duplicate_ids_and_an_empty_file(tmp_path):
    choice = next((f for f in FORM.fields if f.type in ("select", "radio")), None)
    fields = _fields(FORM)
    if choice is not None:
        bad = {**fields, choice.name: "not an option"}
        path = _write(tmp_path, [json.dumps({"instruction": "x", "url": FORM.path, "ground_truth_fields": bad})])
        with pytest.raises(TaskFileError, match=r":1: key 'ground_truth_fields': .*not one of the options"):
            load_task_file(path, CATALOG)
    row = {"instruction": "x", "url": FORM.path, "ground_truth_fields": fields, "task_id": "a"}
    with pytest.raises(TaskFileError, match=r":2: key 'task_id': 'a' is also the id of line 1"):
        load_task_file(_write(tmp_path, [json.dumps(row), json.dumps(row)]), CATALOG)
    with pytest.raises(TaskFileError, match="holds no task"):
        load_task_file(_write(tmp_path, ["", ""]), CATALOG)


def test_the_config_key_is_checked_before_anything_starts(tmp_path):
    bad = _write(tmp_path, ['{"instruction": "x"}'])
    env = SimpleNamespace(family="forms", id="train", kwargs={"task_file": str(bad)})
    with pytest.raises(ConfigError, match=r"'env.kwargs.task_file': .*tasks.jsonl:1: key 'url' is missing"):
        spec(env)
    env.kwargs["task_file"] = str(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match=r"'env.kwargs.task_file': .*cannot read"):
        spec(env)
