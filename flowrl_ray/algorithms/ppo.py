"""Gaussian PPO (Schulman et al., 2017) with the usual implementation details.

Clipped surrogate, optional clipped value loss, entropy bonus, GAE(lambda) with termination vs
truncation, per-minibatch advantage normalisation, minibatch epochs, target-KL early stop,
grad-norm clip, linear or constant learning-rate schedule (``LRSchedule``; a resumed run with
another ``train.iterations`` extends it from where it stands). Reads top to bottom:

    prepare:  V(s_t), V(s_{t+1}) (bootstrap on truncation) -> GAE -> flat [T*N] tensors
    update:   epochs x minibatches of   -L_clip + c_v * L_V - c_e * H
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np
import torch

from flowrl_ray.algorithms.advantages import explained_variance, normalize
from flowrl_ray.algorithms.base import EnvStepAlgorithm
from flowrl_ray.optim import load_scheduler, local_part, lr_multiplier, minibatches, optimizer_step
from flowrl_ray.algorithms.losses import approx_kl, ppo_clip_objective, value_loss
from flowrl_ray.algorithms.onpolicy import advantages_from_rollouts
from flowrl_ray.batch import Batch
from flowrl_ray.config import Config, check, check_layer_sizes, check_minibatch_size
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.gaussian import GaussianPolicy, ValueNet


@dataclass
class PPOConfig:
    lr: float = field(default=3e-4, metadata=check(gt=0))
    lr_schedule: Literal["constant", "linear"] = "linear"
    gamma: float = field(default=0.99, metadata=check(ge=0, le=1))
    gae_lambda: float = field(default=0.95, metadata=check(ge=0, le=1))
    clip: float = field(default=0.2, metadata=check(gt=0))
    vf_clip: Optional[float] = field(default=None, metadata=check(gt=0))  # None: unclipped value loss
    vf_coef: float = field(default=0.5, metadata=check(ge=0))
    ent_coef: float = field(default=0.0, metadata=check(ge=0))
    epochs: int = field(default=10, metadata=check(gt=0))
    minibatch_size: int = field(default=64, metadata=check(gt=0))
    normalize_advantages: bool = True
    target_kl: Optional[float] = field(default=None, metadata=check(gt=0))
    max_grad_norm: float = field(default=0.5, metadata=check(gt=0))
    hidden_sizes: list = field(default_factory=lambda: [64, 64])
    activation: Literal["tanh", "relu"] = "tanh"
    log_std_init: float = 0.0
    squash: bool = False              # tanh-squash actions (else Gaussian clipped at the bounds)
    normalize_obs: bool = True        # running mean/std, part of the policy's weights
    reward_scale: float = field(default=1.0, metadata=check(gt=0))


#: algorithm name -> schema of its `algo` section. Later algorithms register here.
ALGO_CONFIGS: dict[str, type] = {"ppo": PPOConfig}


@dataclass
class PPOBatch:
    """Flat training data, all [M] or [M, ...] with M = T * N."""
    obs: torch.Tensor          # [M, D] raw observations
    actions: torch.Tensor      # [M, A] raw (pre-squash) actions
    logp_old: torch.Tensor     # [M]   behaviour log-probs recorded by the worker
    values_old: torch.Tensor   # [M]
    advantages: torch.Tensor   # [M]
    returns: torch.Tensor      # [M]


class PPO(EnvStepAlgorithm):
    config_class = PPOConfig
    data_parallel = True              # runtime.num_learners > 1: each rank a share of each minibatch

    @staticmethod
    def validate_config(cfg: Config) -> None:
        c: PPOConfig = cfg.algo
        check_layer_sizes(c.hidden_sizes, "algo.hidden_sizes")
        check_minibatch_size(cfg, c.minibatch_size)

    def __init__(self, cfg: Config, spec: EnvSpec, device: torch.device):
        super().__init__(cfg, spec, device)
        c: PPOConfig = cfg.algo
        self.c = c
        self._policy = self.make_policy(cfg, spec).to(device)
        self.value_net = ValueNet(spec.obs_dim, c.hidden_sizes, c.activation).to(device)
        self.params = list(self._policy.parameters()) + list(self.value_net.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=c.lr, eps=1e-5, fused=True)  # one kernel, not a loop per tensor
        # Linear anneal to 0 over the run, stepped once per update (CleanRL's schedule).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_multiplier(c.lr_schedule, cfg.train.iterations))
        self.generator = torch.Generator().manual_seed(cfg.seed)   # minibatch shuffling
        self.skipped_updates = 0

    @staticmethod
    def make_policy(cfg: Config, spec: EnvSpec) -> GaussianPolicy:
        c: PPOConfig = cfg.algo
        return GaussianPolicy(spec.obs_dim, spec.action_dim, c.hidden_sizes, c.activation,
                              c.log_std_init, c.squash, c.normalize_obs)

    @property
    def policy(self) -> GaussianPolicy:
        return self._policy

    def values(self, obs: torch.Tensor) -> torch.Tensor:
        """V(s) for raw obs [..., D] -> [...], with the policy's observation normaliser."""
        flat = obs.reshape(-1, obs.shape[-1])
        return self.value_net(self._policy.obs_norm(flat)).reshape(obs.shape[:-1])

    # ------------------------------------------------------------------ prepare
    def prepare(self, batches: list[Batch]) -> PPOBatch:
        c = self.c
        d = advantages_from_rollouts(batches, self.values, c.gamma, c.gae_lambda, c.reward_scale, self.device)
        d["logp_old"] = d.pop("logp")
        return PPOBatch(**d)

    # ------------------------------------------------------------------ update
    def update(self, b: PPOBatch) -> dict[str, float]:
        c, m = self.c, b.obs.shape[0]
        stats: dict[str, list[float]] = {k: [] for k in
                                         ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "grad_norm")}
        epochs_run, early_stop = 0, False
        for _ in range(c.epochs):
            epochs_run += 1
            for mb in minibatches(m, c.minibatch_size, self.generator, self.device):   # [mb] rows
                # a learner group: this rank's share of the minibatch (all of it on one learner)
                part = local_part(len(mb))
                idx, share = mb[part], (part.stop - part.start) / len(mb)
                dist = self._policy.distribution(b.obs[idx])
                logp = dist.log_prob(b.actions[idx]).sum(-1)                 # [share]
                log_ratio = logp - b.logp_old[idx]
                ratio = log_ratio.exp()
                adv = (normalize(b.advantages[mb]) if c.normalize_advantages else b.advantages[mb])[part]
                policy_loss = -ppo_clip_objective(ratio, adv, c.clip).mean()
                v_loss = value_loss(self.values(b.obs[idx]), b.returns[idx], b.values_old[idx], c.vf_clip).mean()
                entropy = dist.entropy().sum(-1).mean()
                loss = (policy_loss + c.vf_coef * v_loss - c.ent_coef * entropy) * share
                with torch.no_grad():                # the minibatch's means: the shares' summed (in the step's all-reduce)
                    values = torch.stack([policy_loss, v_loss, entropy, approx_kl(log_ratio),
                                          ((ratio - 1).abs() > c.clip).float().mean()]) * share
                (grad_norm,), stepped = optimizer_step(loss, self.optimizer, c.max_grad_norm,   # one optimiser, policy
                                                       also_sum=values)                        # and value: one norm
                self.skipped_updates += int(not stepped)
                policy_l, v_l, ent, kl, clipped = values.tolist()
                for k, v in (("policy_loss", policy_l), ("value_loss", v_l), ("entropy", ent),
                             ("approx_kl", kl), ("clip_fraction", clipped), ("grad_norm", grad_norm)):
                    stats[k].append(float(v))
                if c.target_kl is not None and kl > c.target_kl:
                    early_stop = True
                    break
            if early_stop:
                break
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        # The normaliser moves after the update, so the epochs above used the statistics the
        # batch was sampled with (first-epoch ratios are exactly 1 in synchronous mode).
        self._policy.obs_norm.update(b.obs)
        out = {f"ppo/{k}": float(np.mean(v)) if v else float("nan") for k, v in stats.items()}
        out.update({"ppo/explained_variance": explained_variance(b.returns, b.values_old),
                    "ppo/lr": lr, "ppo/epochs_run": epochs_run,
                    "ppo/early_stopped": float(early_stop), "ppo/skipped_updates": self.skipped_updates,
                    "ppo/log_std_mean": float(self._policy.log_std.detach().mean()),
                    "ppo/advantage_mean": float(b.advantages.mean()), "ppo/advantage_std": float(b.advantages.std())})
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"policy": self._policy.state_dict(), "value_net": self.value_net.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "generator": self.generator.get_state(), "skipped_updates": self.skipped_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._policy.load_state_dict(state["policy"])
        self.value_net.load_state_dict(state["value_net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.resume_notes = tuple(load_scheduler(self.scheduler, state["scheduler"], "ppo lr"))
        self.generator.set_state(state["generator"])
        self.skipped_updates = state["skipped_updates"]
