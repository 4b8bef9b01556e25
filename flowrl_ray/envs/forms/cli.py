"""The forms family's command-line verb: ``flowrl-ray forms serve|run|tasks|list`` (the forms on a
local server for a person, an action script in the browser, a split's tasks, the catalog).
:func:`add_verbs` is what ``flowrl_ray.cli`` calls."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from flowrl_ray.errors import UserError


def _forms_catalog(forms_dir: str | None):
    from flowrl_ray.envs.forms import FormCatalog, FormSpecError
    try:
        return FormCatalog.load(forms_dir)
    except FormSpecError as e:
        raise UserError(str(e)) from None


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM end a serving loop with KeyboardInterrupt, also when the process was
    started with SIGINT ignored (a shell's background job), where Python installs no handler."""
    import signal

    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def cmd_forms_serve(args: argparse.Namespace) -> int:
    from flowrl_ray.envs.forms import FormServer
    catalog = _forms_catalog(args.forms_dir)

    def show(sub) -> None:
        verdict = "accepted" if sub.accepted else f"rejected ({'; '.join(sub.errors)})"
        print(f"[flowrl_ray] {sub.form_id}: submission {verdict}", flush=True)

    server = FormServer(catalog, host=args.host, port=args.port, on_submit=show)
    _stop_on_signals()
    try:
        server.start()
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    print(f"[flowrl_ray] {len(catalog)} forms at {server.url}/ (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("[flowrl_ray] stopping the form server", flush=True)
    finally:
        server.stop()
    return 0


def cmd_forms_run(args: argparse.Namespace) -> int:
    from flowrl_ray.envs.forms import BrowserPool, BrowserUnavailable, FormServer, task_from_id
    catalog = _forms_catalog(args.forms_dir)
    if args.form_id not in catalog:
        raise UserError(f"unknown form {args.form_id!r}; `flowrl-ray forms list` shows them")
    task = None
    if args.task:
        try:
            task = task_from_id(args.task, catalog)
        except (ValueError, KeyError) as e:
            raise UserError(f"--task: {e.args[0]}") from None
        if task.form_id != args.form_id:
            raise UserError(f"--task {args.task} is a task on form {task.form_id!r}, not {args.form_id!r}")
    if args.actions == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(args.actions).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise UserError(f"--actions {args.actions}: {e.strerror or e}") from None
    for name in ("action_timeout", "rollout_timeout"):
        if getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(args, name)}")
    try:
        with FormServer(catalog) as server, BrowserPool(server, pages=1, action_timeout_s=args.action_timeout,
                                                        rollout_timeout_s=args.rollout_timeout) as pool:
            [result] = pool.execute([(task if task is not None else args.form_id, text)])
    except BrowserUnavailable as e:
        raise UserError(str(e)) from None
    print(json.dumps(result.to_dict()), flush=True)
    return 0


def cmd_forms_tasks(args: argparse.Namespace) -> int:
    from flowrl_ray.envs.forms import gold_actions
    from flowrl_ray.envs.forms.tasks import load_tasks
    if args.per_form is not None and args.per_form < 1:
        raise UserError(f"--per-form: must be >= 1, got {args.per_form}")
    catalog = _forms_catalog(args.forms_dir)
    for task in load_tasks(args.split, seed=args.seed, per_form=args.per_form, catalog=catalog):
        row = task.to_dict()
        if args.gold:
            row["gold_actions"] = gold_actions(task, catalog)
        print(json.dumps(row))
    return 0


def cmd_forms_list(args: argparse.Namespace) -> int:
    catalog = _forms_catalog(args.forms_dir)
    rows = [(f.id, f.domain, "held out" if f.heldout else "train", str(len(f.fields)), f.title) for f in catalog]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in sorted(rows, key=lambda r: (r[1], r[0])):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    return 0

def add_verbs(sub) -> None:
    """Adds ``forms`` (with its subcommands) to the ``flowrl-ray`` subparsers ``sub``."""
    fo = sub.add_parser("forms", help="browser form filling: serve the forms, run an action script, list tasks",
                        description="The forms env family: real HTML forms on a local HTTP server, action "
                                    "scripts executed in headless Chromium (Playwright), tasks with gold values.")
    fsub = fo.add_subparsers(dest="forms_verb", required=True, metavar="SUBCOMMAND")
    fs = fsub.add_parser("serve", help="serve the forms for a person to open (prints the URL; Ctrl-C stops)")
    fs.add_argument("--forms-dir", help="a directory of extra form spec files (*.json)")
    fs.add_argument("--host", default="127.0.0.1")
    fs.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    fs.set_defaults(func=cmd_forms_serve)
    fr = fsub.add_parser("run", help="execute an action script on a form in the browser; prints the reward as JSON",
                         description="Execute FILE (one action per line: fill/select/check/uncheck/click) on form "
                                     "FORM_ID in headless Chromium and print the reward breakdown as JSON. With "
                                     "--task the submission is scored against the task's gold fields; without it "
                                     "field_accuracy is null and left out of the reward.")
    fr.add_argument("form_id")
    fr.add_argument("--actions", required=True, metavar="FILE", help="the action script ('-': stdin)")
    fr.add_argument("--task", metavar="TASK_ID", help="score against this task (from `forms tasks`)")
    fr.add_argument("--forms-dir", help="a directory of extra form spec files (*.json)")
    fr.add_argument("--action-timeout", type=float, default=5.0, help="seconds per action")
    fr.add_argument("--rollout-timeout", type=float, default=30.0, help="seconds for the whole script")
    fr.set_defaults(func=cmd_forms_run)
    ft = fsub.add_parser("tasks", help="print a split's tasks as JSON lines",
                         description="Print the tasks of a split, one JSON object per line: task_id, form_id, url, "
                                     "instruction, ground_truth_fields, split. The same seed gives the same tasks.")
    ft.add_argument("--split", required=True, choices=["train", "sft", "rl", "eval", "heldout", "heldout_values", "heldout_forms"])
    ft.add_argument("--seed", type=int, default=0)
    ft.add_argument("--per-form", type=int, help="tasks per form (default 32 train, 8 per held-out kind)")
    ft.add_argument("--forms-dir", help="a directory of extra form spec files (*.json)")
    ft.add_argument("--gold", action="store_true", help="add each task's gold action script")
    ft.set_defaults(func=cmd_forms_tasks)
    fl = fsub.add_parser("list", help="list the forms (id, domain, split, fields, title)")
    fl.add_argument("--forms-dir", help="a directory of extra form spec files (*.json)")
    fl.set_defaults(func=cmd_forms_list)
