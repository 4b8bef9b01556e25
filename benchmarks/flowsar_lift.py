"""FlowSAR's credit-assignment ablation on robosuite (low-dim state) on this machine: FlowSAR
(full: softmax of the reconstruction error) vs its uniform / random / inverse weights vs FPO++
(critic-based), from the same pretrained policy at the same env-step budget.

Run from the repository root:

    .venv/bin/python benchmarks/flowsar_lift.py                              # Lift, seed 0, 5 variants
    .venv/bin/python benchmarks/flowsar_lift.py --iterations 12 --seeds 0 1 2
    .venv/bin/python benchmarks/flowsar_lift.py --task can                   # Can: demos and base made first
    .venv/bin/python benchmarks/flowsar_lift.py --runs runs/bench-flowsar-*  # re-evaluate finished runs

Every run is one `flowrl-ray train` of the quickstart configs (2 workers x 8 envs x 40 chunk
steps per iteration, same for FlowSAR and FPO++) for ``--iterations`` iterations. Each final
policy and the base policy are then evaluated in this process on the same seeded episodes with
zero-sampling and random sampling (``_robot.evaluate``). Results:
``benchmarks/results/flowsar_<task>.{md,json}`` and ``flowsar_<task>_success.png`` (training
success, random sampling, vs env steps). The spec predicts full > uniform > random ~ inverse;
the table reports what was measured. No assertion is made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, RESULTS_DIR, git_revision, md_table, write_results  # noqa: E402
from _robot import FLOWRL, base_policy, ensure_demos_and_base, evaluate, run_summary  # noqa: E402

os.environ.setdefault("MUJOCO_GL", "egl")
FLOWSAR = "configs/flowsar/lift_state_quickstart.yaml"
FPOPP = "configs/fpopp/lift_state_quickstart.yaml"
#: variant -> (config, overrides)
VARIANTS = {"flowsar": (FLOWSAR, []),
            "flowsar-uniform": (FLOWSAR, ["algo.flowsar.weight_mode=uniform"]),
            "flowsar-random": (FLOWSAR, ["algo.flowsar.weight_mode=random"]),
            "flowsar-inverse": (FLOWSAR, ["algo.flowsar.weight_mode=inverse"]),
            # FlowSAR's batch shape (the same chunks per iteration), FPO++'s own update settings
            "fpopp": (FPOPP, ["runtime.rollout_length=40"])}


def task_overrides(task: str) -> list[str]:
    """The quickstart configs are Lift's; another task swaps the env, its demos and base policy."""
    if task == "lift":
        return []
    return [f"env.id={task}", f"env.dataset=demos/{task}.hdf5",
            f"algo.base_policy=pretrained/{task}_state_quickstart.pt"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="lift", choices=["lift", "can", "square"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--iterations", type=int, default=12, help="per run (640 chunk steps each)")
    p.add_argument("--runs", nargs="*", help="evaluate these finished run directories instead of training")
    p.add_argument("--eval-episodes", type=int, default=30)
    p.add_argument("--demos", type=int, default=50)
    p.add_argument("--pretrain-epochs", type=int, default=10)
    args = p.parse_args()
    os.chdir(REPO_ROOT)
    from flowrl_ray.checkpoint import load_policy
    from flowrl_ray.config import load_config
    from flowrl_ray.plotting import plot_runs

    extra = task_overrides(args.task)
    cfg = load_config(FLOWSAR, extra)
    ensure_demos_and_base(FLOWSAR, cfg, args.task, args.demos, args.pretrain_epochs, extra)
    run_dirs = [Path(d) for d in args.runs] if args.runs else []
    if not args.runs:
        for seed in args.seeds:
            for variant in args.variants:
                config, overrides = VARIANTS[variant]
                run_dir = Path("runs") / f"bench-{variant}-{args.task}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
                subprocess.run([*FLOWRL, "train", config, "--run-dir", str(run_dir), *extra, *overrides,
                                f"name={variant}", f"seed={seed}", f"train.iterations={args.iterations}",
                                f"eval.interval={args.iterations}", "eval.at_start=false"], check=True)
                run_dirs.append(run_dir)

    print(f"[bench] evaluating the base policy ({args.eval_episodes} episodes x zero/random)", flush=True)
    t0 = time.perf_counter()
    results = {"task": args.task, "revision": git_revision(), "eval_episodes": args.eval_episodes,
               "base": evaluate(base_policy(cfg), cfg, args.eval_episodes), "runs": []}
    for run_dir in run_dirs:
        print(f"[bench] evaluating {run_dir}", flush=True)
        run_cfg, _, policy = load_policy(run_dir)
        flowsar = run_cfg.algorithm == "flowsar"
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        spread = [r["flowsar/e_within_episode_cv"] for r in rows if r.get("flowsar/e_within_episode_cv") is not None]
        entropy = [r["flowsar/weight_entropy_ratio"] for r in rows if r.get("flowsar/weight_entropy_ratio") is not None]
        results["runs"].append({"run_dir": str(run_dir), **run_summary(run_dir), "seed": run_cfg.seed,
                                "weight_mode": run_cfg.algo.flowsar.weight_mode if flowsar else None,
                                "e_within_episode_cv_mean": sum(spread) / len(spread) if spread else None,
                                "weight_entropy_ratio_mean": sum(entropy) / len(entropy) if entropy else None,
                                "final": evaluate(policy, run_cfg, args.eval_episodes)})
    results["eval_time_s"] = round(time.perf_counter() - t0, 1)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = f"flowsar_{args.task}"
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    try:
        plot_runs(run_dirs, RESULTS_DIR / f"{stem}_success.png", y="success_rate",
                  title=f"{args.task}: training success (random sampling) vs env steps")
    except ValueError as e:
        print(f"[bench] no curve plotted: {e}", flush=True)

    pct = lambda v: "-" if v is None else f"{100 * v:.0f} %"     # noqa: E731
    num = lambda v: "-" if v is None else f"{v:.2f}"             # noqa: E731
    base = results["base"]
    table = [["pretrained (base)", "-", "-", "-", pct(base["zero"]), pct(base["random"]), "-", "-", "-"]]
    for r in results["runs"]:
        table.append([r["name"], str(r["seed"]), f"{r['env_steps']:,}", f"{r['time_s'] / 60:.1f} min",
                      pct(r["final"]["zero"]), pct(r["final"]["random"]),
                      f"{pct(r['train_success_first'])} -> {pct(r['train_success_last'])}",
                      num(r["e_within_episode_cv_mean"]), num(r["weight_entropy_ratio_mean"])])
    body = (f"Task `{args.task}` (low-dim state); configs `{FLOWSAR}` and `{FPOPP}` with "
            f"{args.iterations} iterations each; every policy evaluated on the same {args.eval_episodes} "
            f"seeded episodes per sampling rule, in one process. Training success = last 100 training "
            f"episodes (random sampling). e spread = mean over iterations of the within-episode "
            f"coefficient of variation of the reconstruction error; weight entropy = H(w) / log H "
            f"(1 = uniform weights).\n\n"
            + md_table(["variant", "seed", "env steps (chunks)", "wall-clock", "success, zero-sampling",
                        "success, random sampling", "training success first -> last", "e spread (CV)",
                        "weight entropy / uniform"], table) + "\n")
    write_results(stem, f"FlowSAR credit-assignment ablation vs FPO++ on {args.task} (state)", body)


if __name__ == "__main__":
    main()
