"""ReinFlow (Zhang et al., 2025, "ReinFlow: Fine-tuning Flow Matching Policy with Online
Reinforcement Learning"): PPO for a flow-matching action policy made stochastic by a learnable
Gaussian noise at each of its K Euler steps (:mod:`flowrl_ray.models.noisy_flow`).

    rollout (worker): x_0 ~ N(0, I), then K steps
                          mu_k = clip(x_k + v(x_k, k/K | o) / K, -1, 1)
                          x_{k+1} = mu_k + sigma_phi(k/K | o) * z_k,   z_k ~ N(0, I)
                      the env executes clip(x_K, -1, 1); the chain x_0 .. x_K is recorded; the env
                      reports how many rows of the chunk it executed
    prepare:          V(o_t), GAE -> flat [M] advantages, returns; the row mask [M, Ta]; then
                          log pi_old = sum_k sum_{executed rows} sum_d log N(x_{k+1}; mu_k, sigma_k^2)
                      under the rollout weights (sync: the learner's weights are the rollout
                      weights, so every ratio is 1 before the first step, up to float rounding
                      of another batch size; async: the
                      workers record each row's log-prob at sampling time)
    update:           rho = exp(s * (log pi_new - log pi_old)),   s = 1 or 1 / ((K + 1) Ta Da)
                      maximise mean PPO-clip(rho, A) + ent_coef * s * H(chain)
                      - vf_coef * value loss; critic warm-up (actor frozen), target-KL stop,
                      grad clip; the velocity net, the noise net and the critic each with their
                      own learning rate.

``advantage: group`` is πRL's GRPO for flow policies on the same noisy chain: no critic; each
episode's return normalised within its start group (the K = ``env.start_group`` episodes that
started from one seeded state, GRPO's group) is the advantage of every step of the episode, and an
episode waits until its group has ended:

    A_e = (G_e - mean_g G) / (std_g G + 1e-8),   A_i = A_e for each step i of episode e

``noise: sde`` is πRL's Flow-SDE instead of the noise network: the flow's marginal-preserving
SDE on the same grid (:mod:`flowrl_ray.models.noisy_flow`), sigma_tau = sde_level sqrt((1 - tau) / tau),
unclipped means, nothing learned in the noise; evaluation is the Euler sampler.

``logprob_scale``: "joint" uses the chain's log-probability itself (s = 1). "reference" divides
it by (K + 1) * Ta * Da, the number of Gaussian entries of the chain with its initial noise, as
the ReinFlow release does; the release's clip (0.01), target KL and entropy coefficient are in
that scale. The release also clamps each normalised log-prob to [-1, 1] and truncates the noise
to +-3 sigma; neither is done here (the ratio is the chain's exact one).

Evaluation turns the noise off, as the release does: x_0 ~ N(0, I) (or x_0 = 0 with
``eval.sampling: zero``) and the mean chain. Only the entropy term and the log-probs' sigma
reach the noise network; the velocity network gets the log-probs' means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np
import torch

from flowrl_ray.algorithms.advantages import group_advantages, normalize
from flowrl_ray.algorithms.episodes import EpisodeAssembler, StartGroups, episode_obs
from flowrl_ray.algorithms.flow_actor_critic import FlowActorCritic
from flowrl_ray.algorithms.losses import approx_kl, ppo_clip_objective, value_loss
from flowrl_ray.algorithms.onpolicy import advantages_from_rollouts
from flowrl_ray.batch import Batch, map_obs
from flowrl_ray.config import Config, ConfigError, check, check_layer_sizes
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.flow import FLOW_ARCH_DEFAULTS, FlowPolicy, Obs, obs_batch_size
from flowrl_ray.models.flow_policy import image_shape
from flowrl_ray.models.noisy_flow import NoiseStdNet, chain_entropy, chain_log_prob, noisy_flow_sample, sde_log_std
from flowrl_ray.utils import randn

@dataclass
class ReinFlowConfig:
    #: earlier or paper names of keys, accepted and mapped to the one name (config/compat.py)
    ALIASES = {"actor_lr": "lr", "actor_lr_warmup_iters": "lr_warmup_iters"}
    base_policy: Optional[str] = None   # a `flowrl-ray pretrain` checkpoint; None: random init
    # the flow policy (must match the base policy's; `flowrl-ray pretrain` reads the same keys)
    hidden_sizes: list = field(default_factory=lambda: [512, 512, 512])
    time_dim: int = field(default=32, metadata=check(gt=0))
    feature_dim: int = field(default=64, metadata=check(gt=0))      # image encoder output
    flow_steps: int = field(default=4, metadata=check(gt=0))        # K denoising steps (paper: 1-4)
    # the velocity network's form (as FPO++'s; a base from `flowrl-ray import-reinflow` needs the
    # ReinFlow FlowMLP's, which that command prints)
    time_embedding: Literal["flowrl", "reinflow"] = "flowrl"
    velocity_mlp: Literal["plain", "residual"] = "plain"
    velocity_activation: Literal["mish", "relu", "tanh", "elu", "gelu", "silu", "softplus"] = "mish"
    # the noise network sigma_phi(tau | o): per-entry std in [min_noise_std, max_noise_std]
    min_noise_std: float = field(default=0.08, metadata=check(gt=0))
    max_noise_std: float = field(default=0.14, metadata=check(gt=0))
    noise_hidden_sizes: list = field(default_factory=lambda: [128, 128])
    noise_time_dim: int = field(default=16, metadata=check(gt=0))
    # learned: ReinFlow's noise network (πRL's Flow-Noise); sde: πRL's Flow-SDE, the flow's
    # marginal-preserving SDE with sigma_tau = sde_level * sqrt((1 - tau) / tau), nothing learned in
    # the noise (at K = 4 and 0.5 the steps' stds are 0.50, 0.43, 0.25, 0.14: the last one
    # ReinFlow's max_noise_std)
    noise: Literal["learned", "sde"] = "learned"
    sde_level: float = field(default=0.5, metadata=check(gt=0))
    # PPO on the chain's log-probability
    logprob_scale: Literal["joint", "reference"] = "joint"
    clip: float = field(default=0.2, metadata=check(gt=0))
    ent_coef: float = field(default=0.0, metadata=check(ge=0))
    gamma: float = field(default=0.99, metadata=check(ge=0, le=1))
    gae_lambda: float = field(default=0.95, metadata=check(ge=0, le=1))
    reward_scale: float = field(default=1.0, metadata=check(gt=0))
    bootstrap_truncated: bool = True
    epochs: int = field(default=5, metadata=check(gt=0))
    minibatch_size: int = field(default=500, metadata=check(gt=0))
    normalize_advantages: bool = True
    lr: float = field(default=4.5e-5, metadata=check(gt=0))   # the velocity network
    noise_lr: Optional[float] = field(default=None, metadata=check(gt=0))   # None: lr
    critic_lr: float = field(default=6.5e-4, metadata=check(gt=0))
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_warmup_iters: int = field(default=0, metadata=check(ge=0))
    weight_decay: float = field(default=0.0, metadata=check(ge=0))
    vf_coef: float = field(default=0.5, metadata=check(ge=0))
    max_grad_norm: float = field(default=1.0, metadata=check(gt=0))
    target_kl: Optional[float] = field(default=None, metadata=check(gt=0))
    critic_warmup_iters: int = field(default=2, metadata=check(ge=0))
    critic_hidden_sizes: list = field(default_factory=lambda: [256, 256, 256])
    # gae: PPO with the critic's GAE advantages (ReinFlow, πRL's Flow-Noise PPO); group: πRL's GRPO for
    # flow policies, each episode's return normalised within its start group (env.start_group), no critic
    advantage: Literal["gae", "group"] = "gae"


class NoisyFlowPolicy(FlowPolicy):
    """A :class:`FlowPolicy` (same encoder, velocity net and state-dict keys, so a pretraining
    checkpoint loads into it with :meth:`load_base`) plus ReinFlow's noise network ``noise``.

    ``act``: training samples (``record``) run the noisy chain from x_0 ~ N(0, I) and record it
    (``chains`` [N, K + 1, Ta, Da]; with ``record_old_logp`` also each row's log-prob
    ``logp_old`` [N, Ta]); evaluation (``record=False``) runs the mean chain from x_0 ~ N(0, I),
    ``deterministic`` from x_0 = 0."""

    def __init__(self, state_dim: int, action_dim: int, horizon_steps: int, hidden_sizes: list[int],
                 time_dim: int, flow_steps: int, image_shape, feature_dim: int, noise_hidden_sizes: list[int],
                 min_std: float, max_std: float, noise_time_dim: int = 16, record_old_logp: bool = False,
                 sde_level: float | None = None, **arch):
        # arch: the velocity network's options (FLOW_ARCH_DEFAULTS); the chain has its own grid
        super().__init__(state_dim, action_dim, horizon_steps, hidden_sizes, time_dim, flow_steps, n_mc=0,
                         image_shape=image_shape, feature_dim=feature_dim, record_old_losses=False, **arch)
        self.noise = NoiseStdNet(self.encoder.out_dim, horizon_steps, action_dim, noise_hidden_sizes,
                                 min_std, max_std, noise_time_dim)
        self.record_old_logp = record_old_logp
        self.sde_level = sde_level          # Flow-SDE's a; None: the noise net's sigma

    def log_std(self, tau: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """log sigma(tau | o) [B, Ta, Da]; the noise net reads the condition without sending
        gradients into the encoder (which only the velocity's log-prob means train). Under
        Flow-SDE the step's std sigma_tau sqrt(dt), the same for every entry."""
        if self.sde_level is not None:
            return sde_log_std(tau, self.flow_steps, self.sde_level).expand(-1, *self.chunk_shape)
        return self.noise(tau, cond.detach())

    def load_base(self, state: dict[str, torch.Tensor]) -> None:
        """Load a pretraining checkpoint's FlowPolicy weights; the noise network keeps its init.
        Every other key must match exactly."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith("noise.")]
        if missing or unexpected:
            raise RuntimeError(f"base policy does not match the flow policy: missing {missing}, "
                               f"unexpected {unexpected}")

    def sample(self, obs: Obs, eps: torch.Tensor, steps: int | None = None) -> torch.Tensor:
        """The mean chain (noise off) from eps [B, Ta, Da] -> actions [B, Ta, Da] in [-1, 1]."""
        action, _ = noisy_flow_sample(self.velocity, self.log_std, self.encoder(obs), eps,
                                      steps or self.flow_steps, deterministic=True, sde_level=self.sde_level)
        return action

    def chain_log_prob(self, obs: Obs, chains: torch.Tensor, row_mask: torch.Tensor | None = None,
                       per_row: bool = False) -> torch.Tensor:
        """log pi of chains [B, K + 1, Ta, Da] -> [B] (``per_row``: [B, Ta])."""
        return chain_log_prob(self.velocity, self.log_std, self.encoder(obs), chains, row_mask, per_row,
                              self.sde_level)

    def chain_entropy(self, obs: Obs, chains: torch.Tensor, row_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Entropy of the chains' Gaussian transitions [B] (the noise net only)."""
        return chain_entropy(self.log_std, self.encoder(obs), chains, row_mask)          # log_std: either noise

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False, generator: torch.Generator | None = None,
            record: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        n = obs_batch_size(obs)
        shape = (n, *self.chunk_shape)
        x0 = torch.zeros(shape) if deterministic else randn(shape, generator)
        noisy = record and not deterministic
        cond = self.encoder(obs)
        actions, chain = noisy_flow_sample(self.velocity, self.log_std, cond, x0, self.flow_steps,
                                           deterministic=not noisy, generator=generator, sde_level=self.sde_level)
        out = {"actions": actions}
        if noisy:
            out["chains"] = chain                                                 # [N, K + 1, Ta, Da]
            if self.record_old_logp:
                out["logp_old"] = chain_log_prob(self.velocity, self.log_std, cond, chain, per_row=True,
                                                 sde_level=self.sde_level)
        return actions, out


def make_noisy_flow_policy(cfg: Config, spec: EnvSpec) -> NoisyFlowPolicy:
    c = cfg.algo
    return NoisyFlowPolicy(spec.obs_dim, spec.action_dim, cfg.env.horizon_steps, c.hidden_sizes, c.time_dim,
                           c.flow_steps, image_shape(cfg), c.feature_dim, c.noise_hidden_sizes,
                           c.min_noise_std, c.max_noise_std, c.noise_time_dim,
                           # async, or group advantages (an episode may wait an iteration for its
                           # group): the behaviour policy's log-probs, recorded at sampling time
                           record_old_logp=cfg.runtime.mode == "async" or c.advantage == "group",
                           sde_level=c.sde_level if c.noise == "sde" else None,
                           **{k: getattr(c, k) for k in FLOW_ARCH_DEFAULTS})


class ReinFlow(FlowActorCritic):
    config_class = ReinFlowConfig
    prefix, title = "reinflow", "ReinFlow"

    @classmethod
    def validate_config(cls, cfg: Config) -> None:
        c: ReinFlowConfig = cfg.algo
        cls.check_flow_config(cfg)
        check_layer_sizes(c.noise_hidden_sizes, "algo.noise_hidden_sizes")
        if c.advantage == "group" and getattr(cfg.env, "start_group", 1) < 2:
            raise ConfigError("config key 'algo.advantage': 'group' needs groups of episodes from one start "
                              "state: set env.start_group to the group size K >= 2 (a divisor of "
                              "runtime.envs_per_worker)")
        if c.noise == "sde" and c.ent_coef > 0:
            raise ConfigError(f"config key 'algo.ent_coef': {c.ent_coef} with algo.noise 'sde', whose noise is "
                              "fixed (its entropy has no gradient): set it to 0")
        if c.min_noise_std > c.max_noise_std:
            raise ConfigError(f"config key 'algo.min_noise_std': {c.min_noise_std} is above "
                              f"algo.max_noise_std {c.max_noise_std}")

    def __init__(self, cfg: Config, spec: EnvSpec, device: torch.device):
        super().__init__(cfg, spec, device)
        c: ReinFlowConfig = cfg.algo
        # s: 1, or the release's 1 / ((K + 1) Ta Da)
        self.scale = 1.0 if c.logprob_scale == "joint" else \
            1.0 / ((c.flow_steps + 1) * cfg.env.act_steps * spec.action_dim)
        self.groups = self.assembler = None
        if c.advantage == "group":                    # whole episodes, whole start groups
            self.assembler = EpisodeAssembler(step_keys=("chains", "logp_old", "executed_rows", "start_seed"))
            self.groups = StartGroups(cfg.env.start_group)

    @staticmethod
    def make_policy(cfg: Config, spec: EnvSpec) -> NoisyFlowPolicy:
        return make_noisy_flow_policy(cfg, spec)

    def _load_base(self, state: dict[str, torch.Tensor]) -> None:
        self._policy.load_base(state)                 # the noise network keeps its init

    def _actor_param_groups(self) -> list[dict]:
        # one optimiser for the actor (its grad norm is clipped as one), the velocity and the
        # noise network in two groups with their own learning rates
        c = self.c
        noise_params = list(self._policy.noise.parameters())
        flow_params = [p for n, p in self._policy.named_parameters() if not n.startswith("noise.")]
        return [{"params": flow_params, "lr": c.lr},
                {"params": noise_params, "lr": c.noise_lr if c.noise_lr is not None else c.lr}]

    def _actor_trains(self) -> bool:
        return super()._actor_trains() or self.c.advantage == "group"      # no critic to warm up

    def _learning_rates(self) -> dict[str, float]:
        return {"actor_lr": self.actor_opt.param_groups[0]["lr"], "noise_lr": self.actor_opt.param_groups[1]["lr"],
                "critic_lr": self.critic_opt.param_groups[0]["lr"]}

    # ------------------------------------------------------------------ prepare
    def prepare(self, batches: list[Batch]) -> dict | None:
        c = self.c
        if c.advantage == "group":
            b = self._group_batch(batches)
            if b is None:                              # no start group complete yet
                return None
        else:
            b = advantages_from_rollouts(batches, self.values, c.gamma, c.gae_lambda, c.reward_scale, self.device,
                                         c.bootstrap_truncated)
        self._add_row_mask(b)                                                             # [M, Ta]
        if "logp_old" in b:                            # async: the worker's per-row log-probs
            b["logp_old"] = (b["logp_old"] * b["row_mask"]).sum(-1)                        # [M]
        else:                                          # sync: these weights sampled the batch
            b["logp_old"] = self._old_log_probs(b)                                         # [M]
        return b

    def _group_batch(self, batches: list[Batch]) -> dict | None:
        """advantage group: the steps of the start groups now complete, flat [M], each with its
        episode's group-normalised return (returns / values_old: zeros, no critic)."""
        episodes = self.groups.add(self.assembler.add(batches))
        if not episodes:
            return None
        k = self.cfg.env.start_group
        steps = torch.tensor([len(ep["rewards"]) for ep in episodes], device=self.device)             # H_e [E]
        g = torch.tensor([ep["return"] for ep in episodes], device=self.device) * self.c.reward_scale  # [E]
        adv = group_advantages(g, k).repeat_interleave(steps)                                          # [M]
        tensor = lambda x: torch.as_tensor(x, device=self.device)           # noqa: E731 (uint8 images stay)
        b = {"obs": map_obs(lambda x: tensor(x) if x.dtype == np.uint8 else tensor(x).float(), episode_obs(episodes)),
             "advantages": adv, "returns": torch.zeros_like(adv), "values_old": torch.zeros_like(adv),
             **{key: tensor(np.concatenate([ep[key] for ep in episodes])) for key in ("chains", "logp_old",
                                                                                      "executed_rows")
                if key in episodes[0]}}
        b["chains"] = b["chains"].float()
        mixed = g.view(-1, k).std(1) > 0
        b["group_stats"] = {"reinflow/groups": float(mixed.numel()), "reinflow/groups_mixed": float(mixed.float().mean()),
                            **{f"reinflow/{n}": v for n, v in self.groups.stats.items()}}
        return b

    @torch.no_grad()
    def _old_log_probs(self, b: dict) -> torch.Tensor:
        out = []
        for i in range(0, b["chains"].shape[0], self.c.minibatch_size):
            sl = slice(i, i + self.c.minibatch_size)
            out.append(self._policy.chain_log_prob(map_obs(lambda x: x[sl], b["obs"]), b["chains"][sl],
                                                   b["row_mask"][sl]))
        return torch.cat(out)

    # ------------------------------------------------------------------ update
    def _losses(self, b: dict, idx: torch.Tensor, mb: torch.Tensor, train_actor: bool) -> tuple[torch.Tensor, dict]:
        c = self.c
        obs = map_obs(lambda x: x[idx], b["obs"])
        # advantage group: no critic (its optimiser sees no gradient)
        v_loss = value_loss(self.critic(obs), b["returns"][idx]).mean() if c.advantage == "gae" else \
            torch.zeros((), device=self.device)
        if not train_actor:                            # critic warm-up: the actor is frozen
            return c.vf_coef * v_loss, {"v_loss": v_loss.detach()}
        chains, mask = b["chains"][idx], b["row_mask"][idx]                        # [mb, K+1, Ta, Da], [mb, Ta]
        pi = self._policy
        cond = pi.encoder(obs)                        # encoded once for log-prob, entropy, stats
        logp = chain_log_prob(pi.velocity, pi.log_std, cond, chains, mask, sde_level=pi.sde_level)   # [mb]
        log_ratio = self.scale * (logp - b["logp_old"][idx])                      # [mb]
        ratio = log_ratio.exp()
        adv = b["advantages"][idx]
        adv = normalize(adv, ref=b["advantages"][mb]) if c.normalize_advantages else adv   # the minibatch's statistics
        pg_loss = -ppo_clip_objective(ratio, adv, c.clip).mean()
        entropy = self.scale * chain_entropy(pi.log_std, cond, chains, mask)      # [mb]
        loss = pg_loss - c.ent_coef * entropy.mean() + c.vf_coef * v_loss
        with torch.no_grad():
            log_std = pi.log_std(torch.zeros(len(idx)), cond)                     # sigma at tau = 0
            stats = {"pg_loss": pg_loss.detach(), "v_loss": v_loss.detach(), "entropy": entropy.mean(),
                     "ratio_mean": ratio.mean(), "ratio_std": ratio.std(), "ratio_min": ratio.min(),
                     "ratio_max": ratio.max(), "clipfrac": ((ratio - 1.0).abs() > c.clip).float().mean(),
                     "approx_kl": approx_kl(log_ratio), "noise_std": log_std.exp().mean()}
        return loss, stats

    def update(self, b: dict | None) -> dict[str, float]:
        if b is None:                                  # advantage group: the groups still running
            return {f"reinflow/{n}": v for n, v in self.groups.stats.items()}
        return super().update(b)

    def _finish_metrics(self, out: dict[str, float], b: dict) -> None:
        if self.c.advantage == "group":                # no critic: no explained variance or returns
            for key in ("reinflow/explained_variance", "reinflow/return_mean"):
                out.pop(key)
            out.update(b["group_stats"])

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                **({"assembler": self.assembler.state_dict(), "groups": self.groups.state_dict()}
                   if self.groups is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.groups is not None and "groups" in state:
            self.assembler.load_state_dict(state["assembler"])
            self.groups.load_state_dict(state["groups"])
