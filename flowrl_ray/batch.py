"""The unit that travels from rollout workers to the learner.

A :class:`Batch` is a flat mapping of numpy arrays sharing a leading layout (``[T, N, ...]``
time-major for env-step rollouts, ``[B, ...]`` for group rollouts), plus the ``policy_version``
it was sampled with, the ``worker_id`` that made it and episode statistics. Workers return a
small :class:`BatchMeta` beside it so that the driver can schedule and count without ever
pulling the arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class BatchMeta:
    policy_version: int
    worker_id: int
    env_steps: int       # simulator steps (a chunk's executed rows, each one step); samples for group rollouts
    episode_returns: list[float] = field(default_factory=list)
    episode_lengths: list[int] = field(default_factory=list)
    sample_time_s: float = 0.0
    extra: dict = field(default_factory=dict)   # family-specific episode stats (success, ...)
    chunks: int = 0      # action chunks the policy emitted (envs that execute chunks); 0 elsewhere


@dataclass
class Batch:
    data: dict[str, np.ndarray]
    meta: BatchMeta

    @property
    def policy_version(self) -> int:
        return self.meta.policy_version

    @property
    def worker_id(self) -> int:
        return self.meta.worker_id

    def __getitem__(self, key: str) -> np.ndarray:
        return self.data[key]


def concat_time_major(batches: list[Batch]) -> dict[str, np.ndarray]:
    """Join env-step batches along the env axis.

    Keys starting with ``last_`` hold one entry per env ``[N, ...]`` (the observation after the
    last step) and join on axis 0; every other key is time-major ``[T, N, ...]`` and joins on
    axis 1.
    """
    return {k: np.concatenate([b.data[k] for b in batches], axis=0 if k.startswith("last_") else 1)
            for k in batches[0].data}


# Observations may be arrays or dicts of arrays (an image policy's {"state", "rgb"}). In a
# Batch a dict observation under name "obs" is stored flat as "obs/state", "obs/rgb", so every
# value stays one array that joins and slices like the others.

def flatten_obs(name: str, obs) -> dict:
    """{name: obs} for an array, {f"{name}/{key}": value} for a dict."""
    if isinstance(obs, dict):
        return {f"{name}/{k}": v for k, v in obs.items()}
    return {name: obs}


def gather_obs(data: dict, name: str):
    """The inverse of :func:`flatten_obs`: data[name], or the dict of its "name/..." keys."""
    if name in data:
        return data[name]
    prefix = name + "/"
    parts = {k[len(prefix):]: v for k, v in data.items() if k.startswith(prefix)}
    if not parts:
        raise KeyError(name)
    return parts


def map_obs(fn, obs):
    """``fn`` applied to an array observation or to each value of a dict one."""
    return {k: fn(v) for k, v in obs.items()} if isinstance(obs, dict) else fn(obs)
