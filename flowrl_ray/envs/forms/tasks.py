"""Tasks: a gold record per form and an instruction that states it.

A task is drawn from ``(kind, form_id, seed, index)`` alone — its id is that tuple,
``"<kind>/<form_id>/<seed>/<index>"`` — so any process (a scoring actor on another node) can
rebuild it from the id without shared state, and the same seed always gives the same tasks.

Splits (task sets):

- ``sft`` (kind ``sft``): the training forms (spec ``heldout: false``), for supervised pretraining;
- ``rl`` = ``train`` (kind ``train``): the training forms, the prompts RL draws;
- ``eval`` = ``heldout``: ``heldout_values`` (the training forms) and ``heldout_forms`` (the
  held-out forms, spec ``heldout: true``).

The kinds are different seed streams (the kind is part of every task's seed), so the sets share
no task. Free-text values (names, companies, cities, streets, titles, sentences, ...) are composed
afresh per task from syllables, stems and word lists, so none can be predicted except by reading
it, and the composed values themselves are partitioned: a value belongs to the kind that its
stable hash names (``VALUE_PART``), and a kind redraws until it composes one of its own. So no SFT,
RL or evaluation value repeats in another set, while every set is built from the same word parts:
an evaluation value is a new combination of pieces that SFT answers write too (with a tokenizer
trained on the SFT texts, its tokens are ones a policy has learned to output). An email is made
from its person's name. Numbers, dates, phone numbers, codes and option choices are drawn from the
same ranges in all kinds.

The instruction names every field by its exact label (so a policy can address it on a page it has
not seen) and states its value, in varied phrasing and field order, with the form's URL path
(``/forms/<id>``: the server's port differs between runs) and the submit button's text.
:func:`gold_actions` writes the action script that solves a task (for supervised pretraining).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flowrl_ray.envs.forms.actions import format_action
from flowrl_ray.envs.forms.spec import FieldSpec, FormCatalog, FormSpec

SPLITS = ("train", "sft", "rl", "eval", "heldout", "heldout_values", "heldout_forms")
KINDS = ("train", "sft", "heldout_values", "heldout_forms")
#: split aliases: ``rl`` is the training kind RL draws from, ``eval`` both held-out kinds
SPLIT_KINDS = {"train": ("train",), "rl": ("train",), "sft": ("sft",), "eval": ("heldout_values", "heldout_forms"),
               "heldout": ("heldout_values", "heldout_forms"), "heldout_values": ("heldout_values",),
               "heldout_forms": ("heldout_forms",)}
DEFAULT_PER_FORM = {"train": 32, "sft": 32, "heldout_values": 8, "heldout_forms": 8}
#: the part of the composed free-text values a kind keeps (value hash mod N_PARTS): SFT, RL and
#: evaluation values are disjoint by construction, built from the same word parts
VALUE_PART = {"train": 0, "sft": 1, "heldout_values": 2, "heldout_forms": 2}
N_PARTS = 3
OPTIONAL_FIELD_P = 0.7        # an optional field is part of the record with this probability
HELDOUT_EVERY = 4             # every 4th pool entry is held out


@dataclass(frozen=True)
class FormTask:
    task_id: str
    form_id: str
    url: str                                   # path on the form server: /forms/<id>
    instruction: str
    ground_truth_fields: dict[str, Any]        # field name -> str | int | float | bool | list[str]
    split: str                                 # train | heldout_values | heldout_forms

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FormTask":
        return cls(**{k: d[k] for k in ("task_id", "form_id", "url", "instruction", "ground_truth_fields", "split")})


# --------------------------------------------------------------------------- value pools

POOLS: dict[str, tuple[str, ...]] = {
    "first_name": ("Amara", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ines", "Jonas",
                   "Keiko", "Lars", "Mina", "Nikolai", "Olga", "Pavel", "Quinn", "Rosa", "Samir", "Tessa",
                   "Umar", "Vera", "Wendell", "Ximena", "Yusuf", "Zara", "Aditi", "Bjorn", "Camille", "Diego",
                   "Esther", "Felix", "Gloria", "Hamid", "Ilse", "Jamal"),
    "last_name": ("Abernathy", "Bellamy", "Castellano", "Dunmore", "Eriksen", "Fairbanks", "Galloway", "Holloway",
                  "Ishikawa", "Jankowski", "Kowalczyk", "Lindqvist", "Montague", "Nakamura", "Okonkwo", "Pellegrini",
                  "Quintero", "Rasmussen", "Santangelo", "Thornbury", "Underwood", "Valdivia", "Whitcombe", "Yamada",
                  "Zielinski", "Achebe", "Brennan", "Carrington", "Delacroix", "Esposito", "Fitzgerald", "Gunnarsson"),
    "company": ("Northwind Analytics", "Bluefin Logistics", "Cedar & Pine Studio", "Driftwood Labs", "Emberline Foods",
                "Foxglove Robotics", "Granite Peak Partners", "Harborlight Media", "Ironbark Tools", "Juniper Health",
                "Kestrel Aerospace", "Lumen Textiles", "Meridian Freight", "Nimbus Software", "Orchard Lane Bakery",
                "Pinecrest Energy", "Quarry Stone Works", "Redwood Legal Group", "Silverleaf Pharma", "Tidewater Marine",
                "Umbra Design", "Vantage Point Surveys", "Willow Creek Farms", "Zenith Optics"),
    "job_title": ("Data Analyst", "Project Manager", "Software Engineer", "Lab Technician", "Graphic Designer",
                  "Accountant", "Nurse Practitioner", "Paralegal", "Operations Lead", "Research Assistant",
                  "Quality Inspector", "Product Owner", "Field Engineer", "Office Administrator", "Copy Editor",
                  "Procurement Officer", "Sales Representative", "Machinist", "Pharmacist", "Civil Engineer"),
    "city": ("Lisbon", "Toronto", "Nairobi", "Osaka", "Valparaiso", "Tallinn", "Auckland", "Marseille", "Krakow",
             "Montevideo", "Bergen", "Adelaide", "Porto", "Ljubljana", "Halifax", "Cork", "Tucson", "Bologna",
             "Gdansk", "Quebec City", "Aarhus", "Dunedin", "Leipzig", "Savannah"),
    "street": ("Maple Avenue", "Harbor Road", "Elm Street", "Station Lane", "Orchard Way", "Mill Road", "Kingfisher Close",
               "Chestnut Drive", "Canal Street", "Beacon Hill", "Willow Crescent", "Quarry Lane", "Riverside Walk",
               "Ashgrove Terrace", "Lantern Court", "Foundry Row"),
    "country": ("Portugal", "Canada", "Kenya", "Japan", "Chile", "Estonia", "New Zealand", "France", "Poland",
                "Uruguay", "Norway", "Australia", "Slovenia", "Ireland", "Italy", "Germany"),
    "university": ("Northbridge University", "Lakeshore Institute of Technology", "St. Aldric College",
                   "Eastvale University", "Riverton Polytechnic", "Highmoor University", "Coastal State University",
                   "Westbrook College of Arts", "Ironwood University", "Summit Valley University",
                   "Greyfield Institute", "Marlowe University"),
    "subject": ("Computational Biology", "Mechanical Engineering", "Medieval History", "Applied Mathematics",
                "Environmental Science", "Cognitive Psychology", "Urban Planning", "Materials Science",
                "Comparative Literature", "Public Health", "Econometrics", "Marine Ecology", "Astrophysics",
                "Linguistics", "Industrial Design", "Supply Chain Management"),
    "title": ("Patterns in Coastal Erosion", "Quiet Machines", "A Field Guide to Small Data", "Lanterns at Dusk",
              "Notes on Soil Memory", "The Weight of Glass", "Fast Graphs for Slow Rivers", "Harvest Arithmetic",
              "Signals from the Tundra", "Paper Boats and Other Vessels", "Learning to Read Maps",
              "Concrete Gardens", "Echoes of the Old Mill", "Threads of Copper", "Measuring Fog",
              "Borrowed Light", "The Cartographer's Daughter", "Rust and Resonance", "Winter Ledger",
              "Salt Roads"),
    "sentence": ("Please call before delivery.", "I prefer to be contacted by email.",
                 "The issue started after the last update.", "Access is through the side entrance.",
                 "I will need a receipt for my employer.", "Our team has four members.",
                 "The deadline is firm on our side.", "I have attended this event before.",
                 "The samples must be kept refrigerated.", "Weekends work best for me.",
                 "This replaces my earlier request.", "I can provide references on request.",
                 "The parcel may arrive in two boxes.", "Parking is available behind the building.",
                 "We would like an invoice in euros.", "My availability changes in the summer.",
                 "The equipment is under warranty.", "Please use my work address for letters.",
                 "I am happy to join a waiting list.", "A colleague will attend in my place if needed.",
                 "We need wheelchair access.", "The meeting can be held online.",
                 "I would like a printed copy as well.", "Please confirm by phone."),
    "phrase": ("blue folder", "spring batch", "north wing", "second draft", "front desk", "night shift",
               "main branch", "pilot run", "east annex", "rapid review", "open call", "final proof",
               "morning slot", "west gate", "field kit", "trial lot"),
    "product": ("Steel bracket M8", "Oak desk 140 cm", "Nitrile gloves L", "Label printer LP-200", "Copper pipe 15 mm",
                "Safety goggles", "Ergonomic chair", "Desk lamp LED", "Cable tray 2 m", "Pallet wrap roll",
                "Torque wrench", "Thermal paper roll", "Hex bolt M10", "Laptop stand", "Rubber gasket 40 mm",
                "Solder wire 1 mm"),
}
EMAIL_DOMAINS = ("example.com", "mail.example.org", "post.example.net", "inbox.example")
URL_SUFFIXES = (".example.com", ".example.org", ".example.net")


def pool(name: str, heldout: bool) -> tuple[str, ...]:
    """The training (3 of every 4) or held-out (every 4th) part of a pool: disjoint."""
    items = POOLS[name]
    return tuple(x for i, x in enumerate(items) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout)


def _split_list(items: tuple[str, ...], heldout: bool) -> tuple[str, ...]:
    """A spec's own list of samples: split like a pool when it is long enough, else shared."""
    if len(items) < HELDOUT_EVERY:
        return items
    return tuple(x for i, x in enumerate(items) if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == heldout)


