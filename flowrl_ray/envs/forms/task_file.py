"""Tasks from a file in FormFactory's layout, beside the generated ones (``env.kwargs.task_file``).

One JSON object per line:

    {"instruction": "...", "url": "http://127.0.0.1:5050/forms/job_application",
     "ground_truth_fields": {"full_name": "Ada Lovelace", "years": 4, "terms": true}}

- ``instruction`` (str): what the model reads after the form's description;
- ``url`` (str): the form's page, a full URL or a path; its last path segment (or ``form_id``,
  when given) names a form of the catalog (the shipped forms plus ``env.kwargs.forms_dir``);
- ``ground_truth_fields`` (object): field name -> value, as typed into the page (checkbox groups
  take a list of options, yes/no boxes a bool); the values must make a submission the form's
  server accepts, required fields included, so that the task can be solved;
- optional ``task_id`` (default ``file/<file name>/<line>``) and ``split`` (default ``train``).

The JSON lines ``flowrl-ray forms tasks --split S`` prints load back unchanged. Every mistake is
a :class:`TaskFileError` naming the file, the line and the key, raised before anything starts.
A scoring actor reads the same file (``FormsSettings.task_file``): file tasks cannot be rebuilt
from their id the way generated ones are, so the file must be where the actors run (a job's
``working_dir`` ships it).
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

from flowrl_ray.envs.forms.server import validate_submission
from flowrl_ray.envs.forms.spec import FormCatalog
from flowrl_ray.envs.forms.tasks import FormTask, format_value

REQUIRED = {"instruction": str, "url": str, "ground_truth_fields": dict}
OPTIONAL = {"task_id": str, "form_id": str, "split": str}


class TaskFileError(ValueError):
    """A task file that cannot be used: its message names the file, the line and the key."""


def _posted(field, value) -> list[str]:
    """A ground-truth value as the page would post it (the server's own check then types it)."""
    if field.is_group:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TypeError("a checkbox group takes a list of option strings")
        return list(value)
    if field.type == "checkbox":
        if not isinstance(value, bool):
            raise TypeError("a yes/no box takes true or false")
        return ["on"] if value else []
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError("expected a string or a number")
    return [format_value(field, value)]


def parse_task(obj, catalog: FormCatalog, where: str, default_id: str) -> FormTask:
    """One line's object -> a :class:`FormTask`; ``where`` ("FILE:LINE") prefixes every error."""
    if not isinstance(obj, dict):
        raise TaskFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key, kind in {**REQUIRED, **OPTIONAL}.items():
        if key in REQUIRED and key not in obj:
            raise TaskFileError(f"{where}: key '{key}' is missing")
        if key in obj and not isinstance(obj[key], kind):
            raise TaskFileError(f"{where}: key '{key}' must be a {kind.__name__}, got {type(obj[key]).__name__}")
    if not obj["instruction"].strip():
        raise TaskFileError(f"{where}: key 'instruction' is empty")
    form_id = obj.get("form_id") or urlparse(obj["url"]).path.rstrip("/").rsplit("/", 1)[-1]
    if form_id not in catalog:
        key = "form_id" if "form_id" in obj else "url"
        raise TaskFileError(f"{where}: key '{key}': {obj.get(key)!r} names no form of the catalog "
                            f"(forms: {', '.join(catalog.ids())}; add yours with env.kwargs.forms_dir)")
    form = catalog[form_id]
    posted = {}
    for name, value in obj["ground_truth_fields"].items():
        try:
            field = form.field(name)
        except KeyError:
            field = None
        if field is None:
            raise TaskFileError(f"{where}: key 'ground_truth_fields.{name}': form {form_id!r} has no such field "
                                f"(fields: {', '.join(f.name for f in form.fields)})")
        try:
            posted[name] = _posted(field, value)
        except TypeError as e:
            raise TaskFileError(f"{where}: key 'ground_truth_fields.{name}': {e}, got {value!r}") from None
    values, errors = validate_submission(form, posted)
    if errors:
        raise TaskFileError(f"{where}: key 'ground_truth_fields': the form would refuse this record: "
                            + "; ".join(errors))
    record = {name: values[name] for name in obj["ground_truth_fields"] if name in values}
    return FormTask(task_id=obj.get("task_id") or default_id, form_id=form_id, url=form.path,
                    instruction=obj["instruction"], ground_truth_fields=record, split=obj.get("split", "train"))


def load_task_file(path: str | Path, catalog: FormCatalog) -> list[FormTask]:
    """Every task of a JSON-lines file (blank lines skipped), in file order; task ids unique."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TaskFileError(f"{path}: cannot read the task file: {e}") from None
    tasks, seen = [], {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
        task = parse_task(obj, catalog, where, f"file/{path.stem}/{number}")
        if task.task_id in seen:
            raise TaskFileError(f"{where}: key 'task_id': {task.task_id!r} is also the id of line {seen[task.task_id]}")
        seen[task.task_id] = number
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: the task file holds no task")
    return tasks
