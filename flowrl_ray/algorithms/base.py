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
    """What both algorithm kinds give the runtime: networks, optimisers, schedulers and the
    update. No Ray. An algorithm subclasses one of the two kinds below, which say how its
    rollouts are produced (the runtime's strategy for each is in ``runtime/rollouts.py``).

    Per policy version the runtime calls ``prepare(batches)`` (advantages, old log-probs), then
    ``update(prepared)`` (returns metrics). ``state_dict()``/``load_state_dict()`` hold
    everything needed to resume bit-for-bit.
    """

    #: "env_step" or "group": set by the kind (EnvStepAlgorithm / GroupAlgorithm), never by hand
    rollout_kind: str = ""
    #: dataclass schema of the config's `algo` section
    config_class: type
    #: schema of the `pretrain` section (flowrl_ray.config; its class picks the method of
    #: flowrl_ray.pretrain); None: `flowrl-ray pretrain` has nothing to start for this algorithm
    pretrain_config_class: type | None = None
    #: whether ``update`` runs in a learner group (``runtime.num_learners`` > 1): every rank
    #: prepares the whole batch and takes its share of each minibatch (flowrl_ray.optim, "data
    #: parallelism"); False: the config refuses more than one learner
    data_parallel: bool = False
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


class EnvStepAlgorithm(Algorithm):
    """Rollout workers step vectorised envs with a copy of the policy (PPO, CMA-PPO, FPO++,
    ReinFlow, FlowSAR).

    After each update the runtime publishes ``policy_state_dict()`` (one ``ray.put`` per
    version); every worker loads it into its ``make_policy(cfg, spec)`` copy and returns
    time-major batches of what the policy's ``act`` recorded. Checkpoints carry the same weights
    under ``"policy"`` for ``eval`` and ``serve``.
    """

    rollout_kind = "env_step"

    @staticmethod
    @abstractmethod
    def make_policy(cfg: Config, spec: EnvSpec) -> nn.Module:
        """The rollout copy of the policy: a module with ``act(obs, deterministic, generator)``."""

    @property
    @abstractmethod
    def policy(self) -> nn.Module:
        """The learner's policy (same class as ``make_policy`` returns)."""

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights rollout workers load (FlowSAR: its EMA rollout policy)."""
        return {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}


class GroupAlgorithm(Algorithm):
    """The learner samples; scoring workers turn samples into rewards (Flow-GRPO, FED-GRPO).

    Per iteration the runtime calls ``generate(num_chunks, "train")``, which samples each prompt
    a group of times on the learner's device and keeps what the update needs (trajectories,
    behaviour log-probs); each chunk goes to one scoring worker (a browser, a force field) made by
    the env family's ``make_scorer``; the scored batches come back to ``prepare``. Evaluation is
    ``generate(num_chunks, "eval")``, scored the same way, summarised by ``eval_metrics``.
    Scorers hold no model, so nothing is published; the model is in ``state_dict()``.

    ``generate`` keeps what the update needs in ``pending`` (the last generation); ``eval_metrics``
    reads it, and ``prepare(batches, generation)`` is given the generation its batches scored. In
    asynchronous mode (``runtime.mode=async``) the runtime generates the next groups before the
    update on the previous ones, keeps each "train" generation's ``pending`` and passes it to the
    ``prepare`` of its scored samples: the update may then train on samples of a policy up to
    ``runtime.max_staleness`` versions old, with their behaviour log-probs.
    """

    rollout_kind = "group"
    pending: dict

    @abstractmethod
    def generate(self, num_chunks: int, mode: str) -> list[dict]:
        """Sample for ``mode`` ("train": this iteration's groups; "eval": the evaluation set);
        -> at most ``num_chunks`` chunks of samples for the scorers (the family's format)."""

    @abstractmethod
    def prepare(self, batches: list[Batch], generation: dict | None = None) -> Any:
        """The update's inputs from the scored ``batches`` of ``generation`` (the ``pending`` that
        ``generate`` kept for those samples; None: the last generation's)."""

    @abstractmethod
    def eval_metrics(self, batches: list[Batch]) -> dict[str, float]:
        """The ``eval/...`` metrics of the scored evaluation samples (the last "eval" generate)."""


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