def _stable_seed(*parts: object) -> int:
    """A seed from strings, the same in every process (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()[:8], "little")


# --------------------------------------------------------------------------- fresh values
#
# Free-text values are composed per task from word parts (syllables, stems, suffixes, word lists),
# so none can be predicted except by reading it from the instruction. All kinds compose from the
# same lists; a composed value is kept only by the kind its hash names (see value_part).

PARTS: dict[str, tuple[str, ...]] = {
    "onset": ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "tr",
              "st", "sh", "ch", "kl", "pr", "th"),
    "vowel": ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou"),
    "coda": ("", "n", "r", "l", "s", "m", "k", "x", "nd", "rt", "sk", "lm"),
    "company_stem": ("Acorn", "Basalt", "Cobalt", "Delta", "Ember", "Falcon", "Garnet", "Harbor", "Indigo", "Jasper",
                     "Kelp", "Lattice", "Marble", "Nectar", "Onyx", "Pylon", "Quartz", "Raven", "Sable", "Tundra",
                     "Umber", "Vortex", "Walnut", "Yarrow", "Zephyr", "Birch", "Copper", "Dune", "Flint", "Gale"),
    "company_suffix": ("Labs", "Works", "Logistics", "Analytics", "Foods", "Robotics", "Partners", "Media", "Tools",
                       "Health", "Systems", "Studio", "Freight", "Software", "Energy", "Legal", "Pharma", "Marine",
                       "Design", "Optics", "Textiles", "Farms", "Group", "Supply"),
    "street_suffix": ("Street", "Road", "Lane", "Avenue", "Way", "Close", "Drive", "Row", "Court", "Terrace",
                      "Walk", "Crescent"),
    "adjective": ("quiet", "rapid", "early", "second", "open", "final", "north", "spare", "blue", "narrow", "warm",
                  "bright", "short", "heavy", "small", "late", "fresh", "plain", "round", "steady", "dry", "deep",
                  "soft", "clear"),
    "noun": ("folder", "batch", "wing", "draft", "desk", "shift", "branch", "run", "annex", "review", "call",
             "proof", "slot", "gate", "kit", "lot", "parcel", "invoice", "meeting", "sample", "ledger", "bridge",
             "lamp", "valve", "engine", "garden", "window", "ticket", "report", "cabinet"),
    "verb": ("call", "send", "keep", "check", "bring", "store", "print", "ship", "review", "label", "pack", "move",
             "confirm", "collect", "repair", "seal", "deliver", "clean"),
    "time": ("before noon", "on Monday", "after the visit", "by Friday", "this week", "in the morning",
             "next month", "on arrival", "at the front desk", "before the meeting", "after lunch", "in spring"),
    "role": ("Analyst", "Manager", "Engineer", "Technician", "Designer", "Accountant", "Inspector", "Officer",
             "Editor", "Coordinator", "Assistant", "Specialist", "Planner", "Consultant", "Administrator"),
    "discipline": ("Biology", "Engineering", "History", "Mathematics", "Science", "Psychology", "Planning",
                   "Literature", "Health", "Economics", "Ecology", "Physics", "Linguistics", "Design", "Chemistry",
                   "Management", "Geology", "Statistics"),
}


def value_part(value: str) -> int:
    """Which kind keeps a composed value: its stable hash mod N_PARTS (compare VALUE_PART)."""
    return _stable_seed("value", value) % N_PARTS


def _word(rng: random.Random, syllables: tuple[int, int] = (2, 3)) -> str:
    """A pronounceable made-up word, capitalised: 2-3 syllables onset+vowel, the last with a coda."""
    n = rng.randint(*syllables)
    out = "".join(rng.choice(PARTS["onset"]) + rng.choice(PARTS["vowel"]) for _ in range(n))
    return (out + rng.choice(PARTS["coda"])).capitalize()


def fresh_value(src: str, rng: random.Random, kind: str) -> str:
    """A value of the sample type ``src`` composed afresh (never drawn whole from a fixed list),
    one of ``kind``'s own part of all such values (redrawn until :func:`value_part` says so)."""
    while True:
        value = _compose(src, rng)
        if value_part(value) == VALUE_PART[kind]:
            return value


