"""Where a Flow-GRPO iteration's time goes, from the metrics of finished `flowrl-ray train` runs.

    .venv/bin/python benchmarks/flow_grpo_iteration_time.py runs/a runs/b ...

Every iteration row of the runs' metrics.jsonl is split into its parts (the learner reports them):

- generate: the learner samples P prompts x G rollouts (``flow_grpo/generate_s``);
- scoring: the Chromium actors run and score the scripts (``sample_time_s`` - generate);
- update, and inside it the no-grad passes of the old log-probs (``update_old_logp_s``) and of the
  KL reference (``update_reference_s``), the rest being the gradient passes and optimiser steps;
- other: the iteration's wall time minus sampling and update (weights out, metrics, a checkpoint).

Iterations with an in-run evaluation are left out (their time includes it). Reported per part:
the median and the 10th-90th percentiles over the iterations of all runs, and its share of the
median iteration. Results: ``<results-dir>/<output>.{json,md}``. No assertion is made.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, git_revision, machine_info, md_table, write_json, write_results  # noqa: E402

PARTS = ("generate", "scoring", "update", "update: old log-probs", "update: KL reference",
         "update: gradient passes", "other", "iteration")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="finished Flow-GRPO run directories")
    p.add_argument("--skip", type=int, default=1, help="first iterations of each run left out (warm-up)")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--output", default="flow_grpo_iteration_time")
    return p.parse_args(argv)


def iteration_parts(rows: list[dict], skip: int = 1) -> list[dict[str, float]]:
    """Per training iteration without an evaluation (after the first ``skip``): {part: seconds}."""
    out, previous = [], None
    for r in rows:
        if "flow_grpo/update_s" not in r:             # the iteration-0 evaluation row
            previous = r.get("time_s", previous)
            continue
        wall = r["time_s"] - (previous or 0.0)
        previous = r["time_s"]
        if r["iteration"] <= skip or any(k.startswith("eval/") for k in r):
            continue
        update, old, ref = r["flow_grpo/update_s"], r["flow_grpo/update_old_logp_s"], r["flow_grpo/update_reference_s"]
        out.append({"generate": r["flow_grpo/generate_s"], "scoring": r["sample_time_s"] - r["flow_grpo/generate_s"],
                    "update": update, "update: old log-probs": old, "update: KL reference": ref,
                    "update: gradient passes": update - old - ref,
                    "other": wall - r["sample_time_s"] - update, "iteration": wall})
    return out


def main(argv=None) -> dict:
    import numpy as np

    from flowrl_ray.metrics import read_metrics
    args = parse_args(argv)
    parts = [p for run in args.runs for p in iteration_parts(read_metrics(run), args.skip)]
    if not parts:
        raise SystemExit("no training iteration without an evaluation in these runs")
    stats = {k: {"median": float(np.median([p[k] for p in parts])), "p10": float(np.percentile([p[k] for p in parts], 10)),
                 "p90": float(np.percentile([p[k] for p in parts], 90))} for k in PARTS}
    total = stats["iteration"]["median"]
    rows = [[k, f"{v['median']:.1f}", f"{v['p10']:.1f}-{v['p90']:.1f}", f"{100 * v['median'] / total:.0f} %"]
            for k, v in stats.items()]
    body = (f"Runs: {', '.join(f'`{r}`' for r in args.runs)}; {len(parts)} iterations (the first {args.skip} of "
            f"each and those with an evaluation left out).\n\n"
            + md_table(["part", "median s", "10th-90th percentile", "share of the median iteration"], rows) + "\n")
    write_results(args.output, "Flow-GRPO: where an iteration's time goes", body, results_dir=Path(args.results_dir))
    results = {"runs": args.runs, "iterations": len(parts), "parts": stats, "machine": machine_info(),
               "git": git_revision()}
    write_json(Path(args.results_dir) / f"{args.output}.json", results)
    return results


if __name__ == "__main__":
    main()
