"""What a resumed run may change, checked before Ray starts.

A run is resumed (``train --resume RUN``, or ``train CONFIG --run-dir RUN --resume-if-exists``
re-launched) with a config: the run's own ``config.yaml`` plus overrides, or CONFIG plus
overrides. It may differ from the run's config only in keys that do not change what is being
trained:

    train.iterations                 extend (or shorten) the run; the algorithm's schedules go
                                     on from where they stand (``flowrl_ray.optim.LRSchedule``)
    eval.*                           when, how often and how the policy is evaluated
    logging.*                        where metrics go
    runtime.<where it runs>          checkpoint_interval, keep_checkpoints, sample_timeout_s,
                                     restart budgets, CPUs / GPUs per actor, num_cpus,
                                     worker_niceness, torch_threads, ray_address, the learner
                                     group's size and placement (every rank holds the whole
                                     state, and the update is the same to float precision)

Everything else (the algorithm and its hyperparameters, the env, network sizes, the seed, the
batch shape: runtime.num_workers, envs_per_worker, rollout_length, mode, max_staleness) belongs
to the run, its checkpoint and its workers' saved environments: a resume that changes one of
them stops with one line naming the keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flowrl_ray.checkpoint import latest_checkpoint
from flowrl_ray.config import Config, ConfigError

#: keys (exact) and sections (ending in ".") a resumed run may change
RESUMABLE = ("train.iterations", "eval.", "logging.",
             "runtime.checkpoint_interval", "runtime.keep_checkpoints", "runtime.sample_timeout_s",
             "runtime.max_worker_restarts", "runtime.max_learner_restarts",
             "runtime.num_cpus_per_worker", "runtime.num_gpus_per_worker",
             "runtime.learner_num_cpus", "runtime.learner_num_gpus",
             "runtime.num_learners", "runtime.learner_placement",
             "runtime.num_cpus", "runtime.worker_niceness", "runtime.torch_threads",
             "runtime.ray_address")


def resumable(key: str) -> bool:
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): data}


def config_changes(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} of every key whose resolved value differs."""
    a, b = _flatten(old.to_dict()), _flatten(new.to_dict())
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def checkpoint_iteration(run_dir: str | os.PathLike) -> int | None:
    """The iteration of the run's latest checkpoint (from its name), None without one."""
    path = latest_checkpoint(run_dir)
    return int(path.stem.split("_")[-1]) if path is not None else None


def check_resume(run_config: Config, cfg: Config, run_dir: str | os.PathLike) -> dict[str, tuple[Any, Any]]:
    """The allowed changes from the run's config to ``cfg``; ConfigError naming the keys that a
    resumed run cannot change, or a train.iterations below what the run has done."""
    changes = config_changes(run_config, cfg)
    # top-level keys first (algorithm, name, seed), then sections
    frozen = {k: changes[k] for k in sorted(changes, key=lambda k: (k.count("."), k)) if not resumable(k)}
    if frozen:
        shown = ", ".join(f"{k} ({a!r} in the run, {b!r} now)" for k, (a, b) in list(frozen.items())[:6])
        more = f" and {len(frozen) - 6} more" if len(frozen) > 6 else ""
        raise ConfigError(f"the config differs from the one {Path(run_dir)} was trained with in keys a resumed run "
                          f"cannot change: {shown}{more} (a resume may change train.iterations, eval.*, "
                          f"logging.* and runtime resources; `--resume {Path(run_dir)}` without CONFIG keeps "
                          f"the run's own config)")
    done = checkpoint_iteration(run_dir)
    if done is not None and cfg.train.iterations < done:
        raise ConfigError(f"config key 'train.iterations': {cfg.train.iterations} is below the {done} "
                          f"iterations {Path(run_dir)} has done")
    return changes
