"""Checkpoints: one file per saved iteration, written atomically, plus loading helpers.

A checkpoint is ``runs/<name>/checkpoints/iter_NNNNNN.pt`` (torch.save of a dict):
    trainer   counters (iteration, env_steps, elapsed time, restarts, dropped batches, ...)
    learner   the algorithm's full state (networks, optimisers, schedulers, RNGs) + version
    policy    the rollout policy's weights alone (what eval and serve load)
    workers   each rollout worker's pickled state (envs, RNGs) for exact resume
``checkpoints/latest`` names the newest one; it is replaced atomically after the file is in place.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from flowrl_ray.utils import atomic_write_bytes, atomic_write_text


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | os.PathLike, iteration: int, payload: dict[str, Any],
                    keep: int = 3) -> Path:
    ckdir = checkpoint_dir(run_dir)
    path = ckdir / f"iter_{iteration:06d}.pt"
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write_bytes(path, buf.getvalue())
    atomic_write_text(ckdir / "latest", path.name + "\n")
    for old in sorted(ckdir.glob("iter_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckdir = checkpoint_dir(run_dir)
    pointer = ckdir / "latest"
    if pointer.is_file():
        path = ckdir / pointer.read_text().strip()
        if path.is_file():
            return path
    found = sorted(ckdir.glob("iter_*.pt"))
    return found[-1] if found else None


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    # weights_only=False: the payload holds pickled env/RNG state written by this package.
    return torch.load(Path(path), map_location="cpu", weights_only=False)


def load_policy(run_dir: str | os.PathLike):
    """(config, env spec, policy in eval mode) from a run directory's latest checkpoint."""
    from flowrl_ray.algorithms import get_algorithm
    from flowrl_ray.config import ConfigError, load_config
    from flowrl_ray.envs import env_family

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    path = latest_checkpoint(run_dir)
    if path is None:
        raise ConfigError(f"{run_dir} has no checkpoint yet")
    cfg = load_config(run_dir / "config.yaml")
    algorithm = get_algorithm(cfg.algorithm)
    if not hasattr(algorithm, "make_policy"):
        raise ConfigError(f"{run_dir} is a {cfg.algorithm} run: its model samples on the learner "
                          f"(a group algorithm) and has no env-step policy to load; "
                          f"`flowrl-ray eval {run_dir}` evaluates it")
    spec = env_family(cfg.env.family).spec(cfg.env)
    policy = algorithm.make_policy(cfg, spec)
    policy.load_state_dict(load_checkpoint(path)["policy"])
    return cfg, spec, policy.eval()
