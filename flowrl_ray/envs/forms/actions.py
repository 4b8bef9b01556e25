"""The action language a policy writes, one action per line:

    fill "<label>" "<value>"        type into a text, email, tel, number, date or textarea field
    select "<label>" "<option>"     choose an option of a select list or a radio group
                                    (on a checkbox group: tick that option)
    check "<label>"                 tick a checkbox (or a radio button, by its own label)
    uncheck "<label>"               untick a checkbox
    click "<button text>"           press a button (the submit button submits the form)

Verbs are case-insensitive; arguments are double- or single-quoted strings in which a backslash
escapes the next character (``\\"``, ``\\\\``). Blank lines are ignored. Any other line is
*unparseable*: it is counted and reported, never raised on, because the text comes from a model
that may write anything. Labels are matched later against the live page's element map, case- and
whitespace-insensitively (:func:`flowrl_ray.envs.forms.spec.normalize_label`).

The parser is a hand-written scanner (no regular expressions) so that its cost is linear in the
input whatever the input is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: verb -> number of quoted arguments
ARITY = {"fill": 2, "select": 2, "check": 1, "uncheck": 1, "click": 1}
#: at most this many unparseable lines are kept verbatim (all are counted)
KEEP_BAD_LINES = 20
#: a kept unparseable line is cut to this many characters
KEEP_BAD_CHARS = 200


@dataclass(frozen=True)
class Action:
    verb: str                      # one of ARITY
    args: tuple[str, ...]
    line: int                      # 1-based line number in the script

    @property
    def label(self) -> str:
        return self.args[0]

    @property
    def value(self) -> str | None:
        return self.args[1] if len(self.args) > 1 else None

    def __str__(self) -> str:
        return format_action(self.verb, *self.args)


@dataclass
class ParsedScript:
    actions: list[Action] = field(default_factory=list)
    unparseable: int = 0                                     # lines that are not an action
    bad_lines: list[tuple[int, str]] = field(default_factory=list)   # (line number, text), first few

    def to_dict(self) -> dict:
        return {"actions": [str(a) for a in self.actions], "unparseable_lines": self.unparseable,
                "bad_lines": [list(x) for x in self.bad_lines]}


def quote(text: str) -> str:
    """``text`` as a double-quoted argument (backslash and double quote escaped)."""
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def format_action(verb: str, *args: str) -> str:
    return " ".join([verb, *(quote(a) for a in args)])


def _parse_line(line: str) -> tuple[str, tuple[str, ...]] | None:
    """(verb, args) or None. Scans once, left to right."""
    n, i = len(line), 0
    while i < n and not line[i].isspace():
        i += 1
    verb = line[:i].lower()
    if verb not in ARITY:
        return None
    args: list[str] = []
    while True:
        while i < n and line[i].isspace():
            i += 1
        if i == n:
            break
        q = line[i]
        if q not in "\"'":
            return None
        i += 1
        buf: list[str] = []
        closed = False
        while i < n:
            c = line[i]
            if c == "\\" and i + 1 < n:
                buf.append(line[i + 1])
                i += 2
            elif c == q:
                closed = True
                i += 1
                break
            else:
                buf.append(c)
                i += 1
        if not closed:
            return None
        args.append("".join(buf))
        if len(args) > ARITY[verb]:
            return None
        if i < n and not line[i].isspace():          # `"a""b"` or `"a"x`: arguments need spaces
            return None
    if len(args) != ARITY[verb]:
        return None
    return verb, tuple(args)


def parse_actions(text: object) -> ParsedScript:
    """Parse a model's output. Never raises: anything that is not a string is decoded (bytes)
    or treated as one unparseable line."""
    out = ParsedScript()
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        out.unparseable = 1
        out.bad_lines.append((1, repr(text)[:KEEP_BAD_CHARS]))
        return out
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        parsed = _parse_line(line)
        if parsed is None:
            out.unparseable += 1
            if len(out.bad_lines) < KEEP_BAD_LINES:
                out.bad_lines.append((number, line[:KEEP_BAD_CHARS]))
        else:
            out.actions.append(Action(parsed[0], parsed[1], number))
    return out
