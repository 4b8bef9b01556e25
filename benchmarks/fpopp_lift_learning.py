"""FPO++ on robosuite Lift (low-dim state) on this machine: success of the pretrained flow policy
before and after fine-tuning, with env steps and wall-clock; zero- vs random-sampling at
evaluation; per-sample vs averaged ratio at the same budget.

Run from the repository root (each fine-tuning run is `train.iterations` of the config, about
30 minutes on 2 idle cores with the quickstart config):

    .venv/bin/python benchmarks/fpopp_lift_learning.py                      # per_sample and averaged
    .venv/bin/python benchmarks/fpopp_lift_learning.py --ratio-modes per_sample
    .venv/bin/python benchmarks/fpopp_lift_learning.py --runs runs/fpopp-lift-quickstart-1
                                                       # evaluate finished `flowrl-ray train` runs
    .venv/bin/python benchmarks/fpopp_lift_learning.py train.iterations=35 algo.n_mc=32
                                                       # config overrides, as for `flowrl-ray train`

Steps: 50 scripted demos (`demos/lift.hdf5`, made if missing), the base policy
(`flowrl-ray pretrain ... --epochs 10`, made if missing), then per ratio mode one
`flowrl-ray train` run of the quickstart config. Every policy (the base and each run's final
checkpoint) is then evaluated in this process on the same seeded episodes with zero-sampling
(eps = 0, FPO++'s test-time rule) and random sampling (eps ~ N(0, I), what training rollouts use).
With ``--runs``, the base is each run's own ``algo.base_policy``.
Results: ``benchmarks/results/fpopp_lift_learning.{md,json}`` and the runs' success curves. No
assertion is made. Runs are measured in action chunks (one policy step each, `act_steps` (8 in the
quickstart) env steps, i.e. 20 Hz robosuite steps, fewer at the end of an episode) and env steps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, RESULTS_DIR, git_revision, md_table, write_json, write_results  # noqa: E402
from _robot import FLOWRL, base_key, base_policy, ensure_demos_and_base, evaluate, run_config, run_summary  # noqa: E402

CONFIG = "configs/fpopp/lift_state_quickstart.yaml"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--ratio-modes", nargs="+", default=["per_sample", "averaged"])
    p.add_argument("--runs", nargs="*", help="evaluate these finished run directories instead of training")
    p.add_argument("--eval-episodes", type=int, default=50)
    p.add_argument("--demos", type=int, default=50)
    p.add_argument("--pretrain-epochs", type=int, default=10)
    p.add_argument("--output", default="fpopp_lift_learning",
                   help="results name: benchmarks/results/<name>.md and .json")
    p.add_argument("overrides", nargs="*", help="config overrides (key.sub=value) for every run")
    args = p.parse_args()
    os.chdir(REPO_ROOT)
    from flowrl_ray.runtime.policy import load_policy
    from flowrl_ray.config import load_config

    cfg = load_config(args.config, args.overrides)
    run_dirs = [Path(d) for d in args.runs] if args.runs else []
    if not args.runs:
        ensure_demos_and_base(args.config, cfg, "lift", args.demos, args.pretrain_epochs, args.overrides)
        for mode in args.ratio_modes:
            run_dir = Path("runs") / f"bench-fpopp-lift-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
            subprocess.run([*FLOWRL, "train", args.config, "--run-dir", str(run_dir), "eval.compare_episodes=0",
                            *args.overrides, f"algo.ratio_mode={mode}"], check=True)   # evaluated below
            run_dirs.append(run_dir)

    t0 = time.perf_counter()
    results = {"config": args.config, "overrides": args.overrides, "revision": git_revision(),
               "eval_episodes": args.eval_episodes, "bases": {}, "runs": []}
    for run_cfg in [run_config(d) for d in run_dirs] or [cfg]:
        key = base_key(run_cfg)        # a base executed with another chunk length is another policy
        if key not in results["bases"]:
            print(f"[bench] evaluating the base policy {key} ({args.eval_episodes} episodes x zero/random)",
                  flush=True)
            results["bases"][key] = evaluate(base_policy(run_cfg), run_cfg, args.eval_episodes)
    for run_dir in run_dirs:
        print(f"[bench] evaluating {run_dir}", flush=True)
        run_cfg, _, policy = load_policy(run_dir)
        results["runs"].append({"run_dir": str(run_dir), **run_summary(run_dir),
                                "ratio_mode": run_cfg.algo.ratio_mode, "n_mc": run_cfg.algo.n_mc,
                                "actor_lr": run_cfg.algo.lr, "base_policy": base_key(run_cfg),
                                "act_steps": run_cfg.env.act_steps,
                                "final": evaluate(policy, run_cfg, args.eval_episodes)})
    results["eval_time_s"] = round(time.perf_counter() - t0, 1)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    write_json(RESULTS_DIR / f"{args.output}.json", results)

    pct = lambda v: "-" if v is None else f"{100 * v:.0f} %"     # noqa: E731
    rows = [[f"pretrained base `{path}`", "-", "-", pct(b["zero"]), pct(b["random"]), "-"]
            for path, b in results["bases"].items()]
    for r in results["runs"]:
        rows.append([f"FPO++ {r['ratio_mode']}, N_mc {r['n_mc']}, actor lr {r['actor_lr']:g} ({r['run_dir']}, "
                     f"base `{r['base_policy']}`)", f"{r['chunks']:,} ("
                     + (f"{r['env_steps']:,} env steps)" if r.get("env_steps") is not None
                        else f"up to {r['act_steps'] * r['chunks']:,} env steps)"),
                     f"{r['time_s'] / 60:.1f} min", pct(r["final"]["zero"]), pct(r["final"]["random"]),
                     f"{pct(r['train_success_first'])} -> {pct(r['train_success_last'])}"])
    curves = "\n".join(f"- {r['run_dir']}: " + ", ".join(f"{s:,}: {pct(v)}" for s, v in r["eval_curve"])
                       for r in results["runs"])
    body = (f"Config `{args.config}`{' with ' + ' '.join(args.overrides) if args.overrides else ''}; every policy evaluated on the same {args.eval_episodes} seeded episodes per "
            f"sampling rule, in one process. Training success = last 100 training episodes (random sampling).\n\n"
            + md_table(["policy", "chunks (env steps)", "fine-tuning wall-clock", "success, zero-sampling",
                        "success, random sampling", "training success first -> last"], rows)
            + "\n\nPeriodic eval during training (zero-sampling, 20 episodes; chunks: success):\n\n" + curves + "\n")
    write_results(args.output, "FPO++ fine-tuning on Lift (state) on this machine", body)


if __name__ == "__main__":
    main()
