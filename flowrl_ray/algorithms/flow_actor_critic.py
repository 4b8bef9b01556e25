"""What FPO++ and ReinFlow share: a flow-matching action policy (loaded from a base policy) beside
a value critic, an actor and a critic optimiser with their own learning rates and schedules, the
critic warm-up (actor frozen), PPO's epochs over minibatches (:func:`actor_critic_epochs`), the
metrics every such update reports and the state an exact resume needs.

A subclass keeps its own math: ``make_policy`` (the policy the workers sample), ``prepare`` (the
old log-probs or CFM losses) and ``_losses(b, idx, mb, train_actor) -> (loss, stats)`` (the
surrogate of one minibatch); ``prefix`` names its metrics (``<prefix>/actor_lr``, ...).

    per iteration:  train_actor = iteration >= critic_warmup_iters
                    epochs x minibatches: actor and critic each stepped and clipped on their own
                    the critic's schedule steps every iteration, the actor's from its first step
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np
import torch

from flowrl_ray.algorithms.advantages import explained_variance
from flowrl_ray.algorithms.base import EnvStepAlgorithm
from flowrl_ray.algorithms.onpolicy import actor_critic_epochs, critic_values
from flowrl_ray.config import Config, ConfigError, FlowBCPretrainConfig, check_layer_sizes, check_minibatch_size
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.flow import FlowPolicy, ValueMLP
from flowrl_ray.models.flow_policy import (check_base_policy, check_flow_arch, executed_row_mask, image_shape,
                                           load_base_policy)
from flowrl_ray.optim import load_scheduler, lr_multiplier


class FlowActorCritic(EnvStepAlgorithm):
    pretrain_config_class = FlowBCPretrainConfig
    data_parallel = True              # runtime.num_learners > 1: actor_critic_epochs splits minibatches
    #: the metrics' namespace and the algorithm's name in messages
    prefix: str = ""
    title: str = ""

    @classmethod
    def check_flow_config(cls, cfg: Config) -> None:
        """The checks every flow actor-critic config needs (its subclass adds its own)."""
        c = cfg.algo
        check_layer_sizes(c.hidden_sizes, "algo.hidden_sizes")
        check_layer_sizes(c.critic_hidden_sizes, "algo.critic_hidden_sizes")
        check_flow_arch(cfg)
        check_minibatch_size(cfg, c.minibatch_size)
        if cfg.env.family == "gym":
            raise ConfigError(f"config key 'env.family': {cls.title} emits action chunks [horizon_steps, A]; "
                              "the gym family takes single actions (use the robot family)")

    @staticmethod
    def preflight(cfg: Config, spec: EnvSpec) -> None:
        check_base_policy(cfg)

    def __init__(self, cfg: Config, spec: EnvSpec, device: torch.device):
        super().__init__(cfg, spec, device)
        c = cfg.algo
        self.c = c
        self._policy = self.make_policy(cfg, spec).to(device)
        if c.base_policy is not None:
            self._load_base(load_base_policy(c.base_policy)["policy"])
        self.critic = ValueMLP(spec.obs_dim, c.critic_hidden_sizes, image_shape(cfg), c.feature_dim).to(device)
        self.actor_opt = torch.optim.AdamW(self._actor_param_groups(), lr=c.lr, weight_decay=c.weight_decay)
        self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=c.critic_lr, weight_decay=c.weight_decay)
        # The actor's schedule counts its own iterations: it starts after the critic warm-up,
        # so it has that many fewer to reach its end (its warm-up counts actor iterations too).
        actor_iterations = max(1, cfg.train.iterations - c.critic_warmup_iters)
        actor_schedule = lr_multiplier(c.lr_schedule, actor_iterations, c.lr_warmup_iters)
        critic_schedule = lr_multiplier(c.lr_schedule, cfg.train.iterations)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(self.actor_opt, actor_schedule),
                           torch.optim.lr_scheduler.LambdaLR(self.critic_opt, critic_schedule)]
        self.generator = torch.Generator().manual_seed(cfg.seed)      # minibatch shuffling (FPO++: image shifts)
        self.iteration = 0
        self.skipped_updates = 0

    # ------------------------------------------------------------------ what a subclass may change
    def _load_base(self, state: dict[str, torch.Tensor]) -> None:
        """Load a pretraining checkpoint's policy weights (every key must match)."""
        self._policy.load_state_dict(state)

    def _actor_param_groups(self) -> list[dict]:
        """The actor optimiser's parameter groups (one: the whole policy at algo.lr)."""
        return [{"params": list(self._policy.parameters())}]

    def _actor_trains(self) -> bool:
        """Whether this iteration steps the actor (not during the critic warm-up)."""
        return self.iteration >= self.c.critic_warmup_iters

    def _grad_accumulation(self) -> int:
        return 1

    def _learning_rates(self) -> dict[str, float]:
        return {"actor_lr": self.actor_opt.param_groups[0]["lr"], "critic_lr": self.critic_opt.param_groups[0]["lr"]}

    def _finish_metrics(self, out: dict[str, float], b: dict) -> None:
        """Change the update's metrics in place (default: nothing)."""

    @abstractmethod
    def _losses(self, b: dict, idx: torch.Tensor, mb: torch.Tensor, train_actor: bool) -> tuple[torch.Tensor, dict]:
        """Loss of the minibatch rows ``idx`` (``mb``: the whole minibatch, for its advantage
        statistics) and its statistics."""

    # ------------------------------------------------------------------ shared
    @property
    def policy(self) -> FlowPolicy:
        return self._policy

    def values(self, obs) -> torch.Tensor:
        """V(o) for obs [T, N, ...] (or [K, ...]) -> [T, N] (or [K])."""
        return critic_values(self.critic, obs)

    def _add_row_mask(self, b: dict) -> None:
        """b["row_mask"] [M, Ta]: the rows of each chunk the env executed (the first act_steps,
        fewer where the episode ended inside the chunk); only they carry the ratio."""
        b["row_mask"] = executed_row_mask(b.pop("executed_rows", None), b["advantages"].shape[0],
                                          self.cfg.env.horizon_steps, self.cfg.env.act_steps, self.device)

    def update(self, b: dict) -> dict[str, float]:
        c, m, p = self.c, b["advantages"].shape[0], self.prefix
        train_actor = self._actor_trains()
        # Actor and critic each clipped by their own norm (the FPO++ release clips both
        # separately): a large critic gradient does not shrink the actor's step.
        run = actor_critic_epochs(m, lambda idx, mb, actor: self._losses(b, idx, mb, actor), self.actor_opt,
                                  self.critic_opt, epochs=c.epochs, minibatch_size=c.minibatch_size,
                                  generator=self.generator, device=self.device, max_grad_norm=c.max_grad_norm,
                                  train_actor=train_actor, target_kl=c.target_kl,
                                  grad_accumulation=self._grad_accumulation())
        self.skipped_updates += run.skipped
        lrs = {f"{p}/{k}": v for k, v in self._learning_rates().items()}
        # The actor's schedule starts with its first step (after the critic warm-up).
        for opt, sched in zip((self.actor_opt, self.critic_opt), self.schedulers):
            if opt is self.critic_opt or train_actor:
                sched.step()
        self.iteration += 1
        # The metric names of the papers' logs unprefixed (pg_loss, clipfrac, ...); the rest
        # under the prefix; gradient norms are before clipping.
        out = {k: float(np.mean(v)) for k, v in run.stats.items() if not k.endswith("grad_norm")}
        out.update(lrs)
        out.update({f"{p}/{k}": float(np.mean(run.stats[k])) if k in run.stats else float("nan")
                    for k in ("grad_norm", "actor_grad_norm", "critic_grad_norm")})
        out.update({f"{p}/explained_variance": explained_variance(b["returns"], b["values_old"]),
                    f"{p}/actor_steps": run.actor_steps, f"{p}/critic_steps": run.critic_steps,
                    f"{p}/early_stopped": float(run.early_stop), f"{p}/actor_frozen": float(not train_actor),
                    f"{p}/skipped_updates": self.skipped_updates,
                    f"{p}/advantage_mean": float(b["advantages"].mean()),
                    f"{p}/advantage_std": float(b["advantages"].std()),
                    f"{p}/return_mean": float(b["returns"].mean())})
        self._finish_metrics(out, b)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self._policy.state_dict(), "critic": self.critic.state_dict(),
                "actor_opt": self.actor_opt.state_dict(), "critic_opt": self.critic_opt.state_dict(),
                "schedulers": [s.state_dict() for s in self.schedulers],
                "generator": self.generator.get_state(), "iteration": self.iteration,
                "skipped_updates": self.skipped_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._policy.load_state_dict(state["policy"])
        self.critic.load_state_dict(state["critic"])
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.critic_opt.load_state_dict(state["critic_opt"])
        actor, critic = self.schedulers
        self.resume_notes = tuple(
            load_scheduler(actor, state["schedulers"][0], f"{self.prefix} actor lr", "actor iteration")
            + load_scheduler(critic, state["schedulers"][1], f"{self.prefix} critic lr"))
        self.generator.set_state(state["generator"])
        self.iteration, self.skipped_updates = state["iteration"], state["skipped_updates"]
