"""Asynchronous sampling that paces (``runtime.mode=async``) against synchronous sampling: the
same config, seeds and env-step budget, one machine, one run after another.

Run from the repository root:

    # PPO on HalfCheetah-v5: 3 seeds x 200k env steps per mode (about 15 minutes on 2 idle cores)
    .venv/bin/python benchmarks/async_pacing.py --config configs/ppo/halfcheetah.yaml --seeds 0 1 2 \\
        --steps 200000 --output async_pacing_halfcheetah
    # finished runs (e.g. FPO++ on Lift, whose learning the robot protocol measures): throughput
    # and staleness only
    .venv/bin/python benchmarks/async_pacing.py --runs sync=runs/a0,runs/a1 --runs async=runs/b0,runs/b1 \\
        --output async_pacing_lift

Per mode: env steps per second of the training loop (env steps / the loop's wall-clock), the
iteration time split into waiting for samples and the learner's update, the policy lag of the
batches the updates used (a histogram: how many batches were 0, 1, ... versions old, read from
each iteration's ``policy_lag_mean``, ``policy_lag_max`` and ``batches``; exact where the largest
lag is 1) and the dropped batches (0 by design). With ``--config`` also the learning: the final
training return and the deterministic evaluation of each final policy (the same seeded episodes
for both modes of a seed), with async minus sync paired by (seed, episode) and a 95 % bootstrap
CI over those pairs (:func:`flowrl_ray.stats.paired_bootstrap_gain`; it covers the evaluation's
episodes, the 3 training seeds enter as an average), and curves as mean +- std over seeds against
env steps and wall-clock. Written to ``benchmarks/results/<output>.{json,md}`` and
``<output>_{steps,wallclock}.png``. No assertion is made.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS_DIR, git_revision, md_table, write_json,  # noqa: E402
                     wait_for_quiet, write_results)

MODES = {"sync": ["runtime.mode=sync"], "async": ["runtime.mode=async"]}


def lag_histogram(rows: list[dict]) -> dict[int, int]:
    """Batches used per policy lag, from each iteration's mean, max and count: exact when the
    largest lag is 1 (sum of lags = number of lag-1 batches); otherwise the sum of lags is put
    at the max lag and the rest at 0 (a lower bound on the spread)."""
    hist: dict[int, int] = {}
    for r in rows:
        n, top = int(r["batches"]), int(r.get("policy_lag_max", 0))
        lagged = round(r["policy_lag_mean"] * n / top) if top else 0
        hist[top] = hist.get(top, 0) + lagged
        hist[0] = hist.get(0, 0) + n - lagged
    return dict(sorted((k, v) for k, v in hist.items() if v))


def run_stats(run_dir: str | Path) -> dict:
    """Throughput, time split and staleness of a finished run (its metrics.jsonl)."""
    from flowrl_ray.metrics import read_metrics
    rows = [r for r in read_metrics(run_dir) if r.get("iteration", 0) > 0 and "batches" in r]
    loop = rows[-1]["time_s"]
    return {"run_dir": str(run_dir), "iterations": len(rows), "steps": rows[-1]["env_steps"], "loop_s": loop,
            "steps_per_s": rows[-1]["env_steps"] / loop,
            "sample_s": float(np.mean([r["sample_time_s"] for r in rows])),
            "update_s": float(np.mean([r["learner/update_time_s"] for r in rows])),
            "lags": lag_histogram(rows), "dropped": int(rows[-1]["dropped_batches"]),
            "curve": [(r["env_steps"], r["time_s"], r.get("episode_return_mean")) for r in rows]}


def _mean_std(values) -> str:
    v = np.array([x for x in values if x is not None], float)
    return "–" if v.size == 0 else f"{v.mean():,.1f} ± {v.std():,.1f}"


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    from flowrl_ray.plotting import plot_curves
    from flowrl_ray.stats import paired_bootstrap_gain

    headers = ["mode", "seeds", "env steps", "env steps/s (loop)", "waiting for samples (s/iter)",
               "update (s/iter)", "batches by policy lag", "dropped"]
    rows = []
    for mode, runs in results.items():
        hist: dict[int, int] = {}
        for r in runs:
            for k, v in r["lags"].items():
                hist[int(k)] = hist.get(int(k), 0) + v
        rows.append([mode, len(runs), f"{int(np.mean([r['steps'] for r in runs])):,}",
                     _mean_std([r["steps_per_s"] for r in runs]), _mean_std([r["sample_s"] for r in runs]),
                     _mean_std([r["update_s"] for r in runs]),
                     ", ".join(f"lag {k}: {v}" for k, v in sorted(hist.items())), sum(r["dropped"] for r in runs)])
    body = [f"Code: {git_revision()}. " + (args.note or ""), "", md_table(headers, rows), ""]
    if set(results) >= {"sync", "async"} and len(results["sync"]) == len(results["async"]):
        ratio = [a["steps_per_s"] / s["steps_per_s"] for s, a in zip(results["sync"], results["async"])]
        body.append(f"Async / sync env steps per second, per seed: {', '.join(f'{x:.2f}x' for x in ratio)} "
                    f"(mean {np.mean(ratio):.2f}x).")
        body.append("")
    if all("eval_returns" in r for runs in results.values() for r in runs) and set(results) >= {"sync", "async"}:
        headers = ["mode", "final training return", "deterministic eval return", "eval return per seed"]
        body.append(md_table(headers, [[m, _mean_std([r["final_train_return"] for r in runs]),
                                        _mean_std([r["eval_return"] for r in runs]),
                                        ", ".join(f"{r['eval_return']:,.0f}" for r in runs)]
                                       for m, runs in results.items()]))
        a = np.array([r["eval_returns"] for r in results["async"]], float).reshape(1, -1)
        s = np.array([r["eval_returns"] for r in results["sync"]], float).reshape(-1)
        g = paired_bootstrap_gain(a, s)
        body += ["", f"Async minus sync, deterministic eval return paired by (seed, episode) over "
                     f"{g['episodes']} pairs: {g['gain']:+,.1f} [95 % CI {g['ci_low']:+,.1f}, {g['ci_high']:+,.1f}].", ""]
    for x, i, name in (("env steps", 0, "steps"), ("wall-clock (s)", 1, "wallclock")):
        data = {m: [(np.array([c[i] for c in r["curve"] if c[2] is not None], float),
                     np.array([c[2] for c in r["curve"] if c[2] is not None], float)) for r in runs]
                for m, runs in results.items()}
        data = {m: [d for d in ds if len(d[0]) >= 2] for m, ds in data.items()}
        if any(data.values()):
            png = plot_curves({m: ds for m, ds in data.items() if ds}, RESULTS_DIR / f"{args.output}_{name}.png",
                              x, "training episode return", "sync vs paced async")
            body.append(f"![{name}]({png.name})")
    write_json(RESULTS_DIR / f"{args.output}.json",
        {"revision": git_revision(), "results": results})
    write_results(args.output, "Paced asynchronous sampling vs synchronous sampling", "\n".join(body))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="train this config in both modes per seed")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200_000, help="with --config: env-step budget per run")
    p.add_argument("--staleness", type=int, default=1, help="with --config: async's runtime.max_staleness")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--runs", action="append", metavar="MODE=RUN,RUN,...", help="finished runs of one mode")
    p.add_argument("--wait-quiet", type=float, default=120, help="first wait up to this long for an idle machine")
    p.add_argument("--note", help="a line printed with the results")
    p.add_argument("--output", default="async_pacing")
    args = p.parse_args()
    if bool(args.config) == bool(args.runs):
        p.error("give --config (train both modes) or --runs (finished runs)")
    results: dict[str, list[dict]] = {}
    if args.runs:
        for item in args.runs:
            mode, _, dirs = item.partition("=")
            results[mode] = [run_stats(d) for d in dirs.split(",") if d]
    else:
        from _runners import run_flowrl
        if args.wait_quiet:
            print(f"[bench] {wait_for_quiet(args.wait_quiet)}", flush=True)
        for seed in args.seeds:                       # both modes of a seed back to back
            for mode, overrides in MODES.items():
                extra = overrides + ([f"runtime.max_staleness={args.staleness}"] if mode == "async" else [])
                r = run_flowrl(args.config, args.steps, seed, extra, args.eval_episodes)
                results.setdefault(mode, []).append({**run_stats(r["run_dir"]), "seed": seed,
                                                     "final_train_return": r["final_train_return"],
                                                     "eval_return": r["eval_return"], "eval_returns": r["eval_returns"]})
    report(results, args)


if __name__ == "__main__":
    main()
