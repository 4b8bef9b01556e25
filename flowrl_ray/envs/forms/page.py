"""One page: its element map (what a label names) and the execution of one action on it.

The element map is read from the live page, not from the form's spec: every ``<label>`` with the
element it labels (``label.control``), every ``<fieldset>`` with its ``<legend>`` and the boxes in
it (radio groups and checkbox groups), every button with its text. An action's label is looked up
there ignoring case, runs of whitespace and a trailing ``:`` or ``*``; it must name exactly one
element of a kind the verb can act on, else the action fails with a reason (it is never guessed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from flowrl_ray.envs.forms.actions import Action
from flowrl_ray.envs.forms.spec import normalize_label

FILL_KINDS = ("field",)
#: inputs whose browser-side sanitising silently empties a value it cannot parse (a date input
#: given "next tuesday"): a fill is checked by reading the value back
SANITISED_TYPES = ("date", "number", "time", "datetime-local", "month", "week", "range", "color")


# Runs in the page. Tags every element it reports with a data-flowrl-ref attribute, so the
# Python side addresses it with a selector that works whatever ids the page uses.
ELEMENT_MAP_JS = r"""
() => {
  const clean = s => (s || '').replace(/\s+/g, ' ').trim();
  let n = 0;
  const ref = el => {
    if (!el.dataset.flowrlRef) el.dataset.flowrlRef = String(++n) + '-' + Math.random().toString(36).slice(2, 8);
    return `[data-flowrl-ref="${el.dataset.flowrlRef}"]`;
  };
  const out = [];
  for (const lab of document.querySelectorAll('label')) {
    const el = lab.control;
    if (!el) continue;
    const tag = el.tagName.toLowerCase();
    const entry = {label: clean(lab.textContent), selector: ref(el), tag, type: (el.type || '').toLowerCase(), options: []};
    if (tag === 'select')
      entry.options = Array.from(el.options).filter(o => o.value !== '').map(o => [clean(o.textContent), o.value]);
    out.push(entry);
  }
  for (const fs of document.querySelectorAll('fieldset')) {
    const legend = fs.querySelector('legend');
    const boxes = Array.from(fs.querySelectorAll('input[type=radio], input[type=checkbox]'));
    if (!legend || !boxes.length) continue;
    const options = boxes.filter(b => b.labels && b.labels.length).map(b => [clean(b.labels[0].textContent), ref(b)]);
    out.push({label: clean(legend.textContent), selector: ref(fs), tag: 'fieldset', type: boxes[0].type, options});
  }
  for (const b of document.querySelectorAll('button, input[type=submit], input[type=button]')) {
    const text = b.tagName === 'INPUT' ? b.value : b.textContent;
    out.push({label: clean(text), selector: ref(b), tag: 'button', type: (b.type || '').toLowerCase(), options: []});
  }
  return out;
}
"""

_KIND_NAMES = {"field": "a text field", "select": "a select list", "checkbox": "a checkbox", "radio": "a radio button",
               "radio_group": "a radio group", "checkbox_group": "a group of checkboxes", "button": "a button"}


@dataclass(frozen=True)
class Element:
    kind: str                              # one of _KIND_NAMES
    label: str
    selector: str
    type: str
    options: tuple[tuple[str, str], ...]   # (option label, select value or option selector)

    def option(self, text: str) -> str | None:
        want = normalize_label(text)
        for label, target in self.options:
            if normalize_label(label) == want:
                return target
        return None


def _label_key(label: str) -> str:
    """Labels match ignoring case, runs of whitespace and a trailing ':' or '*'."""
    return normalize_label(label).rstrip(":*").strip()


def _kind(entry: dict) -> str:
    tag, t = entry["tag"], entry["type"]
    if tag == "fieldset":
        return "radio_group" if t == "radio" else "checkbox_group"
    if tag == "button":
        return "button"
    if tag == "select":
        return "select"
    if tag == "input" and t in ("checkbox", "radio"):
        return t
    if tag == "input" and t in ("submit", "button", "reset", "hidden", "file", "image"):
        return "other"
    return "field"


class ElementMap:
    """Normalised label -> elements of the live page."""

    def __init__(self, entries: list[dict]):
        self.by_label: dict[str, list[Element]] = {}
        for e in entries:
            el = Element(_kind(e), e["label"], e["selector"], e["type"], tuple(tuple(o) for o in e["options"]))
            self.by_label.setdefault(_label_key(e["label"]), []).append(el)

    def find(self, label: str, kinds: Sequence[str]) -> tuple[Element | None, str]:
        """(the one element labelled ``label`` of one of ``kinds``, '') or (None, why not)."""
        found = self.by_label.get(_label_key(label), [])
        if not found:
            return None, f"no element labelled {label!r}"
        fit = [e for e in found if e.kind in kinds]
        if not fit:
            is_a = _KIND_NAMES.get(found[0].kind, "another kind of element")
            return None, f"{label!r} is {is_a}, not {' or '.join(_KIND_NAMES[k] for k in kinds)}"
        if len(fit) > 1:
            return None, f"{label!r} names {len(fit)} elements"
        return fit[0], ""


async def run_action(page, emap: ElementMap, action: Action, timeout_s: float) -> tuple[str, bool]:
    """Execute one action: ('', navigated) on success, (why it failed, False) otherwise.
    Playwright errors propagate (the caller tells a crash from a failed action)."""
    ms = timeout_s * 1000
    verb = action.verb
    if verb == "fill":
        el, why = emap.find(action.label, FILL_KINDS)
        if el is None:
            return why, False
        await page.fill(el.selector, action.value, timeout=ms)
        if el.type in SANITISED_TYPES and action.value.strip() and not await page.input_value(el.selector, timeout=ms):
            return f"{action.label!r} ({el.type}) did not take {action.value!r}", False
        return "", False
    if verb == "select":
        el, why = emap.find(action.label, ("select", "radio_group", "checkbox_group"))
        if el is None:
            return why, False
        target = el.option(action.value)
        if target is None:
            return f"{action.label!r} has no option {action.value!r}", False
        if el.kind == "select":
            await page.select_option(el.selector, value=target, timeout=ms)
        else:
            await page.check(target, timeout=ms)
        return "", False
    if verb in ("check", "uncheck"):
        el, why = emap.find(action.label, ("checkbox", "radio") if verb == "check" else ("checkbox",))
        if el is None:
            return why, False
        await (page.check if verb == "check" else page.uncheck)(el.selector, timeout=ms)
        return "", False
    el, why = emap.find(action.label, ("button",))          # click
    if el is None:
        return why, False
    if el.type == "submit":
        async with page.expect_navigation(wait_until="load", timeout=ms):
            await page.click(el.selector, timeout=ms)
        return "", True
    await page.click(el.selector, timeout=ms)
    return "", False