def _compose(src: str, rng: random.Random) -> str:
    def pick(name: str) -> str:
        return rng.choice(PARTS[name])

    if src in ("first_name", "last_name", "city"):
        return _word(rng)
    if src == "company":
        return f"{_word(rng, (1, 2))} {pick('company_stem')} {pick('company_suffix')}"
    if src == "street":
        return f"{rng.randint(1, 250)} {_word(rng)} {pick('street_suffix')}"
    if src == "country":
        return _word(rng) + rng.choice(("ia", "land", "stan", "a"))
    if src == "university":
        return f"{_word(rng)} {rng.choice(('University', 'College', 'Institute'))}"
    if src == "subject":
        return f"{_word(rng, (1, 2))} {pick('discipline')}"
    if src == "title":
        return f"The {pick('adjective').capitalize()} {_word(rng, (1, 2))} {pick('noun').capitalize()}"
    if src == "job_title":
        return f"{_word(rng, (1, 2))} {pick('role')}"
    if src == "phrase":
        return f"{pick('adjective')} {pick('noun')}"
    if src == "product":
        return f"{_word(rng, (1, 2))} {pick('noun')} {rng.choice('ABCDEFGHKLMPRSTX')}{rng.randint(2, 990)}"
    if src == "sentence":
        n = 2 if rng.random() < 0.4 else 1
        return " ".join(f"Please {pick('verb')} the {pick('adjective')} {pick('noun')} {pick('time')}."
                        for _ in range(n))
    raise KeyError(src)


