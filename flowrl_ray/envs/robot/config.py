"""The robot family's ``env`` section: the keys every family reads (:class:`EnvConfig`) and the
robot's own. The config loader builds it for ``env.family: robot`` (the family's
``config_class``), checking each key as it checks any section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from flowrl_ray.config import Config, ConfigError, EnvConfig, check


@dataclass
class PerturbConfig:
    """Out-of-distribution changes of a robot scene (flowrl_ray.envs.robot.perturb); the defaults
    change nothing. Named sets of them are the evaluation suite (``flowrl-ray eval --perturb``)."""
    placement_scale: float = field(default=1.0, metadata=check(gt=0))       # object x/y placement range
    object_scale: float = field(default=1.0, metadata=check(gt=0))          # object geometry (mass kept)
    table_friction_scale: float = field(default=1.0, metadata=check(gt=0))  # sliding friction of the surface
    action_noise_std: float = field(default=0.0, metadata=check(ge=0))      # on each executed row, in [-1, 1]
    camera_shift: list = field(default_factory=lambda: [0.0, 0.0, 0.0])     # metres, the observation cameras
    light_scale: float = field(default=1.0, metadata=check(ge=0))           # scene light intensity


@dataclass
class RobotEnvConfig(EnvConfig):
    family: str = "robot"
    id: str = "lift"
    obs_mode: Literal["low_dim", "image"] = "low_dim"
    cameras: list = field(default_factory=lambda: ["agentview"])   # image mode
    image_size: int = field(default=84, metadata=check(gt=0))      # image mode: H = W pixels
    dataset: Optional[str] = None       # robomimic hdf5 whose min/max normalise obs and actions
    terminate_on_success: bool = True   # False: run to max_episode_steps, reward 1 per solved step
    # "shaped": the sparse reward plus potential-based shaping, gamma * phi(s') - phi(s) per chunk,
    # phi = robosuite's staged task progress (flowrl_ray.envs.robot.env); leaves the optimal policy
    # of the sparse task unchanged when shaping_gamma is the algorithm's discount (None: algo.gamma).
    reward: Literal["sparse", "shaped"] = "sparse"
    shaping_gamma: Optional[float] = field(default=None, metadata=check(gt=0, le=1))
    perturb: PerturbConfig = field(default_factory=PerturbConfig)   # OOD scene changes
    # training envs: groups of this many consecutive envs of a worker start every episode from the
    # same seeded state (GRPO-style groups, algo.label_baseline: group); 1: independent episodes.
    # Evaluation envs are never grouped.
    start_group: int = field(default=1, metadata=check(gt=0))

    def resolve(self, cfg: Config) -> None:
        """A shaped reward discounts its potential with the algorithm's own gamma (what keeps the
        sparse task's optimal policy): shaping_gamma None takes algo.gamma; an algorithm without
        a gamma needs it set."""
        if cfg.runtime.envs_per_worker % self.start_group:
            raise ConfigError(f"config key 'env.start_group': {self.start_group} must divide "
                              f"runtime.envs_per_worker ({cfg.runtime.envs_per_worker}): a group's envs run "
                              f"in one worker")
        if self.reward == "shaped" and self.shaping_gamma is None:
            gamma = getattr(cfg.algo, "gamma", None)
            if gamma is None:
                raise ConfigError(f"config key 'env.shaping_gamma': algorithm {cfg.algorithm!r} has no "
                                  f"algo.gamma to take it from; set it")
            self.shaping_gamma = float(gamma)
