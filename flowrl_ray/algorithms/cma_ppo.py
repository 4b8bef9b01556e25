"""CMA-PPO (Hamalainen et al., 2018, "PPO-CMA: Proximal Policy Optimization with Covariance
Matrix Adaptation"), for Gaussian policies with separate mean and variance networks.

Per iteration (pre-tanh actions a, advantages A from GAE):
    CMA batch      positives (A >= 0) as they are, weight A;
                   negatives mirrored around the current mean, a' = 2 mu(s) - a,
                   weight |A| * exp(-||a - mu(s)||^2 / (2 sigma^2))         (now "good")
    (1) variance   on minibatches of the CMA batches of the last `history_size` iterations:
                   L_var  = -mean(w * log N(a' | mu(s).detach(), var(s)))
    (2) mean       on the current iteration's CMA batch:
                   L_mean = -mean(w * log N(a' | mu(s), var(s).detach()))
    (3) value      on the current iteration: MSE(V(s), returns)
Unclipped, no entropy bonus, `epochs` epochs each. The variance step before the mean step is
the CMA-ES rank-mu order: the distribution's shape adapts from where the mean was.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from flowrl_ray.algorithms.base import EnvStepAlgorithm, weight_metrics
from flowrl_ray.optim import local_part, minibatches, optimizer_step, reduce_sum
from flowrl_ray.algorithms.onpolicy import advantages_from_rollouts
from flowrl_ray.batch import Batch
from flowrl_ray.config import Config, check, check_layer_sizes
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.cma import CMAPolicy


@dataclass
class CMAPPOConfig:
    #: earlier or paper names of keys, accepted and mapped to the one name (config/compat.py)
    ALIASES = {"lam": "gae_lambda", "n_updates": "epochs", "batch_size": "minibatch_size"}
    gamma: float = field(default=0.99, metadata=check(ge=0, le=1))
    gae_lambda: float = field(default=0.95, metadata=check(ge=0, le=1))
    lr_mean: float = field(default=3e-4, metadata=check(gt=0))
    lr_var: float = field(default=3e-4, metadata=check(gt=0))
    lr_value: float = field(default=1e-3, metadata=check(gt=0))
    minibatch_size: int = field(default=2048, metadata=check(gt=0))
    epochs: int = field(default=5, metadata=check(gt=0))               # epochs per network
    history_size: int = field(default=5, metadata=check(gt=0))
    kernel_std: float = field(default=0.1, metadata=check(gt=0))
    kernel: Literal["fixed", "policy"] = "fixed"     # policy: the policy's own per-dim variance
    mirror_sampling: Literal["all", "resample"] = "all"
    hidden_sizes: list = field(default_factory=lambda: [100, 100])
    init_log_var: float = 0.0
    normalize_obs: bool = True
    reward_scale: float = field(default=1.0, metadata=check(gt=0))
    max_grad_norm: float | None = field(default=None, metadata=check(gt=0))


def cma_batch(obs: torch.Tensor, pre_tanh_actions: torch.Tensor, advantages: torch.Tensor,
              mean: torch.Tensor, kernel_std: float | torch.Tensor) -> dict[str, torch.Tensor]:
    """The CMA batch: obs [B, D], pre-tanh actions [B, A], advantages [B], current mean [B, A].

    Returns {obs [M, D], actions [M, A], weights [M]}: the positive samples first (A >= 0, weight
    A), in input order, then every negative one mirrored, a' = 2 mu - a, with weight
    |A| * exp(-||a - mu||^2 / (2 sigma^2)), in input order. `kernel_std` is a scalar sigma or a
    per-dimension [B, A] std (the policy's own), in which case the exponent is
    sum_j (a_j - mu_j)^2 / (2 sigma_j^2). Deterministic: no resampling.
    """
    pos = advantages >= 0
    neg = ~pos
    diff = pre_tanh_actions[neg] - mean[neg]                                 # [Bn, A]
    sigma = kernel_std[neg] if torch.is_tensor(kernel_std) and kernel_std.ndim == 2 else kernel_std
    kernel = torch.exp(-(diff.pow(2) / (2 * torch.as_tensor(sigma) ** 2)).sum(-1))  # [Bn]
    return {"obs": torch.cat([obs[pos], obs[neg]]),
            "actions": torch.cat([pre_tanh_actions[pos], 2 * mean[neg] - pre_tanh_actions[neg]]),
            "weights": torch.cat([advantages[pos], advantages[neg].abs() * kernel])}


def resample_mirrored(batch: dict[str, torch.Tensor], num_positive: int, generator: torch.Generator) -> dict:
    """Balance positives and mirrored samples: draw `num_positive` mirrored samples with
    probability proportional to their weight, each carrying weight (total mirrored mass) / count,
    so the mirrored part's total weight is unchanged."""
    m_obs, m_act, m_w = (batch[k][num_positive:] for k in ("obs", "actions", "weights"))
    count = min(num_positive, len(m_w)) if num_positive else len(m_w)
    if count == 0 or float(m_w.sum()) <= 0:
        return batch
    idx = torch.multinomial(m_w, count, replacement=True, generator=generator)
    w = torch.full((count,), float(m_w.sum()) / count, dtype=m_w.dtype)
    return {"obs": torch.cat([batch["obs"][:num_positive], m_obs[idx]]),
            "actions": torch.cat([batch["actions"][:num_positive], m_act[idx]]),
            "weights": torch.cat([batch["weights"][:num_positive], w])}


class CMAPPO(EnvStepAlgorithm):
    config_class = CMAPPOConfig
    data_parallel = True              # runtime.num_learners > 1: each rank a share of each minibatch

    @staticmethod
    def validate_config(cfg: Config) -> None:
        c: CMAPPOConfig = cfg.algo
        check_layer_sizes(c.hidden_sizes, "algo.hidden_sizes")

    def __init__(self, cfg: Config, spec: EnvSpec, device: torch.device):
        super().__init__(cfg, spec, device)
        self.c: CMAPPOConfig = cfg.algo
        self._policy = self.make_policy(cfg, spec).to(device)
        p = self._policy
        self.opt_mean = torch.optim.Adam(p.mean_net.parameters(), lr=self.c.lr_mean)
        self.opt_var = torch.optim.Adam(p.var_net.parameters(), lr=self.c.lr_var)
        self.opt_value = torch.optim.Adam(p.vf.parameters(), lr=self.c.lr_value)
        self.history: deque = deque(maxlen=self.c.history_size)   # dicts of obs/actions/advantages/returns
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.init_params = {n: t.detach().cpu().clone() for n, t in p.named_parameters()}
        self.skipped_updates = 0

    @staticmethod
    def make_policy(cfg: Config, spec: EnvSpec) -> CMAPolicy:
        c: CMAPPOConfig = cfg.algo
        return CMAPolicy(spec.obs_dim, spec.action_dim, c.hidden_sizes, c.init_log_var, c.normalize_obs)

    @property
    def policy(self) -> CMAPolicy:
        return self._policy

    def prepare(self, batches: list[Batch]) -> dict[str, torch.Tensor]:
        c = self.c
        return advantages_from_rollouts(batches, self._policy.value, c.gamma, c.gae_lambda, c.reward_scale, self.device)

    # ------------------------------------------------------------------ the CMA batch of one entry
    @torch.no_grad()
    def _cma_batch(self, entry: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mean, var = self._policy.get_mean_var(entry["obs"])
        sigma = var.sqrt() if self.c.kernel == "policy" else self.c.kernel_std
        batch = cma_batch(entry["obs"], entry["actions"], entry["advantages"], mean, sigma)
        if self.c.mirror_sampling == "resample":
            batch = resample_mirrored(batch, int((entry["advantages"] >= 0).sum()), self.generator)
        return batch

    def _epochs(self, batch: dict, loss_fn, optimizer) -> float:
        """`epochs` epochs of shuffled minibatches; returns the mean loss.

        Mean, variance and value networks each have their own loss and optimiser, stepped in
        turn, so each gradient is clipped by its own norm: per-network clipping is what this
        always did.
        """
        losses, m = [], next(iter(batch.values())).shape[0]
        for _ in range(self.c.epochs):
            for mb in minibatches(m, self.c.minibatch_size, self.generator, self.device):
                idx = mb[local_part(len(mb))]            # a learner group: this rank's share
                loss = loss_fn({k: v[idx] for k, v in batch.items()}) * (len(idx) / len(mb))
                _, stepped = optimizer_step(loss, optimizer, self.c.max_grad_norm)
                self.skipped_updates += int(not stepped)
                losses.append(float(reduce_sum(loss.detach())))   # the minibatch's mean loss
        return sum(losses) / max(len(losses), 1)

    def _var_loss(self, mb: dict) -> torch.Tensor:
        mean, var = self._policy.get_mean_var(mb["obs"])
        return -(mb["weights"] * CMAPolicy.gaussian_log_prob(mb["actions"], mean.detach(), var)).mean()

    def _mean_loss(self, mb: dict) -> torch.Tensor:
        mean, var = self._policy.get_mean_var(mb["obs"])
        return -(mb["weights"] * CMAPolicy.gaussian_log_prob(mb["actions"], mean, var.detach())).mean()

    def _value_loss(self, mb: dict) -> torch.Tensor:
        return (self._policy.value(mb["obs"]) - mb["returns"]).pow(2).mean()

    def update(self, data: dict[str, torch.Tensor]) -> dict[str, float]:
        p = self._policy
        self.history.append({k: data[k] for k in ("obs", "actions", "advantages", "returns")})
        # (1) variance on the whole history, each entry mirrored around the current mean
        history_batches = [self._cma_batch(e) for e in self.history]
        var_batch = {k: torch.cat([b[k] for b in history_batches]) for k in ("obs", "actions", "weights")}
        var_loss = self._epochs(var_batch, self._var_loss, self.opt_var)
        # (2) mean on the current iteration's CMA batch (built after the variance step)
        mean_batch = self._cma_batch(self.history[-1])
        mean_loss = self._epochs(mean_batch, self._mean_loss, self.opt_mean)
        # (3) value on the current data
        value_batch = {"obs": data["obs"], "returns": data["returns"]}
        value_loss = self._epochs(value_batch, self._value_loss, self.opt_value)
        p.obs_norm.update(data["obs"])      # after the update, as in PPO (see ppo.py)
        adv = data["advantages"]
        out = {"cma_ppo/mean_loss": mean_loss, "cma_ppo/var_loss": var_loss, "cma_ppo/value_loss": value_loss,
               "cma_ppo/advantage_mean": float(adv.mean()), "cma_ppo/advantage_std": float(adv.std()),
               "cma_ppo/history_len": len(self.history), "cma_ppo/mirrored_fraction": float((adv < 0).float().mean()),
               "cma_ppo/skipped_updates": self.skipped_updates}
        with torch.no_grad():
            _, var = p.get_mean_var(data["obs"])
            out["cma_ppo/policy_std_mean"] = float(var.sqrt().mean())
        out.update(weight_metrics(p, self.init_params))
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"policy": self._policy.state_dict(), "opt_mean": self.opt_mean.state_dict(),
                "opt_var": self.opt_var.state_dict(), "opt_value": self.opt_value.state_dict(),
                "history": [{k: v.cpu() for k, v in e.items()} for e in self.history],
                "generator": self.generator.get_state(), "init_params": self.init_params,
                "skipped_updates": self.skipped_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._policy.load_state_dict(state["policy"])
        self.opt_mean.load_state_dict(state["opt_mean"])
        self.opt_var.load_state_dict(state["opt_var"])
        self.opt_value.load_state_dict(state["opt_value"])
        self.history = deque(({k: v.to(self.device) for k, v in e.items()} for e in state["history"]),
                             maxlen=self.c.history_size)
        self.generator.set_state(state["generator"])
        self.init_params = state["init_params"]
        self.skipped_updates = state["skipped_updates"]
