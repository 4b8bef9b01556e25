"""SFT bases in the browser: which checkpoint is the better start for Flow-GRPO? Each checkpoint's
completions of the same held-out evaluation tasks, executed in headless Chromium and scored by the
env's reward (the forms protocol's evaluation of its base), and each checkpoint's difference to the
first, paired by task, with a 95 % percentile-bootstrap CI.

    .venv/bin/python benchmarks/forms_bases.py pretrained/forms_small_sft pretrained/forms_small_sft_cont \\
        --tasks 96 --output forms_bases

Every checkpoint runs with one config (``--config``, default ``configs/flow_grpo/forms_small.yaml``,
plus ``key=value`` overrides; only ``algo.sft_checkpoint`` changes), so the tasks, the sampler and
the number of unmasking steps are the same. Greedy rows under the task kinds' names; with the
config's ``algo.eval_sampled`` also the same tasks sampled at the training temperature, under
``sampled/<kind>`` (``--greedy-only`` leaves them out). Offline (no browser) scores of one
checkpoint: ``benchmarks/forms_sft_copy.py``.

Reported: ``<results-dir>/<output>.{json,md}`` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, git_revision, machine_info, md_table, write_json, write_results  # noqa: E402
from forms_protocol import MIN_TASKS, evaluate_config, gain_rows, log, summarise  # noqa: E402

CONFIG = "configs/flow_grpo/forms_small.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                   help="SFT checkpoint directories (the first is the one the others are compared with)")
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--tasks", type=int, default=MIN_TASKS, help=f"held-out evaluation tasks (>= {MIN_TASKS} for a result)")
    p.add_argument("--greedy-only", action="store_true", help="leave out the sampled rows (half the time)")
    p.add_argument("--n-boot", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--output", default="forms_bases")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every checkpoint (repeatable), e.g. algo.num_generation_steps=32")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from flowrl_ray.config import ConfigError, load_config
    dirs = [Path(c).resolve() for c in args.checkpoints]
    missing = [str(c) for c, d in zip(args.checkpoints, dirs) if not (d / "config.json").is_file()]
    if missing:
        print(f"error: not an SFT checkpoint directory (no config.json): {', '.join(missing)}", file=sys.stderr)
        return 2
    if args.tasks < 1:
        print(f"error: --tasks must be >= 1, got {args.tasks}", file=sys.stderr)
        return 2
    common = [*args.overrides, f"eval.episodes={args.tasks}"] + (["algo.eval_sampled=false"] if args.greedy_only else [])
    try:
        cfgs = [load_config(args.config, [*common, f"algo.sft_checkpoint={d}"]) for d in dirs]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfgs[0].algorithm != "flow_grpo":
        print(f"error: {args.config} is a {cfgs[0].algorithm} config; forms bases need flow_grpo", file=sys.stderr)
        return 2
    if args.tasks < MIN_TASKS:
        log(f"{args.tasks} evaluation tasks; a result needs >= {MIN_TASKS}")

    t0 = time.perf_counter()
    outcomes = [evaluate_config(cfg, None, str(c)) for cfg, c in zip(cfgs, args.checkpoints)]
    first = outcomes[0]
    rows, record = [], []
    for c, o in zip(args.checkpoints, outcomes):
        if o["task_ids"] != first["task_ids"]:           # one config: a mismatch is a defect, not input
            raise RuntimeError(f"{c} was evaluated on other tasks than {args.checkpoints[0]}")
        summary = summarise(first, [{"outcomes": o}], args.n_boot)
        rows += [[r[0], r[1], r[2], r[3], r[4], r[6], r[7]] for r in gain_rows(c, summary)]   # one 'seed': per seed = mean
        record.append({"checkpoint": c, "outcomes": o, "summary": summary})
    results = {"benchmark": "forms_bases", "revision": git_revision(), "machine": machine_info(),
               "config": args.config, "overrides": args.overrides, "tasks": args.tasks,
               "compared_with": args.checkpoints[0], "checkpoints": record,
               "eval_time_s": round(time.perf_counter() - t0, 1)}
    results_dir = Path(args.results_dir)
    write_json(results_dir / f"{args.output}.json", results)
    times = ", ".join(f"{c} {o['seconds'] / 60:.1f} min ({o['invalid']} invalid)"
                      for c, o in zip(args.checkpoints, outcomes))
    body = (f"Each SFT checkpoint's completions of the same {args.tasks} held-out evaluation tasks (config "
            f"`{args.config}`{', ' + ' '.join(args.overrides) if args.overrides else ''}), executed in "
            f"headless Chromium and scored by the env's reward; greedy rows under the kinds' names, sampled ones "
            f"under sampled/<kind>. Column `base`: `{args.checkpoints[0]}`; "
            f"difference in points with a 95 % percentile bootstrap CI over tasks ({args.n_boot:,} resamples, "
            f"paired by task).\n\n"
            + md_table(["checkpoint", "tasks", "n", "metric", "base", "checkpoint's", "difference [95 % CI], points"],
                       rows)
            + f"\n\nEvaluation time: {times}.\n")
    write_results(args.output, "Forms SFT bases in the browser", body, results_dir=results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
