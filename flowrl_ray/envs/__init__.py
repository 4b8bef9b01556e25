"""Environment adapters. One adapter per family; a config's ``env.family`` names it.

An env-step family (for ``rollout_kind = "env_step"`` algorithms) provides
``spec(env_cfg) -> EnvSpec``, ``make_vector_env(env_cfg, num_envs) -> gymnasium.vector.VectorEnv``
whose actions are normalised to [-1, 1] and which autoresets in the same step (the episode's last
observation is in ``infos["final_obs"]``), and ``snapshot(vec)/restore(blob)`` for exact resume.
A scoring family (for ``rollout_kind = "group"``) provides ``spec(env_cfg)`` and
``make_scorer(env_cfg, seed, worker_id)``: an object whose ``score(payload) -> Batch`` turns the
learner's samples into rewards (a browser, a force field). A scoring family that can picture its
samples (``eval.snapshots``) also takes ``score(payload, snapshots=N)``, returning pictures of the
samples with ids below N in ``meta.extra["snapshots"]``, and provides
``save_snapshots(items, media_dir, label) -> [(path, caption)]`` that the driver calls to write them.
Any family may provide ``job_env_vars(env_cfg) -> dict``: environment variables a cluster job
running it needs (MuJoCo's headless renderer); the job generator (``jobs/generate.py``) reads it.
Adapters return numpy; policies run torch.
"""

from __future__ import annotations

import importlib
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


#: built-in family name -> module; any other name is imported as a module path (a plugin family)
BUILTIN_FAMILIES = {"gym": "flowrl_ray.envs.gym", "robot": "flowrl_ray.envs.robot", "forms": "flowrl_ray.envs.forms",
                    "molecules": "flowrl_ray.envs.molecules"}


def env_family(name: str) -> ModuleType:
    """The adapter module for ``env.family`` (imported lazily: families have heavy deps)."""
    from flowrl_ray.config import ConfigError
    module_name = BUILTIN_FAMILIES.get(name, name)
    if "." not in module_name:
        raise ConfigError(f"config key 'env.family': unknown env family {name!r} (built in: "
                          f"{', '.join(BUILTIN_FAMILIES)}; plugins as 'package.module')")
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"config key 'env.family': cannot import {module_name!r}: {e}") from None