FRESH = ("first_name", "last_name", "city", "company", "street", "country", "university", "subject", "title", "job_title",
         "phrase", "product", "sentence")


# --------------------------------------------------------------------------- records

def _persona(rng: random.Random, kind: str) -> dict[str, str]:
    """One coherent person per record: the name, email and company fields agree."""
    first, last = fresh_value("first_name", rng, kind), fresh_value("last_name", rng, kind)
    company = fresh_value("company", rng, kind)
    return {"first_name": first, "last_name": last, "full_name": f"{first} {last}", "company": company,
            "email": f"{first.lower()}.{last.lower()}{rng.randint(1, 99)}@{rng.choice(EMAIL_DOMAINS)}",
            "city": fresh_value("city", rng, kind)}


def _sample_text(f: FieldSpec, rng: random.Random, kind: str, persona: dict[str, str]) -> str:
    src = f.sample
    heldout = kind in ("heldout_values", "heldout_forms")
    if isinstance(src, tuple):
        return rng.choice(_split_list(src, heldout))
    if src is None:
        src = {"email": "email", "tel": "phone", "textarea": "sentence"}.get(f.type, "phrase")
    if src in persona:
        return persona[src]
    if src == "phone":
        return f"{rng.randint(201, 989)}-555-{rng.randint(0, 9999):04d}"
    if src == "zip":
        return f"{rng.randint(10000, 99999)}"
    if src == "code":
        letters = "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(3))
        return f"{letters}-{rng.randint(1000, 9999)}"
    if src == "url":
        slug = persona["company"].split()[0].lower()
        return f"https://{slug}{rng.choice(URL_SUFFIXES)}"
    if src in FRESH:
        return fresh_value(src, rng, kind)
    return rng.choice(pool(src, heldout))


