"""What every algorithm provides to the runtime (the shared optimiser step and learning-rate
schedules are in :mod:`flowrl_ray.optim`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from flowrl_ray.batch import Batch
from flowrl_ray.config import Config
from flowrl_ray.envs import EnvSpec


class Algorithm(ABC):
    """An RL algorithm: networks, optimisers, schedulers and the update. No Ray.

    The runtime calls, per policy version: ``prepare(batches)`` (advantages, old log-probs),
    then ``update(prepared)`` (returns metrics), then ``policy_state_dict()`` to publish the
    weights that rollout workers load into ``make_policy(cfg, spec)``.
    ``state_dict()``/``load_state_dict()`` hold everything needed to resume bit-for-bit.
    """

    #: how rollouts are produced: "env_step" (workers step envs with a policy copy) or "group"
    #: (the learner generates samples, rollout workers score them).
    rollout_kind = "env_step"
    #: dataclass schema of the config's `algo` section
    config_class: type
    #: what ``load_state_dict`` changed for a resumed run with another ``train.iterations``
    #: (schedules extended to the new total, see ``load_scheduler``), one line each
    resume_notes: tuple[str, ...] = ()

    @staticmethod
    def validate_config(cfg: Config) -> None:
        """Constraints spanning sections; raise ConfigError naming the key."""

    @staticmethod
    def preflight(cfg: Config, spec: EnvSpec) -> None:
        """Checks of what the config points at (files it loads), run by the Trainer before Ray
        starts; raise ConfigError naming the key. Loading a config does not need the files."""

    def __init__(self, cfg: Config, spec: EnvSpec, device: torch.device):
        self.cfg, self.spec, self.device = cfg, spec, device

    @staticmethod
    @abstractmethod
    def make_policy(cfg: Config, spec: EnvSpec) -> nn.Module:
        """The rollout copy of the policy: a module with ``act(obs, deterministic, generator)``."""

    @property
    @abstractmethod
    def policy(self) -> nn.Module:
        """The learner's policy (same class as ``make_policy`` returns)."""

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}

    @abstractmethod
    def prepare(self, batches: list[Batch]) -> Any: ...

    @abstractmethod
    def update(self, prepared: Any) -> dict[str, float]: ...

    #: (metric, png name) curves the run draws besides the learning curve
    extra_plots: tuple[tuple[str, str], ...] = ()

    def analysis(self) -> dict | None:
        """Small arrays describing the last update (FlowSAR: errors and weights of sample
        episodes), saved by the Trainer as analysis/iter_<i>.npz and drawn by ``plot_analysis``."""
        return None

    @staticmethod
    def plot_analysis(data: dict, out_dir, iteration: int) -> list:
        """Draw ``analysis()`` data into ``out_dir``; returns the PNG paths."""
        return []

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def weight_metrics(module: nn.Module, init: dict[str, torch.Tensor] | None = None,
                   prefix: str = "policy") -> dict[str, float]:
    """L2 norm of all parameters, distance from `init`, parameter mean and std."""
    flat = torch.cat([p.detach().flatten().float().cpu() for p in module.parameters()])
    out = {f"{prefix}/weight_l2_norm": float(flat.norm()),
           f"{prefix}/param_mean": float(flat.mean()), f"{prefix}/param_std": float(flat.std())}
    if init is not None:
        init_flat = torch.cat([init[n].flatten().float() for n, _ in module.named_parameters()])
        out[f"{prefix}/weight_l2_distance_from_init"] = float((flat - init_flat).norm())
    return out
