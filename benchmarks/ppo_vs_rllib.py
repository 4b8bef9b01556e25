"""PPO on HalfCheetah-v5: flowrl_ray against RLlib (new API stack), same env-step budget.

Run from the repository root (about 8 minutes on 2 idle cores with the defaults: RLlib ~5 min,
flowrl_ray ~2.5 min, plus up to 5 minutes waiting for an idle machine first, see --wait-quiet):

    .venv/bin/python benchmarks/ppo_vs_rllib.py                      # 200k env steps each
    .venv/bin/python benchmarks/ppo_vs_rllib.py --steps 20000        # smoke run (~2.5 minutes)
    .venv/bin/python benchmarks/ppo_vs_rllib.py --only flowrl        # one side only

Both sides run in this one process, one after the other (RLlib first by default, ``--order``),
with Ray shut down between them:

- **flowrl_ray**: ``flowrl_ray.runtime.trainer.Trainer`` on ``configs/ppo/halfcheetah.yaml``
  (2 rollout workers x 1 env x 1024 steps = 2048 steps per iteration, 10 epochs, minibatch 64,
  lr 3e-4 linearly annealed to 0, gamma 0.99, lambda 0.95, clip 0.2, [64, 64] tanh, running
  observation normalisation) with ``train.iterations = ceil(steps / 2048)``, no periodic eval and
  only the final checkpoint. After training, the final policy is evaluated deterministically
  (mean action) in this process, as ``flowrl-ray eval`` does.
- **RLlib**: ``PPOConfig().api_stack(enable_rl_module_and_learner=True,
  enable_env_runner_and_connector_v2=True)`` with the same numbers (see ``RLLIB_DIFFERENCES``
  for what could not be made identical), a ``MeanStdFilter`` env-to-module connector, a local
  learner in this process, ``algo.train()`` until ``num_env_steps_sampled_lifetime >= steps``,
  then ``algo.evaluate()`` on one evaluation EnvRunner with ``explore=False``.

Reported per side: env steps/s over the training loop only (total env steps / loop wall time)
and including startup (Ray start, actors, model building), the final training return (mean
return of roughly the last ``--return-window`` finished training episodes), the deterministic
eval return of the final policy, per-iteration sample/update times, and the CPU load from other
processes. Results go to stdout and to ``benchmarks/results/ppo_vs_rllib.md``. No assertion is
made; learning results from one seed are indicative only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT, git_revision, load_lines, md_table, wait_for_quiet, write_results  # noqa: E402
from _runners import run_flowrl, run_rllib  # noqa: E402

CONFIG = REPO_ROOT / "configs" / "ppo" / "halfcheetah.yaml"
ENV_ID = "HalfCheetah-v5"
STEPS_PER_ITER = 2048      # 2 workers / env runners x 1 env x 1024 steps

#: Every difference between the two setups that this script could not remove.
RLLIB_DIFFERENCES = [
    "Observation normalisation: RLlib's MeanStdFilter updates its running statistics at every "
    "env step on each EnvRunner and merges them across EnvRunners after each iteration; "
    "flowrl_ray's RunningNorm is updated once per iteration by the learner (after the update, "
    "with the whole batch) and shipped with the weights. Both clip normalised obs to +-10.",
    "Advantage normalisation: RLlib normalises advantages over the whole 2048-step train batch "
    "(in its GAE connector); flowrl_ray per minibatch of 64.",
    "Adam epsilon: RLlib's torch learner uses torch's default 1e-8; flowrl_ray 1e-5.",
    "Initialisation: both use orthogonal(sqrt 2) weights and zero biases in the [64, 64] hidden "
    "layers, but RLlib's policy and value output layers keep torch's default init (flowrl_ray: "
    "orthogonal with gain 0.01 for the policy mean, 1.0 for the value). RLlib's free log-std "
    "starts at 0 as in flowrl_ray (log_std_init 0.0); RLlib clips it to +-20.",
    "Value loss: flowrl_ray minimises vf_coef 0.5 x 0.5 (V - R)^2; RLlib vf_loss_coeff x (V - R)^2, "
    "so vf_loss_coeff = 0.25 gives the same term. RLlib's vf_clip_param (which clips the value "
    "*loss*, not the prediction) is set to inf; flowrl_ray's vf_clip is None: both unclipped.",
    "Learning-rate schedule: both anneal 3e-4 linearly to 0 over the budget, flowrl_ray per "
    "iteration (over ceil(steps / 2048) iterations), RLlib per sampled env step "
    "(lr=[[0, 3e-4], [steps, 0]]).",
    "Where the learner runs: flowrl_ray's learner is its own Ray actor (1 torch thread); RLlib's "
    "local learner (num_learners=0) runs in the driver process, here with torch.set_num_threads(1).",
    "Rollout fragments: flowrl_ray workers each step 1024 steps per iteration; RLlib's "
    "rollout_fragment_length='auto' gives the same 1024 per EnvRunner (2048 per iteration).",
    "Training-return window: flowrl_ray averages the last --return-window finished training episodes "
    "(benchmark sets flowrl_ray.runtime.trainer.RETURN_WINDOW, default 100 there); RLlib's "
    "metrics_num_episodes_for_smoothing = --return-window is applied per EnvRunner and merged, so "
    "its window is approximately (not exactly) the same.",
    "Evaluation: flowrl_ray's deterministic eval runs in the driver (EnvRunner.evaluate, mean action, "
    "fresh envs seeded seed + 1000003, normaliser frozen); RLlib's on a separate evaluation EnvRunner "
    "with explore=False (mean action), its MeanStdFilter set to the training statistics by this script "
    "(Ray 2.60's algo.evaluate() does not copy them) and still updating during the eval episodes.",
    "Logical CPUs given to the local Ray: flowrl_ray 3 (learner + 2 workers, its init_ray); RLlib 4 "
    "(driver/learner bundle + 2 EnvRunners + the evaluation EnvRunner). Both run on the same 2 "
    "physical cores; the extra logical CPUs only let the actors be scheduled.",
    "Time limits: none; seeds: flowrl_ray seed 0 (worker i: worker_seed(0, i)), RLlib debugging(seed=0).",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200_000, help="env-step budget per side")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", choices=["rllib-first", "flowrl-first"], default="rllib-first")
    p.add_argument("--only", choices=["both", "flowrl", "rllib"], default="both")
    p.add_argument("--eval-episodes", type=int, default=10, help="deterministic eval episodes of the final policy")
    p.add_argument("--return-window", type=int, default=10,
                   help="training episodes averaged for the final training return")
    p.add_argument("--flowrl-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra flowrl_ray config override, e.g. runtime.mode=async (repeatable)")
    p.add_argument("--run-dir", default=None, help="flowrl_ray run directory (default: a new temp dir)")
    p.add_argument("--wait-quiet", type=float, default=300,
                   help="first wait up to this many seconds for the machine to be idle (0: don't)")
    p.add_argument("--output", default="ppo_vs_rllib", help="results file name (benchmarks/results/<name>.md)")
    return p.parse_args()


def _curve_at(curve: list[tuple[int, float | None]], fractions, budget) -> list[float | None]:
    """Training return at the first iteration that reached each fraction of the budget."""
    out = []
    for f in fractions:
        hit = next((r for s, r in curve if s >= f * budget), None)
        out.append(hit)
    return out


def run_flowrl_side(args: argparse.Namespace) -> dict:
    result = run_flowrl(CONFIG, args.steps, args.seed, args.flowrl_override, args.eval_episodes,
                        args.return_window, args.run_dir)
    return {**result, "name": "flowrl_ray"}


def run_rllib_side(args: argparse.Namespace) -> dict:
    result = run_rllib(CONFIG, args.steps, args.seed, args.eval_episodes, args.return_window)
    return {**result, "name": "RLlib (new API stack)"}


# --------------------------------------------------------------------------- report

def report(results: list[dict], args: argparse.Namespace, elapsed: float, quiet: str) -> str:
    fmt = lambda x, nd=1: "–" if x is None else f"{x:,.{nd}f}"
    headers = ["", *[r["name"] for r in results]]
    rows = [
        ["env steps", *[f"{r['steps']:,}" for r in results]],
        ["iterations", *[r["iterations"] for r in results]],
        ["env steps/s, training loop", *[fmt(r["steps"] / r["loop_s"], 0) for r in results]],
        ["env steps/s, incl. startup", *[fmt(r["steps"] / (r["startup_s"] + r["loop_s"]), 0) for r in results]],
        ["startup (s)", *[fmt(r["startup_s"]) for r in results]],
        ["training loop (s)", *[fmt(r["loop_s"]) for r in results]],
        ["mean iteration (s)", *[fmt(r["iter_s"], 2) for r in results]],
        ["  of which sampling (s)", *[fmt(r["sample_s"], 2) for r in results]],
        ["  of which learner update (s)", *[fmt(r["update_s"], 2) for r in results]],
        [f"final training return (last ~{args.return_window} episodes)",
         *[fmt(r["final_train_return"]) for r in results]],
        ["deterministic eval return of the final policy",
         *[(fmt(r["eval_return"]) + (f" ± {r['eval_std']:.1f}" if r.get("eval_std") is not None else "")
            + f" ({r['eval_episodes']} ep.)") if r["eval_return"] is not None else "–" for r in results]],
        ["eval time (s, not in the loop)", *[fmt(r["eval_s"]) for r in results]],
        ["other processes' CPU load during the run (cores)",
         *[fmt(sum(v for k, v in r["load"]["cores_by_process"].items() if k.startswith("other:")), 2)
           for r in results]],
    ]
    fractions = [0.25, 0.5, 0.75, 1.0]
    curve_rows = []
    for f, *vals in zip(fractions, *[_curve_at(r["curve"], fractions, args.steps) for r in results]):
        curve_rows.append([f"{int(f * args.steps):,}", *[fmt(v) for v in vals]])
    parts = [
        f"## Setup\n\n- flowrl_ray revision: {git_revision()}\n- env: {ENV_ID}; budget {args.steps:,} env steps per "
        f"side (flowrl_ray rounds up to whole 2048-step iterations); seed {args.seed}; order: {args.order}\n"
        f"- flowrl_ray: configs/ppo/halfcheetah.yaml with train.iterations=ceil(steps/2048), eval.interval=0, "
        f"runtime.checkpoint_interval=0 (one checkpoint at the end)"
        f"{''.join(', ' + o for o in args.flowrl_override)}\n"
        f"- RLlib: PPOConfig new API stack, 2 EnvRunners x 1 env, train_batch_size_per_learner 2048, 10 epochs, "
        f"minibatch 64, lr 3e-4 -> 0 linear, gamma 0.99, lambda 0.95, clip 0.2, [64, 64] tanh (separate value "
        f"net, free log-std), MeanStdFilter, grad clip 0.5 (global norm), no KL loss, no entropy bonus\n"
        f"- training loop = from the moment every actor is up to the end of the last iteration (flowrl_ray: "
        f"Trainer.train(), which also writes the final checkpoint, summary and plot); startup = Ray start + "
        f"actors/algorithm construction\n- before starting: {quiet}\n- total benchmark time: {elapsed / 60:.1f} min",
        "## Results\n\n" + md_table(headers, rows),
        "## Training return (window mean) at fractions of the budget\n\n"
        + md_table(["env steps", *[r["name"] for r in results]], curve_rows),
    ]
    for r in results:
        if "keys_seen" in r:
            keys = "; ".join(f"`{k}`: {v}" for k, v in r["keys_seen"].items())
            parts.append(f"## RLlib result keys checked in this run (Ray 2.60 new stack)\n\n{keys}")
        if "iteration_time_sum_s" in r and r["name"] == "flowrl_ray":
            parts.append(f"## flowrl_ray notes\n\n- sum of per-iteration times (Trainer counters): "
                         f"{r['iteration_time_sum_s']:.1f} s of the {r['loop_s']:.1f} s loop (the rest: metrics "
                         f"logging, the final checkpoint, summary and learning-curve plot)\n- run directory: "
                         f"{r['run_dir']}")
    parts.append("## Differences that remain between the two setups\n\n"
                 + "\n".join(f"- {d}" for d in RLLIB_DIFFERENCES))
    for r in results:
        parts.append(f"## CPU load during the {r['name']} run\n\n" + "\n".join(load_lines(r["load"])))
    return "\n\n".join(parts)


def main() -> None:
    args = parse_args()
    os.chdir(REPO_ROOT)
    sides = {"flowrl": run_flowrl_side, "rllib": run_rllib_side}
    order = ["rllib", "flowrl"] if args.order == "rllib-first" else ["flowrl", "rllib"]
    if args.only != "both":
        order = [args.only]
    quiet = wait_for_quiet(args.wait_quiet)
    print(f"[bench] {quiet}", flush=True)
    t0 = time.perf_counter()
    results = {}
    for side in order:
        print(f"[bench] === {side} ===", flush=True)
        s0 = time.perf_counter()
        results[side] = sides[side](args)
        print(f"[bench] {side} done in {time.perf_counter() - s0:.0f} s", flush=True)
    ordered = [results[k] for k in ("flowrl", "rllib") if k in results]
    title = {"both": "flowrl_ray vs RLlib (new API stack)", "flowrl": "flowrl_ray only",
             "rllib": "RLlib (new API stack) only"}[args.only]
    write_results(args.output, f"PPO on {ENV_ID}: {title}",
                  report(ordered, args, time.perf_counter() - t0, quiet))


if __name__ == "__main__":
    main()
