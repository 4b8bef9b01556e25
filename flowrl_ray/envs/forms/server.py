"""The form server: real HTML forms over real HTTP on 127.0.0.1, validated server-side.

Routes:

    GET  /                         index of the forms, by domain
    GET  /forms/<id>[?episode=K]   the form; K is echoed in a hidden ``_episode`` input
    POST /forms/<id>               validate + record the submission under K; an "accepted" page
                                   (200) or a "rejected" page listing the errors (422)
    GET  /submissions/<K>          what was submitted under K, as JSON (for people and tools)
    GET  /healthz                  "ok"

Each browser episode loads its form with a fresh ``?episode=<uuid>``, so the reward code can ask
the server exactly what *that* page submitted (:meth:`SubmissionStore.take`), however many
episodes run in parallel. Forms carry ``novalidate``: the browser never blocks a submission, the
server is the one judge (required fields, types, options, bounds), and rejected submissions are
recorded too.

The server is stdlib ``ThreadingHTTPServer`` on an ephemeral port in a background thread;
:class:`FormServer` is a context manager (``with FormServer(catalog) as srv: srv.url``).
"""

from __future__ import annotations

import collections
import datetime as _dt
import html
import json
import math
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from flowrl_ray.envs.forms.spec import FieldSpec, FormCatalog, FormSpec, normalize_label

EPISODE_FIELD = "_episode"
EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
TEL_RE = re.compile(r"^\+?[0-9 ().\-]+$")
MAX_BODY_BYTES = 1 << 20

_CSS = """
body{font-family:system-ui,sans-serif;max-width:44rem;margin:2rem auto;padding:0 1rem;color:#222}
form div.row{margin:.8rem 0}
label{display:block;font-weight:600;margin-bottom:.2rem}
label.required::after{content:" *";color:#b00}
fieldset{border:1px solid #ccc;border-radius:4px;margin:.8rem 0}
fieldset.required legend::after{content:" *";color:#b00}
fieldset label,div.check label{display:inline;font-weight:400;margin-left:.3rem}
input[type=text],input[type=email],input[type=tel],input[type=number],input[type=date],select,textarea{
  width:100%;padding:.35rem;box-sizing:border-box}
textarea{min-height:5rem}
button{margin-top:1rem;padding:.5rem 1.2rem}
.errors{color:#b00}
"""


# --------------------------------------------------------------------------- rendering

def _page(title: str, body: str) -> str:
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _render_field(f: FieldSpec) -> str:
    e = html.escape
    fid = f"f-{f.name}"
    req = " required" if f.required else ""
    cls = ' class="required"' if f.required else ""
    if f.type in ("radio",) or f.is_group:
        kind = "radio" if f.type == "radio" else "checkbox"
        items = []
        for i, opt in enumerate(f.options):
            oid = f"{fid}-{i}"
            items.append(f'<div class="check"><input type="{kind}" id="{oid}" name="{e(f.name)}" value="{e(opt)}">'
                         f'<label for="{oid}">{e(opt)}</label></div>')
        fcls = ' class="required"' if f.required else ""
        return (f'<fieldset id="{fid}" data-field="{e(f.name)}"{fcls}><legend>{e(f.label)}</legend>\n'
                + "\n".join(items) + "\n</fieldset>")
    if f.type == "checkbox":
        return (f'<div class="row check"><input type="checkbox" id="{fid}" name="{e(f.name)}" value="on"{req}>'
                f'<label for="{fid}"{cls}>{e(f.label)}</label></div>')
    label = f'<label for="{fid}"{cls}>{e(f.label)}</label>'
    if f.type == "select":
        opts = ['<option value="">Choose…</option>'] + [f'<option value="{e(o)}">{e(o)}</option>' for o in f.options]
        return f'<div class="row">{label}<select id="{fid}" name="{e(f.name)}"{req}>{"".join(opts)}</select></div>'
    ph = f' placeholder="{e(f.placeholder)}"' if f.placeholder else ""
    if f.type == "textarea":
        return f'<div class="row">{label}<textarea id="{fid}" name="{e(f.name)}"{req}{ph}></textarea></div>'
    extra = ""
    if f.type == "number":
        extra += f' step="{_num(f.step)}"'
    if f.min is not None:
        extra += f' min="{e(_num(f.min) if f.type == "number" else str(f.min))}"'
    if f.max is not None:
        extra += f' max="{e(_num(f.max) if f.type == "number" else str(f.max))}"'
    return f'<div class="row">{label}<input type="{f.type}" id="{fid}" name="{e(f.name)}"{req}{extra}{ph}></div>'


def render_form(form: FormSpec, episode: str = "") -> str:
    """The form's HTML page: every input has a ``<label for>``, radio and checkbox groups are
    fieldsets with a legend, one submit button carries the spec's ``submit`` text."""
    e = html.escape
    desc = f"<p>{e(form.description)}</p>" if form.description else ""
    body = (f"<h1>{e(form.title)}</h1>{desc}\n"
            f'<form id="form" method="post" action="/forms/{e(form.id)}" novalidate>\n'
            f'<input type="hidden" name="{EPISODE_FIELD}" value="{e(episode)}">\n'
            + "\n".join(_render_field(f) for f in form.fields)
            + f'\n<button type="submit" id="submit">{e(form.submit)}</button>\n</form>')
    return _page(form.title, body)