def _sample_value(f: FieldSpec, rng: random.Random, kind: str, persona: dict[str, str]) -> Any:
    if f.type in ("text", "textarea", "email", "tel"):
        return _sample_text(f, rng, kind, persona)
    if f.type == "number":
        if f.min is not None:
            lo = f.min
        else:
            lo = 0.0 if f.max is None or f.max >= 0 else f.max - 100.0
        hi = f.max if f.max is not None else lo + 100.0
        steps = int((hi - lo) // f.step)
        x = lo + f.step * rng.randint(0, max(steps, 0))
        return int(round(x)) if f.integer else round(x, 6)
    if f.type == "date":
        lo = _dt.date.fromisoformat(f.min) if f.min else _dt.date(2024, 1, 1)
        hi = _dt.date.fromisoformat(f.max) if f.max else _dt.date(2026, 12, 31)
        return (lo + _dt.timedelta(days=rng.randint(0, (hi - lo).days))).isoformat()
    if f.type in ("select", "radio"):
        return rng.choice(f.options)
    if f.is_group:
        k = rng.randint(1, min(3, len(f.options)))
        chosen = set(rng.sample(f.options, k))
        return [o for o in f.options if o in chosen]
    return True                                       # a yes/no box in the record is ticked


def draw_record(form: FormSpec, rng: random.Random, kind: str | bool) -> dict[str, Any]:
    """A gold record of a task kind: every required field, each optional one with probability
    0.7 (an optional yes/no box only when ticked). Keys follow the form's field order."""
    if isinstance(kind, bool):                        # held-out flag (older callers)
        kind = "heldout_values" if kind else "train"
    persona = _persona(rng, kind)
    record = {}
    for f in form.fields:
        if not f.required and rng.random() > OPTIONAL_FIELD_P:
            continue
        record[f.name] = _sample_value(f, rng, kind, persona)
    return record


# --------------------------------------------------------------------------- instructions

def format_value(f: FieldSpec, value: Any) -> str:
    """A value as typed into the page (and as stated in the instruction)."""
    if f.type == "number":
        if isinstance(value, float) and not value.is_integer():
            return f"{value:.6f}".rstrip("0").rstrip(".")
        return str(int(value))
    return str(value)


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


OPENERS = ("Fill out the {title} form at {url}.", "Go to {url} and complete the {title} form.",
           'Please complete the "{title}" form ({url}).', "Open {url} ({title}) and fill it in.",
           "You are on the {title} form at {url}.", "Complete the {title} at {url} with these details.")
CLOSERS = ('Then press "{submit}".', 'Submit it with the "{submit}" button.', 'Finish by clicking "{submit}".',
           "When you are done, click {submit}.", 'Click "{submit}" at the end.')
VALUE_TEMPLATES = ("Set {label} to {value}.", "{label}: {value}.", "Enter {value} as the {label}.",
                   "For {label}, use {value}.", "The {label} is {value}.", 'Put {value} in the "{label}" field.')
CHOICE_TEMPLATES = ("Choose {value} for {label}.", 'Pick "{value}" under {label}.', "Set {label} to {value}.",
                    "{label}: {value}.", "For {label}, select {value}.")
TICK_TEMPLATES = ('Tick "{label}".', 'Check the box "{label}".', 'Make sure "{label}" is checked.')
GROUP_TEMPLATES = ("{label}: {values}.", "Under {label}, tick {values}.", "For {label}, check {values}.")


def _statement(f: FieldSpec, value: Any, rng: random.Random) -> str:
    label = f.label                                   # the surface form the action quotes
    if f.type == "checkbox" and not f.is_group:
        return rng.choice(TICK_TEMPLATES).format(label=f.label)
    if f.is_group:
        return rng.choice(GROUP_TEMPLATES).format(label=label, values=_join([f'"{v}"' for v in value]))
    text = format_value(f, value)
    if f.type == "textarea" or (f.type == "text" and rng.random() < 0.3):
        text = f'"{text}"'
    templates = CHOICE_TEMPLATES if f.type in ("select", "radio") else VALUE_TEMPLATES
    return rng.choice(templates).format(label=label, value=text)


def _list_item(f: FieldSpec, value: Any) -> str:
    if f.type == "checkbox" and not f.is_group:
        return f"- {f.label}: yes"
    if f.is_group:
        return f"- {f.label}: {', '.join(value)}"
    text = format_value(f, value)
    return f'- {f.label}: "{text}"' if f.type == "textarea" else f"- {f.label}: {text}"


def write_instruction(form: FormSpec, record: dict[str, Any], rng: random.Random) -> str:
    """One of three layouts (prose, bullet list, inline details), the fields in random order."""
    names = list(record)
    rng.shuffle(names)
    opener = rng.choice(OPENERS).format(title=form.title, url=form.path)
    closer = rng.choice(CLOSERS).format(submit=form.submit)
    style = rng.choice(("prose", "list", "inline"))
    if style == "list":
        items = "\n".join(_list_item(form.field(n), record[n]) for n in names)
        return f"{opener} Use these details:\n{items}\n{closer}"
    if style == "inline":
        parts = [_list_item(form.field(n), record[n])[2:] for n in names]
        return f"{opener} Details: {'; '.join(parts)}. {closer}"
    return " ".join([opener, *(_statement(form.field(n), record[n], rng) for n in names), closer])


# --------------------------------------------------------------------------- tasks

def task_id(kind: str, form_id: str, seed: int, index: int) -> str:
    return f"{kind}/{form_id}/{seed}/{index}"


def parse_task_id(tid: str) -> tuple[str, str, int, int]:
    """(kind, form_id, seed, index); ValueError on a malformed id."""
    parts = str(tid).split("/")
    if len(parts) != 4 or parts[0] not in KINDS or not parts[2].isdigit() or not parts[3].isdigit():
        raise ValueError(f"not a forms task id: {tid!r} (expected <kind>/<form_id>/<seed>/<index>, "
                         f"kind one of {', '.join(KINDS)})")
    return parts[0], parts[1], int(parts[2]), int(parts[3])


def make_task(form: FormSpec, kind: str, seed: int, index: int) -> FormTask:
    """The task ``index`` of ``kind`` on ``form`` for ``seed``: independent of every other task."""
    if kind not in KINDS:
        raise ValueError(f"unknown task kind {kind!r} (one of {', '.join(KINDS)})")
    rng = random.Random(_stable_seed("flowrl-forms", kind, form.id, seed, index))
    record = draw_record(form, rng, kind)
    return FormTask(task_id=task_id(kind, form.id, seed, index), form_id=form.id, url=form.path,
                    instruction=write_instruction(form, record, rng), ground_truth_fields=record, split=kind)


def task_from_id(tid: str, catalog: FormCatalog) -> FormTask:
    """Rebuild a task from its id (ValueError: malformed id, KeyError: unknown form)."""
    kind, form_id, seed, index = parse_task_id(tid)
    if form_id not in catalog:
        raise KeyError(f"task {tid!r}: unknown form {form_id!r}")
    return make_task(catalog[form_id], kind, seed, index)


def load_tasks(split: str, forms_dir: str | Path | None = None, seed: int = 0, per_form: int | None = None,
               catalog: FormCatalog | None = None) -> list[FormTask]:
    """The tasks of a split (see the module docstring), ordered by form id then index. The same
    arguments always give the same list. ``per_form`` defaults to 32 for train and 8 for each
    held-out kind; ``catalog`` (if given) replaces loading the shipped forms + ``forms_dir``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")
    if per_form is not None and per_form < 1:
        raise ValueError(f"per_form must be >= 1, got {per_form}")
    catalog = catalog if catalog is not None else FormCatalog.load(forms_dir)
    kinds = SPLIT_KINDS[split]
    tasks = []
    for kind in kinds:
        n = per_form or DEFAULT_PER_FORM[kind]
        for form_id in catalog.ids(heldout=kind == "heldout_forms"):
            tasks.extend(make_task(catalog[form_id], kind, seed, i) for i in range(n))
    return tasks


def evaluation_tasks(n: int, seed: int = 0, catalog: FormCatalog | None = None) -> list[FormTask]:
    """The ``n`` evaluation tasks every policy is compared on: spread evenly (``linspace`` over
    the index, rounded) over the held-out split (held-out values on the training forms, then the
    held-out forms), at most the whole split. The same ``n`` and seed always give the same tasks."""
    import numpy as np
    heldout = load_tasks("heldout", seed=seed, catalog=catalog)
    pick = np.linspace(0, len(heldout) - 1, min(n, len(heldout))).round().astype(int)
    return [heldout[i] for i in pick]


def prompt_text(task: FormTask, catalog: FormCatalog) -> str:
    """What the model reads: the page it is on (the form's labels, types, options and button,
    as a browser agent sees them) and the instruction. The answer is the action script."""
    form = catalog[task.form_id]
    fields = []
    for f in form.fields:
        options = f" ({' | '.join(f.options)})" if getattr(f, "options", None) else ""
        fields.append(f"- {f.label} [{f.type}]{options}")
    return (f"Form: {form.title}\nFields:\n" + "\n".join(fields) + f"\nButton: {form.submit}\n"
            f"Task: {task.instruction}\nActions:\n")


def gold_action_list(task: FormTask, catalog: FormCatalog | None = None) -> list[tuple[FieldSpec | None, str, tuple]]:
    """The actions that solve ``task`` as (field, verb, arguments): one per gold field in the
    form's order (a checkbox group: one ``check`` per ticked option), then the submit click
    (field None). ``catalog`` defaults to the shipped forms."""
    catalog = catalog if catalog is not None else FormCatalog.load()
    form = catalog[task.form_id]
    actions = []
    for f in form.fields:
        if f.name not in task.ground_truth_fields:
            continue
        value = task.ground_truth_fields[f.name]
        if f.is_group:
            actions.extend((f, "check", (o,)) for o in value)
        elif f.type == "checkbox":
            actions.append((f, "check" if value else "uncheck", (f.label,)))
        elif f.type in ("select", "radio"):
            actions.append((f, "select", (f.label, value)))
        else:
            actions.append((f, "fill", (f.label, format_value(f, value))))
    actions.append((None, "click", (form.submit,)))
    return actions


def gold_actions(task: FormTask, catalog: FormCatalog | None = None) -> str:
    """The action script that solves ``task`` (:func:`gold_action_list`, one action per line)."""
    return "\n".join(format_action(verb, *args) for _, verb, args in gold_action_list(task, catalog))
