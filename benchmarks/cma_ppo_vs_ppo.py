"""CMA-PPO vs PPO vs RLlib's PPO on BipedalWalker-v3 and HalfCheetah-v5: the same seeds and the
same env-step budget for every side, one machine, one run.

Run from the repository root (about 45 minutes on 2 idle cores with the defaults):

    .venv/bin/python benchmarks/cma_ppo_vs_ppo.py                           # 3 seeds x 200k steps
    .venv/bin/python benchmarks/cma_ppo_vs_ppo.py --steps 20000 --seeds 1   # smoke run
    .venv/bin/python benchmarks/cma_ppo_vs_ppo.py --tasks halfcheetah --sides cma_ppo ppo

Sides (each trained for --steps env steps, rounded up to whole iterations, per seed):

- ``cma_ppo``: ``configs/cma_ppo/<task>.yaml``, the spec's defaults (16,000 steps per iteration,
  minibatch 2048, 5 epochs, fixed kernel_std 0.1).
- ``cma_ppo_4k``: the same config at the reference implementation's iteration size (4,096 steps
  per iteration, minibatch 512, 12 epochs ~ its 100 minibatches per iteration) with the mirroring
  kernel measured in the policy's own std (``kernel: policy``), see ``CMA_4K``.
- ``ppo``: ``configs/ppo/<task>.yaml`` (flowrl_ray's Gaussian PPO).
- ``rllib``: RLlib's PPO (new API stack) with the numbers of ``configs/ppo/<task>.yaml``.

Runs go seed by seed (every side for seed 0, then seed 1, ...), so a drift in the machine's load
touches every side alike. Each finished run is appended to ``benchmarks/results/<output>.json``
(``--resume`` skips the runs already there). At the end: per task, a table (final training
return, deterministic eval return of the final policy, area under the learning curve, env steps,
wall-clock) as mean +- std over seeds, and a PNG of the learning curves with mean +- std bands,
in ``benchmarks/results/<output>.md`` and ``<output>_<task>.png``. No assertion is made.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, RESULTS_DIR, git_revision, md_table, wait_for_quiet, write_json, write_results  # noqa: E402
from _runners import run_flowrl, run_rllib  # noqa: E402

TASKS = {"bipedalwalker": "BipedalWalker-v3", "halfcheetah": "HalfCheetah-v5"}
SIDES = ["cma_ppo", "cma_ppo_4k", "ppo", "rllib"]
LABELS = {"cma_ppo": "CMA-PPO (spec defaults)", "cma_ppo_4k": "CMA-PPO (4k steps/iter, policy kernel)",
          "ppo": "PPO (flowrl_ray)", "rllib": "PPO (RLlib)"}
#: cma_ppo_4k: 2 workers x 4 envs x 512 steps = 4,096 per iteration
CMA_4K = ["runtime.envs_per_worker=4", "runtime.rollout_length=512", "algo.minibatch_size=512", "algo.epochs=12",
          "algo.kernel=policy"]


def config_path(side: str, task: str) -> Path:
    algo = "cma_ppo" if side.startswith("cma_ppo") else "ppo"
    return REPO_ROOT / "configs" / algo / f"{task}.yaml"


def run_one(side: str, task: str, seed: int, args: argparse.Namespace) -> dict:
    path = config_path(side, task)
    if side == "rllib":
        result = run_rllib(path, args.steps, seed, args.eval_episodes, args.return_window)
    else:
        result = run_flowrl(path, args.steps, seed, CMA_4K if side == "cma_ppo_4k" else [], args.eval_episodes,
                            args.return_window)
    return {**result, "side": side, "task": task}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    p.add_argument("--sides", nargs="+", choices=SIDES, default=SIDES)
    p.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 for every side")
    p.add_argument("--steps", type=int, default=200_000, help="env-step budget per run")
    p.add_argument("--eval-episodes", type=int, default=10, help="deterministic eval episodes of each final policy")
    p.add_argument("--return-window", type=int, default=10,
                   help="finished training episodes averaged for the training return")
    p.add_argument("--wait-quiet", type=float, default=300,
                   help="first wait up to this many seconds for the machine to be idle (0: don't)")
    p.add_argument("--output", default="cma_ppo_vs_ppo", help="results name (benchmarks/results/<name>.md)")
    p.add_argument("--resume", action="store_true", help="skip runs already in benchmarks/results/<name>.json")
    return p.parse_args()


# --------------------------------------------------------------------------- report

def _area(curve) -> float | None:
    from flowrl_ray.runtime.compare import learning_curve_area
    return learning_curve_area([{"env_steps": s, "r": r} for s, r in curve], key="r")


def _mean_std(values) -> str:
    v = np.array([x for x in values if x is not None and np.isfinite(x)], float)
    if v.size == 0:
        return "–"
    return f"{v.mean():,.1f} ± {v.std():,.1f}" + ("" if v.size == len(values) else f" (n={v.size})")


def task_section(task: str, runs: list[dict], args: argparse.Namespace) -> str:
    from flowrl_ray.plotting import plot_curves

    headers = ["side", "seeds", "env steps", "final training return", "deterministic eval return",
               "area under curve", "training loop (s)", "incl. startup (s)", "env steps/s"]
    rows, data = [], {}
    for side in [s for s in SIDES if any(r["side"] == s for r in runs)]:
        rs = [r for r in runs if r["side"] == side]
        loop = [r["loop_s"] for r in rs]
        rows.append([LABELS[side], ", ".join(str(r["seed"]) for r in rs), f"{int(np.mean([r['steps'] for r in rs])):,}",
                     _mean_std([r["final_train_return"] for r in rs]), _mean_std([r["eval_return"] for r in rs]),
                     _mean_std([_area(r["curve"]) for r in rs]), _mean_std(loop),
                     _mean_std([r["startup_s"] + r["loop_s"] for r in rs]),
                     f"{np.sum([r['steps'] for r in rs]) / np.sum(loop):,.0f}"])
        data[LABELS[side]] = [(np.array([s for s, v in r["curve"] if v is not None], float),
                               np.array([v for s, v in r["curve"] if v is not None], float))
                              for r in rs if sum(v is not None for _, v in r["curve"]) >= 2]
    png = RESULTS_DIR / f"{args.output}_{task}.png"
    plot_curves({k: v for k, v in data.items() if v}, png, ylabel="training episode return (window mean)",
                title=f"{TASKS[task]}: mean ± std over seeds")
    per_seed = [[LABELS[r["side"]], r["seed"], f"{r['steps']:,}", r["final_train_return"], r["eval_return"],
                 r["loop_s"], r.get("other_cores")] for r in runs]
    return (f"## {TASKS[task]}\n\n" + md_table(headers, rows) +
            f"\n\nLearning curves: `{png.relative_to(REPO_ROOT)}`\n\nPer run:\n\n" +
            md_table(["side", "seed", "env steps", "final training return", "eval return", "training loop (s)",
                      "other processes' CPU load (cores)"],
                     per_seed))


def report(runs: list[dict], args: argparse.Namespace, elapsed: float, quiet: str) -> str:
    setup = [
        f"- flowrl_ray revision: {git_revision()}",
        f"- budget: {args.steps:,} env steps per run (rounded up to whole iterations); seeds 0..{args.seeds - 1}; "
        f"deterministic eval of the final policy over {args.eval_episodes} episodes; training return = mean of "
        f"the last {args.return_window} finished training episodes",
        f"- CMA-PPO (spec defaults): configs/cma_ppo/<task>.yaml, 2 workers x 8 envs x 1000 steps = 16,000 "
        f"per iteration, minibatch 2048, 5 epochs per network, history 5, kernel_std 0.1 (fixed)",
        f"- CMA-PPO (4k steps/iter, policy kernel): the same config with {', '.join(CMA_4K)}",
        "- PPO (flowrl_ray): configs/ppo/<task>.yaml; PPO (RLlib): RLlib 2.60's PPO, new API stack, with the "
        "numbers of the same config (benchmarks/_runners.py: rllib_ppo_config). RLlib has no reward scale: "
        "configs/ppo/bipedalwalker.yaml's reward_scale 0.1 applies to flowrl_ray's PPO only; see "
        "benchmarks/results/ppo_vs_rllib.md for the remaining differences between the two PPOs",
        "- every side runs in this one process, one run after another, Ray started and shut down per run; "
        "training loop = from the moment every actor is up to the end of the last iteration",
        f"- before starting: {quiet}",
        f"- wall time of the runs (startup + training + final eval, summed): "
        f"{sum(r['startup_s'] + r['loop_s'] + r['eval_s'] for r in runs) / 60:.1f} min; this invocation: "
        f"{elapsed / 60:.1f} min",
    ]
    parts = ["## Setup\n\n" + "\n".join(setup)]
    for task in args.tasks:
        task_runs = [r for r in runs if r["task"] == task]
        if task_runs:
            parts.append(task_section(task, task_runs, args))
    return "\n\n".join(parts)


def main() -> None:
    args = parse_args()
    os.chdir(REPO_ROOT)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    store = RESULTS_DIR / f"{args.output}.json"
    runs = json.loads(store.read_text()) if args.resume and store.is_file() else []
    done = {(r["task"], r["side"], r["seed"]) for r in runs}
    plan = [(t, s, seed) for t in args.tasks for seed in range(args.seeds) for s in args.sides
            if (t, s, seed) not in done]
    quiet = wait_for_quiet(args.wait_quiet) if plan else "every run was already in the results file (--resume)"
    print(f"[bench] {quiet}", flush=True)
    t0 = time.perf_counter()
    for i, (task, side, seed) in enumerate(plan, 1):
        print(f"[bench] === run {i}/{len(plan)}: {TASKS[task]} {LABELS[side]} seed {seed} "
              f"(elapsed {(time.perf_counter() - t0) / 60:.1f} min) ===", flush=True)
        result = run_one(side, task, seed, args)
        load = result.pop("load")
        result["other_cores"] = sum(v for k, v in load["cores_by_process"].items() if k.startswith("other:"))
        runs.append(result)
        write_json(store, runs)
        print(f"[bench] {LABELS[side]} seed {seed}: final training return {result['final_train_return']}, "
              f"eval {result['eval_return']}, loop {result['loop_s']:.0f} s", flush=True)
    selected = [r for r in runs if r["task"] in args.tasks and r["side"] in args.sides and r["seed"] < args.seeds]
    write_results(args.output, "CMA-PPO vs PPO vs RLlib PPO at equal env steps",
                  report(selected, args, time.perf_counter() - t0, quiet))


if __name__ == "__main__":
    main()
