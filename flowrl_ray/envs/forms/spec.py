"""Form specs: forms are data, one JSON file per form.

A spec file looks like this (``flowrl_ray/data/forms/*.json`` ship with the package; a user adds
their own with ``--forms-dir DIR`` / ``env.kwargs.forms_dir``, no code change)::

    {
      "id": "workshop_registration",            # [a-z0-9_]+, unique over all loaded forms
      "title": "Workshop Registration",
      "domain": "academic",
      "submit": "Register",                     # the submit button's text (default "Submit")
      "heldout": false,                         # true: only in the held-out split (default false)
      "fields": [
        {"name": "full_name", "label": "Full name", "type": "text", "required": true,
         "sample": "full_name"},
        {"name": "track", "label": "Track", "type": "select", "options": ["Vision", "Language"]},
        {"name": "nights", "label": "Hotel nights", "type": "number", "min": 0, "max": 5},
        {"name": "consent", "label": "I agree to be photographed", "type": "checkbox"}
      ]
    }

Field types: text, email, tel, number, date, select, radio, checkbox, textarea. ``options`` is
required for select and radio; a checkbox with ``options`` is a group of boxes (its value is a
list of the checked options), without them a single yes/no box. ``min``/``max`` bound numbers
(numbers) and dates (ISO ``YYYY-MM-DD``); ``step`` is a number's granularity (default 1: whole
numbers). ``sample`` tells the task generator where values come from: a pool name (see
:data:`SAMPLE_POOLS`) or a list of literal strings; without it the type decides.

Every label on a form (field labels, and the option labels of checkbox groups, which the action
language addresses directly) must be unique up to case and whitespace, so that an action's label
names one element. A malformed spec raises :class:`FormSpecError` naming the file and the key.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

FIELD_TYPES = ("text", "email", "tel", "number", "date", "select", "radio", "checkbox", "textarea")
#: types typed into with `fill`
FILL_TYPES = ("text", "email", "tel", "number", "date", "textarea")
#: value pools the task generator knows (flowrl_ray.envs.forms.tasks); checked here so that a typo
#: in a spec fails when the spec is loaded, not when the first task is drawn
SAMPLE_POOLS = ("first_name", "last_name", "full_name", "email", "phone", "company", "job_title",
                "city", "street", "zip", "country", "university", "subject", "title", "sentence",
                "phrase", "product", "code", "url")
ID_RE = re.compile(r"^[a-z0-9][a-z0-9_]*$")
NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")       # no leading "_": the server reserves "_episode"
FORM_KEYS = {"id", "title", "domain", "fields", "submit", "heldout", "description"}
FIELD_KEYS = {"name", "label", "type", "options", "required", "min", "max", "step", "sample",
              "placeholder"}


class FormSpecError(ValueError):
    """A malformed form spec; the message names the file and the key."""


def normalize_label(text: str) -> str:
    """Case- and whitespace-insensitive key of a label (also what the action parser uses)."""
    return " ".join(str(text).split()).casefold()


@dataclass(frozen=True)
class FieldSpec:
    name: str
    label: str
    type: str
    required: bool = False
    options: tuple[str, ...] = ()
    min: float | str | None = None        # a number, or an ISO date for date fields
    max: float | str | None = None
    step: float = 1.0
    sample: str | tuple[str, ...] | None = None
    placeholder: str | None = None

    @property
    def is_group(self) -> bool:
        """A checkbox group (several boxes, the value is a list) rather than one yes/no box."""
        return self.type == "checkbox" and bool(self.options)

    @property
    def integer(self) -> bool:
        return self.type == "number" and float(self.step).is_integer()


@dataclass(frozen=True)
class FormSpec:
    id: str
    title: str
    domain: str
    fields: tuple[FieldSpec, ...]
    submit: str = "Submit"
    heldout: bool = False
    description: str = ""
    source: str = ""                       # the file it came from (for error messages)

    @property
    def path(self) -> str:
        """The form's URL path on the form server."""
        return f"/forms/{self.id}"

    def field(self, name: str) -> FieldSpec:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)


# --------------------------------------------------------------------------- parsing one file

def _fail(source: str, key: str, msg: str) -> FormSpecError:
    return FormSpecError(f"{source}: key '{key}': {msg}")