def render_index(catalog: FormCatalog) -> str:
    e = html.escape
    by_domain: dict[str, list[FormSpec]] = collections.defaultdict(list)
    for f in catalog:
        by_domain[f.domain].append(f)
    parts = [f"<h1>Forms</h1><p>{len(catalog)} forms in {len(by_domain)} domains.</p>"]
    for domain in sorted(by_domain):
        items = "".join(f'<li><a href="/forms/{e(f.id)}">{e(f.title)}</a>{" (held out)" if f.heldout else ""}</li>'
                        for f in sorted(by_domain[domain], key=lambda f: f.title))
        parts.append(f"<h2>{e(domain.title())}</h2><ul>{items}</ul>")
    return _page("Forms", "\n".join(parts))


def _render_result(form: FormSpec, sub: "Submission") -> str:
    e = html.escape
    if sub.accepted:
        rows = "".join(f"<tr><th>{e(form.field(k).label)}</th><td>{e(str(v))}</td></tr>" for k, v in sub.values.items())
        body = f'<h1 id="result">Submission accepted</h1><p>{e(form.title)}</p><table>{rows}</table>'
    else:
        errs = "".join(f"<li>{e(x)}</li>" for x in sub.errors)
        body = f'<h1 id="result">Submission rejected</h1><p>{e(form.title)}</p><ul class="errors">{errs}</ul>'
    return _page(form.title, body + f'<p><a href="/forms/{e(form.id)}">Back to the form</a></p>')


# --------------------------------------------------------------------------- validation

def _number(f: FieldSpec, raw: str) -> tuple[Any, str | None]:
    try:
        x = float(raw)
    except ValueError:
        return None, f"{f.label}: {raw!r} is not a number"
    if not math.isfinite(x):
        return None, f"{f.label}: {raw!r} is not a number"
    if f.integer and not x.is_integer():
        return None, f"{f.label}: must be a whole number, got {raw!r}"
    if f.min is not None and x < f.min:
        return None, f"{f.label}: must be at least {_num(f.min)}"
    if f.max is not None and x > f.max:
        return None, f"{f.label}: must be at most {_num(f.max)}"
    return (int(x) if f.integer else x), None


def _date(f: FieldSpec, raw: str) -> tuple[Any, str | None]:
    try:
        d = _dt.date.fromisoformat(raw).isoformat()
    except ValueError:
        return None, f"{f.label}: {raw!r} is not a date (YYYY-MM-DD)"
    if f.min is not None and d < f.min:
        return None, f"{f.label}: must be on or after {f.min}"
    if f.max is not None and d > f.max:
        return None, f"{f.label}: must be on or before {f.max}"
    return d, None


def validate_submission(form: FormSpec, data: dict[str, list[str]]) -> tuple[dict[str, Any], list[str]]:
    """(values, errors) for posted form data (``parse_qs`` layout: name -> list of strings).
    ``values`` holds every field that was given, typed (numbers, bools, lists); a submission is
    accepted when ``errors`` is empty. Unknown posted names are ignored."""
    values: dict[str, Any] = {}
    errors: list[str] = []
    for f in form.fields:
        raw_list = [s.strip() for s in data.get(f.name, [])]
        if f.is_group:
            chosen = [s for s in raw_list if s]
            by_norm = {normalize_label(o): o for o in f.options}
            bad = [s for s in chosen if normalize_label(s) not in by_norm]
            if bad:
                errors.append(f"{f.label}: {bad[0]!r} is not one of the options")
            picked = sorted({by_norm[normalize_label(s)] for s in chosen if normalize_label(s) in by_norm},
                            key=f.options.index)
            if picked:
                values[f.name] = picked
            elif f.required:
                errors.append(f"{f.label}: choose at least one option")
            continue
        if f.type == "checkbox":
            checked = any(s for s in raw_list)
            values[f.name] = checked
            if f.required and not checked:
                errors.append(f"{f.label}: must be checked")
            continue
        given = [s for s in raw_list if s]
        raw = given[0] if given else ""
        if len(given) > 1:
            errors.append(f"{f.label}: one value expected, got {len(given)}")
        if not raw:
            if f.required:
                errors.append(f"{f.label}: required")
            continue
        err = None
        value: Any = raw
        if f.type == "number":
            value, err = _number(f, raw)
        elif f.type == "date":
            value, err = _date(f, raw)
        elif f.type == "email" and not EMAIL_RE.match(raw):
            err = f"{f.label}: {raw!r} is not an email address"
        elif f.type == "tel" and not (TEL_RE.match(raw) and sum(c.isdigit() for c in raw) >= 7):
            err = f"{f.label}: {raw!r} is not a phone number"
        elif f.type in ("select", "radio"):
            match = [o for o in f.options if normalize_label(o) == normalize_label(raw)]
            if match:
                value = match[0]
            else:
                err = f"{f.label}: {raw!r} is not one of the options"
        if err:
            errors.append(err)
        values[f.name] = raw if err else value
    return values, errors


