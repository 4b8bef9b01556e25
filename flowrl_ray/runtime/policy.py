"""A trained env-step policy from a run directory: the config, the env family's spec and the
algorithm's rollout policy with the newest checkpoint's weights (what ``eval``, ``serve`` and the
protocol benchmarks load). It joins the config, the algorithm registry and the env family, so it
sits above the algorithms; the file I/O is :mod:`flowrl_ray.checkpoint`'s."""

from __future__ import annotations

import os
from pathlib import Path

from flowrl_ray.algorithms import get_algorithm
from flowrl_ray.checkpoint import load_latest
from flowrl_ray.config import ConfigError, load_config
from flowrl_ray.envs import env_family


def load_policy(run_dir: str | os.PathLike):
    """(config, env spec, policy in eval mode) from a run directory's latest checkpoint."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml")
    algorithm = get_algorithm(cfg.algorithm)
    if not hasattr(algorithm, "make_policy"):
        raise ConfigError(f"{run_dir} is a {cfg.algorithm} run: its model samples on the learner "
                          f"(a group algorithm) and has no env-step policy to load; "
                          f"`flowrl-ray eval {run_dir}` evaluates it")
    found = load_latest(run_dir)
    if found is None:
        raise ConfigError(f"{run_dir} has no checkpoint yet")
    spec = env_family(cfg.env.family).spec(cfg.env)
    policy = algorithm.make_policy(cfg, spec)
    policy.load_state_dict(found[1]["policy"])
    return cfg, spec, policy.eval()
