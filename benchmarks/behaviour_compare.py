"""Behaviour unchanged by a refactor: short runs of all seven algorithms with two checkouts of
the code, compared metric by metric.

    behaviour_compare.py run --tree DIR --out OUT     each algorithm's short run with DIR's code
    behaviour_compare.py compare OUT_A OUT_B          every non-timing metric of every row equal?

A run is `flowrl-ray train` in a subprocess whose working directory and PYTHONPATH are the tree
(so its code runs), on a small synchronous configuration of each family's config: one rollout
worker, 2-3 iterations, the evaluation at start and at the end, no checkpoints between. The
files a config loads (bases, demos) are taken from this checkout by absolute path, so an older
tree (a `git worktree`) needs none of its own. `compare` ignores wall-clock figures (keys ending in
`_s`, `time_s`, `*_per_s`, throughput, the learner's device string) and reports, per algorithm,
the rows and metrics compared and each difference; it writes
`benchmarks/results/behaviour_compare.md` with the two trees' commits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import write_json  # noqa: E402

#: the files configs load, taken from this checkout (an older tree's ignored files may be absent)
ROBOT = ["algo.base_policy=pretrained/lift_state_quickstart.pt", "env.dataset=demos/lift.hdf5"]
#: algorithm -> (config, overrides, the overrides naming files): small, synchronous, one worker
RUNS = {
    "ppo": ("configs/ppo/pendulum.yaml",
            ["train.iterations=3", "runtime.envs_per_worker=2", "runtime.rollout_length=64", "algo.minibatch_size=64"],
            []),
    "cma_ppo": ("configs/cma_ppo/pendulum.yaml",
                ["train.iterations=3", "runtime.envs_per_worker=2", "runtime.rollout_length=64",
                 "algo.minibatch_size=64"], []),
    "fpopp": ("configs/fpopp/lift_state_quickstart.yaml",
              ["train.iterations=3", "runtime.envs_per_worker=2", "runtime.rollout_length=8",
               "algo.minibatch_size=16", "algo.critic_warmup_iters=1"], ROBOT),
    "reinflow": ("configs/reinflow/lift_state_quickstart.yaml",
                 ["train.iterations=3", "runtime.envs_per_worker=2", "runtime.rollout_length=8",
                  "algo.minibatch_size=16", "algo.critic_warmup_iters=1"], ROBOT),
    "flowsar": ("configs/flowsar/lift_state_quickstart.yaml",
                ["train.iterations=2", "runtime.envs_per_worker=2", "runtime.rollout_length=16",
                 "algo.minibatch_size=32"], ROBOT),
    "flow_grpo": ("configs/flow_grpo/forms_small.yaml",
                  ["train.iterations=2", "algo.group_size=2", "algo.eval_sampled=false"],
                  ["algo.sft_checkpoint=pretrained/forms_small_sft"]),
    "fed_grpo": ("configs/fed_grpo/qm9_small.yaml",
                 ["train.iterations=2", "algo.sample_group_size=1"], ["algo.base_model=pretrained/qm9_small_edm.pt"]),
}
COMMON = ["runtime.num_workers=1", "runtime.mode=sync", "runtime.checkpoint_interval=0", "eval.at_start=true",
          "eval.episodes=2", "runtime.worker_niceness=0"]
TIMING = re.compile(r"(_s$|^time_s$|_per_s$|throughput|/device$|_seconds$)")


def _overrides(algorithm: str) -> list[str]:
    _, extra, files = RUNS[algorithm]
    iterations = next(o.split("=")[1] for o in extra if o.startswith("train.iterations="))
    paths = [f"{o.split('=')[0]}={ROOT / o.split('=')[1]}" for o in files]     # absolute: this checkout's
    return [*COMMON, *extra, *paths, f"eval.interval={iterations}"]


def run(tree: Path, out: Path, algorithms: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    write_json(out / "tree.json", {"tree": str(tree), "commit": commit})
    for algorithm in algorithms:
        config = RUNS[algorithm][0]
        run_dir = out / algorithm
        cmd = [sys.executable, "-m", "flowrl_ray.cli", "train", str(tree / config), *_overrides(algorithm),
               "--run-dir", str(run_dir), "--no-tensorboard", "--address", "local"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        print(f"[behaviour] {algorithm}: {status} in {time.perf_counter() - start:.0f} s ({commit})", flush=True)
        if proc.returncode != 0:
            (out / f"{algorithm}.stderr").write_text(proc.stderr)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare(a: Path, b: Path, algorithms: list[str]) -> str:
    trees = [json.loads((d / "tree.json").read_text()) for d in (a, b)]
    lines = ["# Behaviour before and after a refactor: short runs of the seven algorithms", "",
             "```bash", f".venv/bin/python benchmarks/behaviour_compare.py run --tree <checkout at {trees[0]['commit']}> "
             f"--out {a}", f".venv/bin/python benchmarks/behaviour_compare.py run --tree . --out {b}",
             f".venv/bin/python benchmarks/behaviour_compare.py compare {a} {b}", "```", "",
             f"A: {trees[0]['commit']}, B: {trees[1]['commit']}; {time.strftime('%Y-%m-%d')}. Every metric of every "
             "row of metrics.jsonl compared for equality, wall-clock figures left out.", "",
             "| algorithm | rows | metrics compared | differing | verdict |", "|---|---|---|---|---|"]
    notes = []
    for algorithm in algorithms:
        ra, rb = _rows(a / algorithm), _rows(b / algorithm)
        if not ra or not rb:
            lines.append(f"| {algorithm} | {len(ra)} / {len(rb)} | - | - | a run is missing |")
            continue
        compared, differing = 0, []
        for i, (x, y) in enumerate(zip(ra, rb)):
            for key in sorted(set(x) | set(y)):
                if TIMING.search(key):
                    continue
                compared += 1
                if key not in x or key not in y or not _same(x[key], y[key]):
                    differing.append(f"row {i} {key}: {x.get(key, '(absent)')} vs {y.get(key, '(absent)')}")
        verdict = "identical" if not differing and len(ra) == len(rb) else "DIFFERENT"
        lines.append(f"| {algorithm} | {len(ra)} / {len(rb)} | {compared} | {len(differing)} | {verdict} |")
        notes += [f"- {algorithm}: {d}" for d in differing[:10]]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run")
    r.add_argument("--tree", type=Path, default=ROOT)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--only", nargs="+", choices=list(RUNS), default=list(RUNS))
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--only", nargs="+", choices=list(RUNS), default=list(RUNS))
    c.add_argument("--output", default="behaviour_compare")
    args = p.parse_args()
    if args.verb == "run":
        run(args.tree.resolve(), args.out.resolve(), args.only)
    else:
        report = compare(args.a, args.b, args.only)
        (ROOT / "benchmarks" / "results" / f"{args.output}.md").write_text(report)
        print(report)


if __name__ == "__main__":
    main()
