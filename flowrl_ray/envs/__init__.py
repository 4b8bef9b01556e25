"""Environment adapters. One adapter per family; a config's ``env.family`` names it.

An env-step family (for ``rollout_kind = "env_step"`` algorithms) provides
``spec(env_cfg) -> EnvSpec``, ``make_vector_env(env_cfg, num_envs) -> gymnasium.vector.VectorEnv``
whose actions are normalised to [-1, 1] and which autoresets in the same step (the episode's last
observation is in ``infos["final_obs"]``), and ``snapshot(vec)/restore(blob)`` for exact resume
(plus ``read_snapshot(blob)``: the snapshot's data, read through :func:`load_snapshot`, which runs
no code from it).
A scoring family (for ``rollout_kind = "group"``) provides ``spec(env_cfg)`` and
``make_scorer(env_cfg, seed, worker_id)``: an object whose ``score(payload) -> Batch`` turns the
learner's samples into rewards (a browser, a force field). A scoring family that can picture its
samples (``eval.snapshots``) also takes ``score(payload, snapshots=N)``, returning pictures of the
samples with ids below N in ``meta.extra["snapshots"]``, and provides
``save_snapshots(items, media_dir, label) -> [(path, caption)]`` that the driver calls to write them.
A family whose settings are its own declares its ``env`` section as ``config_class``: a
dataclass extending :class:`flowrl_ray.config.EnvConfig` (the robot family's
:class:`~flowrl_ray.envs.robot.config.RobotEnvConfig`), which the config loader builds and checks
key by key; the others take the base section, with family settings in ``env.kwargs`` checked by the
family (``build_section``).
Any family may provide ``job_env_vars(env_cfg) -> dict``: environment variables a cluster job
running it needs (MuJoCo's headless renderer); the job generator (``jobs/generate.py``) reads it.
Adapters return numpy; policies run torch. The two contracts are typing Protocols,
``flowrl_ray.registry.EnvStepFamily`` and ``ScoringFamily``: a module named as ``env.family`` must
satisfy one, and the one the algorithm's kind needs (checked when a config is built).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from flowrl_ray.registry import BUILTIN_FAMILIES, env_family  # noqa: F401 - the one lookup, re-exported
from flowrl_ray.utils import restricted_loads


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


#: classes that snapshots name by a module they have left: (module, name) -> "module:Name" today
#: (the robot family's perturbations lived in flowrl_ray.config before it declared its section)
SNAPSHOT_CLASSES_MOVED = {("flowrl_ray.config", "PerturbConfig"): "flowrl_ray.envs.robot.config:PerturbConfig"}


def snapshot_classes(*classes: type):
    """``allowed`` of :func:`load_snapshot`: exactly these classes, by the name pickle gives them."""
    by_name = {(c.__module__, c.__qualname__): c for c in classes}
    return lambda module, name: by_name.get((module, name))


def load_snapshot(blob: bytes, env_config_class: type, allowed=None):
    """Read a family's snapshot (:func:`snapshot` of each family) running no code from it: plain
    data, numpy, the family's env config class, and the classes ``allowed(module, name)`` admits
    (:func:`snapshot_classes`; none by default);
    anything else is refused naming it (:func:`flowrl_ray.utils.restricted_loads`). Snapshots
    written before the families declared their env sections load too: their env config is a
    ``flowrl_ray.config.EnvConfig`` holding every family's keys, read as ``env_config_class``
    (the family's section), and moved classes are found where they are now."""
    allowed = allowed or snapshot_classes()
    config_class = snapshot_classes(env_config_class)

    def find(module: str, name: str):
        if (module, name) == ("flowrl_ray.config", "EnvConfig"):
            return env_config_class
        if (module, name) in SNAPSHOT_CLASSES_MOVED:         # our config dataclasses, by where they are now
            module, name = SNAPSHOT_CLASSES_MOVED[module, name].split(":")
            return getattr(importlib.import_module(module), name)
        return config_class(module, name) or allowed(module, name)

    return restricted_loads(blob, "the env snapshot", find)