def _str(d: dict, k: str, source: str, key: str, default: str | None = None) -> str:
    if k not in d:
        if default is not None:
            return default
        raise _fail(source, key, "missing")
    v = d[k]
    if not isinstance(v, str) or not v.strip():
        raise _fail(source, key, f"must be a non-empty string, got {v!r}")
    return v.strip()


def _bool(d: dict, k: str, source: str, key: str) -> bool:
    v = d.get(k, False)
    if not isinstance(v, bool):
        raise _fail(source, key, f"must be true or false, got {v!r}")
    return v


def _bound(v: Any, ftype: str, source: str, key: str) -> float | str | None:
    if v is None:
        return None
    if ftype == "number":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _fail(source, key, f"must be a finite number, got {v!r}")
        return float(v)
    if ftype == "date":
        try:
            return _dt.date.fromisoformat(v).isoformat()
        except (TypeError, ValueError):
            raise _fail(source, key, f"must be an ISO date YYYY-MM-DD, got {v!r}") from None
    raise _fail(source, key, f"only number and date fields take a bound (this one is {ftype})")


def _parse_field(d: Any, source: str, key: str) -> FieldSpec:
    if not isinstance(d, dict):
        raise _fail(source, key, f"must be an object, got {type(d).__name__}")
    unknown = sorted(set(d) - FIELD_KEYS)
    if unknown:
        raise _fail(source, f"{key}.{unknown[0]}", f"unknown key (allowed: {', '.join(sorted(FIELD_KEYS))})")
    name = _str(d, "name", source, f"{key}.name")
    if not NAME_RE.match(name):
        raise _fail(source, f"{key}.name", f"{name!r} must match {NAME_RE.pattern}")
    key = f"fields[{name}]"
    label = _str(d, "label", source, f"{key}.label")
    ftype = _str(d, "type", source, f"{key}.type")
    if ftype not in FIELD_TYPES:
        raise _fail(source, f"{key}.type", f"{ftype!r} is not one of {', '.join(FIELD_TYPES)}")
    options = d.get("options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) and o.strip() for o in options):
        raise _fail(source, f"{key}.options", "must be a list of non-empty strings")
    options = tuple(o.strip() for o in options)
    if ftype in ("select", "radio") and len(options) < 2:
        raise _fail(source, f"{key}.options", f"a {ftype} field needs at least 2 options")
    if options and ftype not in ("select", "radio", "checkbox"):
        raise _fail(source, f"{key}.options", "only select, radio and checkbox fields take options")
    if len({normalize_label(o) for o in options}) != len(options):
        raise _fail(source, f"{key}.options", "options must be unique (ignoring case and whitespace)")
    lo = _bound(d.get("min"), ftype, source, f"{key}.min")
    hi = _bound(d.get("max"), ftype, source, f"{key}.max")
    if lo is not None and hi is not None and lo > hi:
        raise _fail(source, f"{key}.max", f"max {hi!r} is below min {lo!r}")
    step = d.get("step", 1)
    if "step" in d and ftype != "number":
        raise _fail(source, f"{key}.step", "only number fields take a step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not (step > 0 and math.isfinite(step)):
        raise _fail(source, f"{key}.step", f"must be a number > 0, got {step!r}")
    sample = d.get("sample")
    if isinstance(sample, str):
        if sample not in SAMPLE_POOLS:
            raise _fail(source, f"{key}.sample", f"unknown pool {sample!r} (known: {', '.join(SAMPLE_POOLS)})")
    elif isinstance(sample, list):
        if not sample or not all(isinstance(s, str) and s.strip() for s in sample):
            raise _fail(source, f"{key}.sample", "a list of samples must hold non-empty strings")
        sample = tuple(s.strip() for s in sample)
    elif sample is not None:
        raise _fail(source, f"{key}.sample", f"must be a pool name or a list of strings, got {sample!r}")
    if sample is not None and ftype not in ("text", "textarea", "email", "tel"):
        raise _fail(source, f"{key}.sample", "only text, textarea, email and tel fields take a sample")
    placeholder = d.get("placeholder")
    if placeholder is not None and not isinstance(placeholder, str):
        raise _fail(source, f"{key}.placeholder", "must be a string")
    return FieldSpec(name=name, label=label, type=ftype, required=_bool(d, "required", source, f"{key}.required"),
                     options=options, min=lo, max=hi, step=float(step), sample=sample, placeholder=placeholder)


def parse_form_spec(data: Any, source: str = "<spec>") -> FormSpec:
    """A :class:`FormSpec` from the decoded JSON of one spec file (``source`` names it in errors)."""
    if not isinstance(data, dict):
        raise FormSpecError(f"{source}: a form spec must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - FORM_KEYS)
    if unknown:
        raise _fail(source, unknown[0], f"unknown key (allowed: {', '.join(sorted(FORM_KEYS))})")
    form_id = _str(data, "id", source, "id")
    if not ID_RE.match(form_id):
        raise _fail(source, "id", f"{form_id!r} must match {ID_RE.pattern}")
    raw_fields = data.get("fields")
    if not isinstance(raw_fields, list) or not raw_fields:
        raise _fail(source, "fields", "must be a non-empty list of fields")
    fields = tuple(_parse_field(f, source, f"fields[{i}]") for i, f in enumerate(raw_fields))
    seen_names: set[str] = set()
    seen_labels: dict[str, str] = {}
    for f in fields:
        if f.name in seen_names:
            raise _fail(source, f"fields[{f.name}].name", "duplicate field name")
        seen_names.add(f.name)
        labels = [f.label] + (list(f.options) if f.is_group else [])
        for label in labels:
            other = seen_labels.get(normalize_label(label))
            if other is not None:
                raise _fail(source, f"fields[{f.name}].label",
                            f"label {label!r} is also used by field {other!r}; labels must be unique")
            seen_labels[normalize_label(label)] = f.name
    description = data.get("description", "")
    if not isinstance(description, str):
        raise _fail(source, "description", "must be a string")
    return FormSpec(id=form_id, title=_str(data, "title", source, "title"),
                    domain=_str(data, "domain", source, "domain"), fields=fields,
                    submit=_str(data, "submit", source, "submit", default="Submit"),
                    heldout=_bool(data, "heldout", source, "heldout"), description=description, source=source)


def load_form_spec(path: str | Path) -> FormSpec:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise FormSpecError(f"{path}: not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FormSpecError(f"{path}: cannot read: {e}") from None
    return parse_form_spec(data, str(path))


# --------------------------------------------------------------------------- the catalog

def builtin_forms_dir() -> Path:
    """Where the shipped spec files are (flowrl_ray/data/forms)."""
    return Path(str(resources.files("flowrl_ray").joinpath("data", "forms")))


@dataclass
class FormCatalog:
    """All forms one process knows: the shipped ones plus a user's ``forms_dir``."""
    forms: dict[str, FormSpec] = field(default_factory=dict)

    @classmethod
    def load(cls, forms_dir: str | Path | None = None, include_builtin: bool = True) -> "FormCatalog":
        dirs = ([builtin_forms_dir()] if include_builtin else [])
        if forms_dir is not None:
            d = Path(forms_dir)
            if not d.is_dir():
                raise FormSpecError(f"{d}: forms directory does not exist")
            dirs.append(d)
        catalog = cls()
        for d in dirs:
            paths = sorted(d.glob("*.json"))
            if d != builtin_forms_dir() and not paths:
                raise FormSpecError(f"{d}: no *.json form specs in this directory")
            for p in paths:
                catalog.add(load_form_spec(p))
        return catalog

    def add(self, form: FormSpec) -> None:
        if form.id in self.forms:
            raise FormSpecError(f"{form.source}: key 'id': form id {form.id!r} is already defined by "
                                f"{self.forms[form.id].source}")
        self.forms[form.id] = form

    def __getitem__(self, form_id: str) -> FormSpec:
        return self.forms[form_id]

    def __contains__(self, form_id: object) -> bool:
        return form_id in self.forms

    def __len__(self) -> int:
        return len(self.forms)

    def __iter__(self):
        return iter(self.forms.values())

    def ids(self, heldout: bool | None = None) -> list[str]:
        """Sorted form ids; ``heldout`` True/False keeps only held-out / training forms."""
        return sorted(i for i, f in self.forms.items() if heldout is None or f.heldout == heldout)
