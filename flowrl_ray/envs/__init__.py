"""Environment adapters. One adapter per family; a config's ``env.family`` names it.

An adapter family provides ``spec(env_cfg) -> EnvSpec`` and
``make_vector_env(env_cfg, num_envs) -> gymnasium.vector.VectorEnv`` whose actions are
normalised to [-1, 1] and which autoresets in the same step (the episode's last observation is
in ``infos["final_obs"]``). Adapters return numpy; policies run torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class EnvSpec:
    obs_shape: tuple[int, ...]
    action_dim: int
    max_episode_steps: int | None = None

    @property
    def obs_dim(self) -> int:
        n = 1
        for d in self.obs_shape:
            n *= d
        return n


def env_family(name: str) -> ModuleType:
    """The adapter module for ``env.family`` (imported lazily: families have heavy deps)."""
    if name == "gym":
        from flowrl_ray.envs import gym as module
        return module
    from flowrl_ray.config import ConfigError
    raise ConfigError(f"config key 'env.family': unknown env family {name!r} (known: gym)")
