"""How far a robot policy's episodes get on Can or Square: robosuite's staged rewards.

A sparse success rate says how often a policy finishes the task, not where the others stop.
robosuite's PickPlace and NutAssembly score four stages of the pick-and-place at every state
(``staged_rewards()``): reach (up to 0.1, the gripper's distance to the object), grasp (0.35
while holding it), lift (0.35-0.5, the object's height while held) and hover (0.5-0.7, the held
object's distance to its goal above the bin or the peg). This tool runs each policy (zero
sampling by default, the deployed rule) from the same seeded starts, one env, episode e from seed
``EVAL_SEED + e`` (not the protocol's vector-env episodes), and reports per policy the mean and
the quartiles over episodes of each stage's maximum within the episode, and the share of
episodes that grasped the object and that succeeded. (The lift and hover terms' scales differ
between the tasks, so no threshold on them is read as "lifted" here.)

    .venv/bin/python benchmarks/robot_stages.py --config configs/fpopp/square_state_quickstart.yaml \\
        --policy e20=pretrained/square_state_quickstart.pt --policy e300=runs/square_e300.pt \\
        --episodes 50 --output square_bases_stages

A policy is a pretraining checkpoint or a run directory (its latest checkpoint's policy).
``--sampling behaviour`` runs the training rollouts' rule instead of an evaluation rule (for
ReinFlow's chain: the noisy chain, not its mean), and ``--set NAME:KEY=VALUE`` overrides a key of
the config for one policy (a pretraining checkpoint's policy is built from the config), e.g. the
behaviour policy of one base under ReinFlow's learned noise and Flow-SDE's levels:

    .venv/bin/python benchmarks/robot_stages.py --config configs/reinflow/can_state_quickstart.yaml \
        --sampling behaviour --episodes 40 --policy learned=pretrained/can_state_quickstart.pt \
        --policy sde0.5=pretrained/can_state_quickstart.pt --set sde0.5:algo.noise=sde \
        --set sde0.5:algo.sde_level=0.5 --set sde0.5:algo.ent_coef=0 --output can_behaviour_noise

Results:
``benchmarks/results/<output>.md/.json``. No assertion is made: this is a measurement (Square,
50 episodes, ~3 min a policy on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import md_table, write_json, write_results  # noqa: E402
from _robot import EVAL_SEED, base_policy, run_config  # noqa: E402

STAGES = ("reach", "grasp", "lift", "hover")


def load_policy(cfg, path: str):
    """A pretraining checkpoint's policy (in ``cfg``'s architecture), or a run directory's
    latest one (the run's own config and architecture, as ``flowrl-ray eval`` loads it)."""
    if not Path(path).is_dir():
        return base_policy(cfg, path)
    from flowrl_ray.runtime.policy import load_policy as load_run_policy
    return load_run_policy(path)[2].eval()


def episode_stages(env, policy, seed: int, sampling: str) -> dict:
    """One episode from ``seed`` by ``sampling`` (zero, random: the evaluation rules; behaviour:
    the training rollouts'): each stage's maximum, whether it succeeded, its env steps."""
    import torch
    obs, _ = env.reset(seed=seed)
    best, done, info = np.zeros(len(STAGES)), False, {"success": False}
    gen = torch.Generator().manual_seed(seed)
    while not done:
        with torch.no_grad():
            action, _ = policy.act(torch.as_tensor(obs, dtype=torch.float32)[None], deterministic=sampling == "zero",
                                   generator=gen, record=sampling == "behaviour")
        obs, _, terminated, truncated, info = env.step(action[0].numpy())
        best = np.maximum(best, np.asarray(env.raw.staged_rewards(), float))
        done = terminated or truncated
    return {**dict(zip(STAGES, best.tolist())), "success": bool(info["success"]), "steps": env.steps}


def summarise(episodes: list[dict]) -> dict:
    """Per stage the mean and quartiles over episodes of its maximum; the shares that grasped
    (grasp > 0) and that succeeded."""
    values = {s: np.array([e[s] for e in episodes]) for s in STAGES}
    return {"stage_max_mean": {s: float(v.mean()) for s, v in values.items()},
            "stage_max_quartiles": {s: np.quantile(v, [0.25, 0.5, 0.75]).tolist() for s, v in values.items()},
            "grasped": float(np.mean([e["grasp"] > 0 for e in episodes])),
            "success": float(np.mean([e["success"] for e in episodes])), "episodes": len(episodes)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a Can or Square robot config (env and architecture)")
    ap.add_argument("--policy", action="append", required=True, metavar="NAME=PATH",
                    help="a pretraining checkpoint or a run directory; repeatable")
    ap.add_argument("--episodes", type=int, default=50)
    ap.add_argument("--sampling", choices=("zero", "random", "behaviour"), default="zero")
    ap.add_argument("--set", action="append", default=[], metavar="NAME:KEY=VALUE",
                    help="a config override for one policy; repeatable")
    ap.add_argument("--output", default="robot_stages")
    args = ap.parse_args(argv)

    import torch

    from flowrl_ray.config import ConfigError, load_config
    from flowrl_ray.envs.robot import load_norm, make_env
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    if cfg.env.family != "robot" or cfg.env.id not in ("can", "square"):
        raise SystemExit(f"error: {args.config}: staged rewards exist for robot can and square only")
    policies = {}
    for item in args.policy:
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise SystemExit(f"error: --policy {item!r}: expected NAME=PATH")
        if Path(path).is_dir():
            try:
                run_config(Path(path))
            except (OSError, ConfigError) as e:
                raise SystemExit(f"error: --policy {item!r}: not a run directory ({e})") from None
        elif not Path(path).is_file():
            raise SystemExit(f"error: --policy {item!r}: no such checkpoint")
        policies[name] = path
    overrides = {name: [] for name in policies}
    for item in args.set:
        name, sep, override = item.partition(":")
        if not sep or name not in policies or "=" not in override:
            raise SystemExit(f"error: --set {item!r}: expected NAME:KEY=VALUE with NAME one of --policy's")
        overrides[name].append(override)
    configs = {}
    for name, extra in overrides.items():
        try:
            configs[name] = load_config(args.config, extra)
        except ConfigError as e:
            raise SystemExit(f"error: --set for {name}: {e}") from None
    results = {}
    for name, path in policies.items():
        env = make_env(configs[name].env, load_norm(configs[name].env))
        policy, t0, eps = load_policy(configs[name], path), time.time(), []
        for e in range(args.episodes):
            eps.append(episode_stages(env, policy, EVAL_SEED + e, args.sampling))
            print(f"[stages {name}] {e + 1}/{args.episodes} episodes | {time.time() - t0:.0f}s", flush=True)
        env.close()
        results[name] = {"path": path, "overrides": overrides[name], **summarise(eps), "per_episode": eps,
                         "seconds": round(time.time() - t0, 1)}
    pct = lambda x: f"{100 * x:.0f} %"                                      # noqa: E731
    cell = lambda r, s: (f"{r['stage_max_mean'][s]:.3f} (" + " / ".join(f"{q:.2f}" for q in r["stage_max_quartiles"][s])  # noqa: E731
                         + ")")
    rows = [[name, pct(r["grasped"]), pct(r["success"]), *(cell(r, s) for s in STAGES)] for name, r in results.items()]
    body = (f"{cfg.env.id}, {args.episodes} episodes a policy from seeds {EVAL_SEED}.., {args.sampling} sampling; "
            "each stage's maximum within an episode: the mean over episodes (quartiles); grasped: grasp > 0 at some "
            "step.\n\n"
            + md_table(["policy", "grasped", "success", "reach (max 0.1)", "grasp (0.35)", "lift (0.35-0.5)",
                        "hover (0.5-0.7)"], rows))
    write_json(Path(__file__).resolve().parent / "results" / f"{args.output}.json",
               {"config": args.config, "sampling": args.sampling, "episodes": args.episodes, "results": results})
    write_results(args.output, f"Stages reached: {cfg.env.id}", body)
    print(body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