# --------------------------------------------------------------------------- the store

@dataclass
class Submission:
    form_id: str
    key: str                         # the episode key the page was loaded with ('' if none)
    values: dict[str, Any]
    accepted: bool
    errors: list[str] = field(default_factory=list)
    time: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class SubmissionStore:
    """Submissions by episode key, thread-safe, bounded (the oldest keys go first) so that a
    long run that never collects some keys cannot grow without limit."""

    def __init__(self, max_keys: int = 10_000):
        self._lock = threading.Lock()
        self._by_key: collections.OrderedDict[str, list[Submission]] = collections.OrderedDict()
        self.max_keys = max_keys
        self.count = 0                 # submissions ever recorded

    def add(self, sub: Submission) -> None:
        with self._lock:
            self._by_key.setdefault(sub.key, []).append(sub)
            self._by_key.move_to_end(sub.key)
            self.count += 1
            while len(self._by_key) > self.max_keys:
                self._by_key.popitem(last=False)

    def get(self, key: str) -> list[Submission]:
        with self._lock:
            return list(self._by_key.get(key, []))

    def take(self, key: str) -> list[Submission]:
        """The submissions under ``key``, removed from the store (an episode collects its own)."""
        with self._lock:
            return self._by_key.pop(key, [])


# --------------------------------------------------------------------------- HTTP

def _make_handler(catalog: FormCatalog, store: SubmissionStore, server: "FormServer"):
    class Handler(BaseHTTPRequestHandler):
        server_version = "flowrl-forms/1"
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):       # quiet: one line per request would swamp the logs
            pass

        def _send(self, status: int, body: str, ctype: str = "text/html; charset=utf-8") -> None:
            data = body.encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def _form(self, path: str) -> FormSpec | None:
            parts = path.strip("/").split("/")
            if len(parts) == 2 and parts[0] == "forms" and parts[1] in catalog:
                return catalog[parts[1]]
            return None

        def do_GET(self):
            url = urlsplit(self.path)
            if url.path in ("/", "/forms", "/forms/"):
                return self._send(200, render_index(catalog))
            if url.path == "/healthz":
                return self._send(200, "ok\n", "text/plain")
            if url.path.startswith("/submissions/"):
                key = url.path[len("/submissions/"):]
                return self._send(200, json.dumps([s.to_dict() for s in store.get(key)]), "application/json")
            form = self._form(url.path)
            if form is None:
                return self._send(404, _page("Not found", f"<h1>Not found</h1><p>{html.escape(url.path)}</p>"))
            episode = parse_qs(url.query).get("episode", [""])[0]
            return self._send(200, render_form(form, episode))

        def do_POST(self):
            url = urlsplit(self.path)
            form = self._form(url.path)
            length = int(self.headers.get("Content-Length") or 0)
            if form is None or length > MAX_BODY_BYTES:
                self.close_connection = True
                return self._send(404 if form is None else 413, _page("Error", "<h1>Cannot accept this</h1>"))
            body = self.rfile.read(length).decode("utf-8", errors="replace")
            server.posts_received += 1
            if server.submit_delay_s:
                time.sleep(server.submit_delay_s)
            data = parse_qs(body, keep_blank_values=True)
            key = data.pop(EPISODE_FIELD, [""])[0]
            values, errors = validate_submission(form, data)
            sub = Submission(form.id, key, values, accepted=not errors, errors=errors, time=time.time())
            store.add(sub)
            if server.on_submit is not None:
                server.on_submit(sub)
            return self._send(200 if sub.accepted else 422, _render_result(form, sub))

    return Handler


class FormServer:
    """The form server in a background thread. ``port=0`` picks a free port; ``url`` is the
    base URL once started. ``submit_delay_s`` holds every POST that long before answering (a slow
    backend; the tests use it to kill a browser while a submission is in flight); ``on_submit``
    is called (in the request's thread) with every recorded submission."""

    def __init__(self, catalog: FormCatalog, host: str = "127.0.0.1", port: int = 0,
                 submit_delay_s: float = 0.0, on_submit: Callable[[Submission], None] | None = None):
        self.catalog = catalog
        self.store = SubmissionStore()
        self.host, self.port = host, port
        self.submit_delay_s = submit_delay_s
        self.on_submit = on_submit
        self.posts_received = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the form server is not running")
        return f"http://{self.host}:{self._httpd.server_address[1]}"

    def form_url(self, form_id: str, episode: str = "") -> str:
        return f"{self.url}/forms/{form_id}" + (f"?episode={episode}" if episode else "")

    def start(self) -> "FormServer":
        if self._httpd is not None:
            return self
        httpd = ThreadingHTTPServer((self.host, self.port), _make_handler(self.catalog, self.store, self))
        httpd.daemon_threads = True
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="flowrl-form-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = self._thread = None

    def __enter__(self) -> "FormServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
