"""FED-GRPO (Force and Energy Disentangled GRPO, as used by ELIGN): post-training of an
E(3)-equivariant diffusion model of molecules (EDM) with group-relative, PPO-clipped policy
gradients over its reverse-diffusion transitions, rewarded by a force field.

    generate (learner):  P prompts (a number of atoms n_p drawn from the data histogram), G
                         samples each (rows p*G .. p*G+G-1 form group p). Each reverse step is a
                         Gaussian transition  z_{t-1} ~ N(mu_theta(z_t, t), sigma_t^2 I)  (positions
                         in the zero-CoM subspace); with shared_prefix_steps S the G members share
                         the first S steps, then branch. The K = T - S branched transitions are
                         recorded with their behaviour log-probs logp_old.
    score (workers):     the force field turns each molecule into a force reward r_F (-RMS force)
                         and an energy reward r_E (-formation energy per atom), gated and clipped;
                         EDM's bond perception gives a stability reward r_S (stable-atom fraction
                         minus the per-atom soft valence missing / in excess)
    prepare:             scalar mode
                             a_F = (r_F - mean_g) / (std_g + 1e-8),  a_E, a_S likewise (population std),
                             A   = clip(w_F a_F + w_E a_E + w_S a_S, +-adv_clip_max)   (the same A for all t)
                         where mean_g, std_g of force and energy are the group's RDKit-valid
                         members' (normalize_over: valid) and an invalid member's penalty reward is
                         scored against them (a_F, a_E clipped to +-adv_clip_max first); the
                         summed baseline (advantage_mode: summed) is A = clip(groupnorm(w_F r_F +
                         w_E r_E + w_S r_S))
                         pbrs_return_to_go mode (ELIGN Eq. 4)
                             G_t = gamma^t Psi_0 - Psi_t   at the scheduled steps (Psi_t: energy
                             reward of the clean molecule predicted at step t; Psi_0: the final
                             molecule's), z-scored per step within the group; a_F broadcast over t;
                             A_t = clip(w_F a_F + w_E a^E_t + w_S a_S, +-adv_clip_max)
                         delta mode (ELIGN's per-step traces; force and energy both shaped)
                             D_j = gamma^(s_j - s_j+1) R(s_j+1) - R(s_j) at the scheduled steps,
                             D_m = R_final; per column a^F_j, a^E_j = groupnorm(D^F_j), groupnorm(D^E_j)
                             A_j = clip(w_F a^F_j + w_E a^E_j + w_S a_S (x terminal_weight at j = m)),
                             0 at unscheduled transitions
                         (scheduled steps: algo.shaping's uniform or adaptive scheduler, ELIGN's)
    update:              per transition  rho = exp(logp - logp_old)
                         L_t = mean_rows[ -min(rho A, clip(rho, 1 +- eps) A) ]
                               + beta * mean_rows[ ||mu - mu_ref||^2 / (2 sigma_t^2) ]
                         (mu_ref: the frozen base model's mean at the same z_t); each L_t / K is
                         back-propagated at once (one graph per step), micro-batches of rows
                         accumulate gradients for an optimiser step; grad-norm clip; lr schedule.

ELIGN's names: ``sample_group_size`` is the number of prompts per iteration and
``each_prompt_sample`` the group size G (its QM9 paper config: 4 x 24).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np
import torch

from flowrl_ray.algorithms.advantages import group_center, group_normalize
from flowrl_ray.algorithms.base import GroupAlgorithm
from flowrl_ray.optim import Accumulator, load_scheduler, lr_multiplier, reduce_sum, world
from flowrl_ray.utils import frozen_copy
from flowrl_ray.algorithms.losses import ppo_clip_objective
from flowrl_ray.batch import Batch
from flowrl_ray.config import Config, ConfigError, EDMPretrainConfig, check
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.edm import (EDM, EDMModelConfig, NodeDistribution, check_base_model, check_model_config,
                                   load_base_model, reference_kl, step_log_prob, to_numpy_molecules)

__all__ = ["fed_advantages", "pbrs_returns", "fed_advantages_pbrs", "schedule_steps", "delta_traces",
           "fed_advantages_delta", "summed_advantages", "FEDGRPO", "FEDGRPOConfig"]


@dataclass
class ShapingConfig:
    """``algo.shaping.*``: ELIGN's ``reward.shaping`` and its step scheduler."""
    mode: Literal["none", "pbrs_return_to_go", "delta"] = "none"
    gamma: float = field(default=1.0, metadata=check(ge=0, le=1))
    scheduler: Literal["uniform", "adaptive"] = "uniform"
    stride: int = field(default=1, metadata=check(gt=0))          # uniform: every `stride` recorded steps
    coarse_stride: int = field(default=10, metadata=check(gt=0))  # adaptive: while t > threshold_fraction * T
    fine_stride: int = field(default=2, metadata=check(gt=0))     # adaptive: below it
    threshold_fraction: float = field(default=0.25, metadata=check(ge=0, le=1))
    include_terminal: bool = True                                 # always score the last step (t = 1)
    terminal_weight: float = field(default=1.0, metadata=check(ge=0))   # delta: the final column's weight
    only_energy_reshape: bool = False                             # delta: force terminal-only


@dataclass
class FEDGRPOConfig:
    #: earlier or paper names of keys, accepted and mapped to the one name (config/compat.py)
    ALIASES = {"learning_rate": "lr", "clip_range": "clip", "kl_penalty_weight": "kl_coeff",
               "gradient_accumulation_steps": "grad_accumulation"}
    model: EDMModelConfig = field(default_factory=EDMModelConfig)
    base_model: Optional[str] = None           # `flowrl-ray pretrain` output: start and KL reference
    sample_group_size: int = field(default=4, metadata=check(gt=0))     # prompts per iteration
    each_prompt_sample: int = field(default=24, metadata=check(gt=1))   # G, samples per prompt
    shared_prefix_steps: int = field(default=0, metadata=check(ge=0))
    lr: float = field(default=4e-6, metadata=check(gt=0))
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = field(default=0, metadata=check(ge=0))          # optimiser steps
    min_lr_ratio: float = field(default=0.0, metadata=check(ge=0, le=1))
    weight_decay: float = field(default=0.0, metadata=check(ge=0))
    clip: float = field(default=2e-3, metadata=check(gt=0))
    kl_coeff: float = field(default=0.04, metadata=check(ge=0))
    force_adv_weight: float = field(default=1.0, metadata=check(ge=0))
    energy_adv_weight: float = field(default=0.1, metadata=check(ge=0))
    stability_adv_weight: float = field(default=0.0, metadata=check(ge=0))   # w_S: the stability channel
    adv_clip_max: float = field(default=5.0, metadata=check(gt=0))
    #: "valid": force and energy are normalised over the group's RDKit-valid members, and an
    #: invalid member keeps its penalty, scored against the valid members (then clipped);
    #: "group": over every member (an invalid one's penalty counts in the mean and std)
    normalize_over: Literal["valid", "group"] = "valid"
    #: "separate": each channel normalised on its own, then mixed (FED-GRPO); "summed": one
    #: advantage of the summed reward w_F r_F + w_E r_E + w_S r_S (the plain GRPO baseline)
    advantage_mode: Literal["separate", "summed"] = "separate"
    #: subtract each group's mean advantage (over its scored members) after mixing, then clip:
    #: with normalize_over: valid the penalties leave the mean negative (-3 in a group of 8 with
    #: two valid members), which adds variance and no signal
    zero_mean_groups: bool = False
    train_micro_batch_size: int = field(default=4, metadata=check(gt=0))   # rows per backward
    grad_accumulation: int = field(default=1, metadata=check(gt=0))        # micro-batches per optimiser step
    epochs: int = field(default=1, metadata=check(gt=0))                 # passes over a batch
    max_grad_norm: float = field(default=1.0, metadata=check(gt=0))
    shaping: ShapingConfig = field(default_factory=ShapingConfig)


# ---------------------------------------------------------------------- the math

def fed_advantages(force_rewards: torch.Tensor, energy_rewards: torch.Tensor, group_index: torch.Tensor,
                   force_weight: float, energy_weight: float, adv_clip_max: float,
                   stability_rewards: torch.Tensor | None = None, stability_weight: float = 0.0,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """Scalar-mode FED-GRPO advantages: each signal normalised separately within its group,
    then mixed and clipped. All inputs [B] -> [B]:

        a_F = clip((r_F - mean_g r_F) / (std_g r_F + 1e-8), +-adv_clip_max),   a_E likewise
        a_S = the same for r_S, always over the whole group
        A   = clip(w_F a_F + w_E a_E + w_S a_S, -adv_clip_max, adv_clip_max)

    ``valid`` [B] bool (None: every member): mean_g and std_g of force and energy are the valid
    members' (``normalize_over: valid``); an invalid member's penalty is scored against them, so
    it sits below every valid member (at -adv_clip_max when the penalty is far below them). A group
    with equal rewards contributes zero for that signal; without stability rewards (or w_S = 0)
    this is Elign's two-channel advantage."""
    a = force_weight * _channel(force_rewards, group_index, adv_clip_max, valid) \
        + energy_weight * _channel(energy_rewards, group_index, adv_clip_max, valid)
    return (a + _stability_term(stability_rewards, stability_weight, group_index)).clamp(-adv_clip_max, adv_clip_max)


def summed_advantages(force_rewards: torch.Tensor, energy_rewards: torch.Tensor, group_index: torch.Tensor,
                      force_weight: float, energy_weight: float, adv_clip_max: float,
                      stability_rewards: torch.Tensor | None = None, stability_weight: float = 0.0,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
    """The summed-reward GRPO baseline (``advantage_mode: summed``): one reward, one advantage.
    All inputs [B] -> [B]:

        r = w_F r_F + w_E r_E + w_S r_S,    A = clip(groupnorm(r), +-adv_clip_max)

    (``valid``: the mean and std are the valid members', as in :func:`fed_advantages`)."""
    r = force_weight * force_rewards + energy_weight * energy_rewards
    if stability_rewards is not None and stability_weight:
        r = r + stability_weight * stability_rewards
    return _channel(r, group_index, adv_clip_max, valid)


def _stability_term(stability_rewards: torch.Tensor | None, weight: float, group_index: torch.Tensor
                    ) -> torch.Tensor:
    """w_S a_S [B] (zeros without the channel), over the whole group: stability is scored for
    every molecule, valid or not."""
    if stability_rewards is None or weight == 0:
        return torch.zeros(group_index.shape[0])
    return weight * group_normalize(stability_rewards, group_index)


def _channel(rewards: torch.Tensor, group_index: torch.Tensor, adv_clip_max: float,
             valid: torch.Tensor | None) -> torch.Tensor:
    """One signal's group-relative advantage [B] or [B, K], over the valid members when given,
    clipped (an invalid member scored against a valid group of equal rewards is -inf-like)."""
    return group_normalize(rewards, group_index, members=valid).clamp(-adv_clip_max, adv_clip_max)


def pbrs_returns(potentials: torch.Tensor, final_potential: torch.Tensor, steps: torch.Tensor,
                 scheduled: torch.Tensor, gamma: float) -> torch.Tensor:
    """ELIGN Eq. 4, the energy return-to-go of potential-based reward shaping:

        G_t = gamma^t * Psi_0 - Psi_t    at scheduled steps, 0 elsewhere

    potentials [B, K] (Psi_t of the K recorded transitions; ignored where not scheduled),
    final_potential [B] (Psi_0), steps [K] (the diffusion step t of each transition),
    scheduled [K] bool. Returns [B, K]."""
    discount = torch.pow(torch.full_like(steps, gamma, dtype=potentials.dtype), steps.to(potentials.dtype))
    returns = discount[None, :] * final_potential[:, None] - potentials
    return torch.where(scheduled[None, :], returns, torch.zeros_like(returns))


def fed_advantages_pbrs(force_rewards: torch.Tensor, energy_returns: torch.Tensor, group_index: torch.Tensor,
                        force_weight: float, energy_weight: float, adv_clip_max: float,
                        stability_rewards: torch.Tensor | None = None, stability_weight: float = 0.0,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
    """pbrs_return_to_go mode: force_rewards [B] (terminal), energy_returns [B, K] (G_t),
    stability_rewards [B] (terminal, optional) -> per-transition advantages [B, K]:

        a_F   = groupnorm(r_F)                   broadcast over the K steps (a_S likewise)
        a^E_t = groupnorm(G_t)                   per step t, within the group
        A_t   = clip(w_F a_F + w_E a^E_t + w_S a_S, +-adv_clip_max)

    (``valid``: force and energy over the valid members, as in :func:`fed_advantages`)"""
    a_force = _channel(force_rewards, group_index, adv_clip_max, valid)[:, None]    # [B, 1]
    a_energy = _channel(energy_returns, group_index, adv_clip_max, valid)           # [B, K]
    a_stab = _stability_term(stability_rewards, stability_weight, group_index)[:, None]   # [B, 1]
    return (force_weight * a_force + energy_weight * a_energy + a_stab).clamp(-adv_clip_max, adv_clip_max)


def schedule_steps(recorded: list[int], total_steps: int, scheduler: str = "uniform", stride: int = 1,
                   coarse_stride: int = 10, fine_stride: int = 2, threshold_fraction: float = 0.25,
                   include_terminal: bool = True) -> list[int]:
    """ELIGN's shaping scheduler: which recorded diffusion steps (t, descending) get a predicted
    clean molecule scored. ``uniform``: every ``stride``-th from the first; ``adaptive``: every
    ``coarse_stride``-th while t > threshold_fraction * T, then every ``fine_stride``-th (the
    end of the chain, where the molecule takes shape, is sampled densely). ``include_terminal``
    adds the last recorded step."""
    if scheduler == "uniform":
        out = recorded[::stride]
    elif scheduler == "adaptive":
        out, i = [], 0
        while i < len(recorded):
            out.append(recorded[i])
            i += coarse_stride if recorded[i] > threshold_fraction * total_steps else fine_stride
    else:
        raise ValueError(f"unknown shaping scheduler {scheduler!r}")
    if include_terminal and recorded and out[-1] != recorded[-1]:
        out.append(recorded[-1])
    return out


def delta_traces(values: torch.Tensor, final: torch.Tensor, steps: torch.Tensor, gamma: float) -> torch.Tensor:
    """ELIGN's delta shaping trace of one reward (force or energy) at the m scheduled steps
    s_1 > ... > s_m (values [B, m]: the reward of the clean molecule predicted at s_j; final [B]:
    the final molecule's reward; steps [m]):

        D_j = gamma^(s_j - s_{j+1}) * R(s_{j+1}) - R(s_j)    for j < m   (the improvement step j made)
        D_m = R_final                                                     (the terminal column)

    Returns [B, m]."""
    out = torch.empty_like(values)
    if values.shape[1] > 1:
        gap = (steps[:-1] - steps[1:]).to(values.dtype)                         # [m-1]
        out[:, :-1] = torch.pow(torch.full_like(gap, gamma), gap)[None] * values[:, 1:] - values[:, :-1]
    out[:, -1] = final
    return out


def fed_advantages_delta(force_traces: torch.Tensor, energy_traces: torch.Tensor, group_index: torch.Tensor,
                         force_weight: float, energy_weight: float, adv_clip_max: float, terminal_weight: float,
                         stability_rewards: torch.Tensor | None = None, stability_weight: float = 0.0,
                         valid: torch.Tensor | None = None) -> torch.Tensor:
    """delta mode: per-column advantages [B, m] of the scheduled steps from the force and energy
    traces [B, m] (:func:`delta_traces`; a force trace of zeros but its last column is
    terminal-only):

        a^F_j = groupnorm(D^F_j),  a^E_j = groupnorm(D^E_j)       per column, within the group
        A_j   = w_F a^F_j + w_E a^E_j + w_S a_S    (a_S terminal, on every column)
        A_m  *= terminal_weight;   A = clip(A, +-adv_clip_max)

    (ELIGN also multiplies the terminal reward by terminal_weight before normalising, which the
    normalisation cancels. ``valid``: force and energy over the valid members, as in
    :func:`fed_advantages`.)"""
    a = force_weight * _channel(force_traces, group_index, adv_clip_max, valid) \
        + energy_weight * _channel(energy_traces, group_index, adv_clip_max, valid)   # [B, m]
    a = a + _stability_term(stability_rewards, stability_weight, group_index)[:, None]
    a[:, -1] = a[:, -1] * terminal_weight
    return a.clamp(-adv_clip_max, adv_clip_max)


# ---------------------------------------------------------------------- checkpoints of the base model

# ---------------------------------------------------------------------- the algorithm

class FEDGRPO(GroupAlgorithm):
    config_class = FEDGRPOConfig
    pretrain_config_class = EDMPretrainConfig
    data_parallel = True              # runtime.num_learners > 1: each rank samples and trains whole groups

    @staticmethod
    def validate_config(cfg: Config) -> None:
        c: FEDGRPOConfig = cfg.algo
        if cfg.env.family != "molecules":
            raise ConfigError(f"config key 'env.family': FED-GRPO scores molecules with a force field "
                              f"(family 'molecules'), got {cfg.env.family!r}")
        if cfg.runtime.num_learners > c.sample_group_size:
            raise ConfigError(f"config key 'runtime.num_learners': {cfg.runtime.num_learners} ranks share "
                              f"algo.sample_group_size={c.sample_group_size} groups (a group is never split)")
        check_model_config(c.model)
        if c.shared_prefix_steps >= c.model.diffusion_steps:
            raise ConfigError(f"config key 'algo.shared_prefix_steps': {c.shared_prefix_steps} leaves no "
                              f"branched step of algo.model.diffusion_steps={c.model.diffusion_steps}")
        if c.advantage_mode == "summed" and c.shaping.mode != "none":
            raise ConfigError(f"config key 'algo.advantage_mode': 'summed' is one terminal advantage per "
                              f"molecule; it does not combine with algo.shaping.mode={c.shaping.mode!r}")

    @staticmethod
    def preflight(cfg: Config, spec: EnvSpec) -> None:
        check_base_model(cfg)

    def __init__(self, cfg: Config, spec: EnvSpec, device: torch.device):
        super().__init__(cfg, spec, device)
        self.c: FEDGRPOConfig = cfg.algo
        self.model = EDM(self.c.model).to(device)
        histogram = np.full(self.c.model.max_atoms + 1, 1.0 / self.c.model.max_atoms)
        histogram[0] = 0.0
        if self.c.base_model is not None:
            ckpt = load_base_model(self.c.base_model)
            self.model.load_state_dict(ckpt["state_dict"])
            histogram = np.asarray(ckpt["node_histogram"], dtype=np.float64)
        self.node_distribution = NodeDistribution(histogram)
        self.reference = frozen_copy(self.model)               # the base model, for the KL penalty
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.c.lr,
                                     weight_decay=self.c.weight_decay)
        rows = self.c.sample_group_size * self.c.each_prompt_sample
        steps_per_iter = math.ceil(math.ceil(rows / self.c.train_micro_batch_size)
                                   / self.c.grad_accumulation) * self.c.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lr_multiplier(self.c.lr_schedule, steps_per_iter * cfg.train.iterations,
                                    self.c.warmup_steps, self.c.min_lr_ratio))
        self.generator = torch.Generator().manual_seed(cfg.seed)     # atom counts and diffusion noise
        self.pending: dict = {}
        self.iteration = 0
        self.skipped_updates = 0

    # ------------------------------------------------------------------ generation
    def _shaping_steps(self, recorded_steps: list[int]) -> list[int]:
        sh = self.c.shaping
        if sh.mode == "none":
            return []
        return schedule_steps(recorded_steps, self.c.model.diffusion_steps, sh.scheduler, sh.stride,
                              sh.coarse_stride, sh.fine_stride, sh.threshold_fraction, sh.include_terminal)

    @torch.no_grad()
    def generate(self, num_chunks: int, mode: str = "train") -> list[dict]:
        """Sample this iteration's groups ("train") or the evaluation set ("eval"). In a learner
        group (training) each rank samples the whole groups g = rank, rank + R, ... of the P
        prompts, with its own stream drawn from the shared generator; chunk ids are the rows'
        places in the whole batch [P * G]. Evaluation is sampled by one rank."""
        c = self.c
        rank, ranks = world() if mode == "train" else (0, 1)
        if mode == "eval":
            prompts, group, prefix = self.cfg.eval.episodes, 1, 0
        else:
            prompts, group, prefix = c.sample_group_size, c.each_prompt_sample, c.shared_prefix_steps
        groups = torch.arange(rank, prompts, ranks)                           # [P_r] this rank's groups
        generator = self.generator
        if ranks > 1:       # every rank draws the same seed (the generators stay equal), then its own stream
            seed = int(torch.randint(2 ** 62, (1,), generator=self.generator))
            generator = torch.Generator().manual_seed(seed + rank)
        n_atoms = self.node_distribution.sample(len(groups), generator).repeat_interleave(group)   # [B_r]
        recorded = list(range(c.model.diffusion_steps - prefix, 0, -1))     # t of the branched steps
        x0_steps = self._shaping_steps(recorded) if mode == "train" else []
        self.model.eval()
        result = self.model.sample(n_atoms.to(self.device), generator, group_size=group,
                                   shared_prefix_steps=prefix, x0_steps=x0_steps)
        molecules = to_numpy_molecules(result.positions, result.atom_types, result.node_mask)
        shaping = [[] for _ in molecules]
        for t in x0_steps:
            pos, types = result.x0_predictions[t]
            for i, m in enumerate(to_numpy_molecules(pos, types, result.node_mask)):
                shaping[i].append(m)
        rows = (groups[:, None] * group + torch.arange(group)).flatten()      # [B_r] places in the batch
        self.pending = {"mode": mode, "trajectory": result.trajectory, "n": prompts * group, "rows": rows,
                        "group_index": torch.arange(prompts).repeat_interleave(group),
                        "n_atoms": n_atoms, "x0_steps": x0_steps}
        chunks = []
        for part in np.array_split(np.arange(len(molecules)), num_chunks):
            if len(part):
                chunk = {"ids": rows[part].numpy(), "positions": [molecules[i][0] for i in part],
                         "atom_types": [molecules[i][1] for i in part]}
                if x0_steps:
                    chunk["shaping"] = [shaping[i] for i in part]
                chunks.append(chunk)
        return chunks

    def _scores(self, batches: list[Batch], gen: dict) -> dict[str, Any]:
        """The scorers' outputs for generation ``gen``'s samples, in row order of the whole batch
        (every rank's rows in a learner group; rows a failed worker never scored keep NaN / "")."""
        n = gen["n"]
        numeric = SCORE_KEYS
        out: dict[str, Any] = {k: torch.full((n,), float("nan")) for k in numeric}
        out["smiles"], out["reason"] = [""] * n, ["not_scored"] * n
        k_steps = len(gen["x0_steps"])
        out["shaping_energy_reward"] = torch.full((n, k_steps), float("nan"))
        out["shaping_force_reward"] = torch.full((n, k_steps), float("nan"))
        for b in batches:
            ids = torch.tensor(np.asarray(b["ids"]), dtype=torch.long)      # a copy: Ray hands read-only arrays
            for k in numeric:
                out[k][ids] = torch.tensor(np.asarray(b[k], dtype=np.float32))
            if k_steps:
                for key in ("shaping_energy_reward", "shaping_force_reward"):
                    out[key][ids] = torch.tensor(np.asarray(b[key], dtype=np.float32))
            for j, i in enumerate(ids.tolist()):
                out["smiles"][i], out["reason"][i] = str(b["smiles"][j]), str(b["reason"][j])
        return out

    def prepare(self, batches: list[Batch], generation: dict | None = None) -> dict:
        """Advantages of the scored samples of ``generation`` (what ``generate`` kept for them;
        None: the last generation)."""
        gen = self.pending if generation is None else generation
        c, traj = self.c, gen["trajectory"]
        s = self._scores(batches, gen)
        scored = ~torch.isnan(s["force_reward"])
        # A row nobody scored (its worker died twice) gets the group's mean: advantage 0.
        force = _fill_with_group_mean(s["force_reward"], gen["group_index"])
        energy = _fill_with_group_mean(s["energy_reward"], gen["group_index"])
        stability = _fill_with_group_mean(s["stability_reward"], gen["group_index"])
        group_index = gen["group_index"]
        # normalize_over: valid -> force and energy statistics of each group's scored, valid members
        valid = (scored & (s["valid"] == 1)) if c.normalize_over == "valid" else None
        k = traj["t"].shape[0]
        if c.shaping.mode == "pbrs_return_to_go":
            steps = traj["t"].cpu()
            scheduled = torch.isin(steps, torch.as_tensor(gen["x0_steps"], dtype=steps.dtype))
            potentials = torch.zeros(len(force), k)
            potentials[:, scheduled] = torch.nan_to_num(s["shaping_energy_reward"])
            returns = pbrs_returns(potentials, energy, steps, scheduled, c.shaping.gamma)
            adv = fed_advantages_pbrs(force, returns, group_index, c.force_adv_weight, c.energy_adv_weight,
                                      c.adv_clip_max, stability, c.stability_adv_weight, valid)    # [B, K]
        elif c.shaping.mode == "delta":
            steps = traj["t"].cpu()
            sched = torch.as_tensor(gen["x0_steps"], dtype=steps.dtype)               # [m], descending
            f_ts = delta_traces(torch.nan_to_num(s["shaping_force_reward"]), force, sched, c.shaping.gamma)
            if c.shaping.only_energy_reshape:
                f_ts[:, :-1] = 0.0                                                             # force terminal-only
            e_ts = delta_traces(torch.nan_to_num(s["shaping_energy_reward"]), energy, sched, c.shaping.gamma)
            cols = fed_advantages_delta(f_ts, e_ts, group_index, c.force_adv_weight, c.energy_adv_weight,
                                        c.adv_clip_max, c.shaping.terminal_weight,
                                        stability, c.stability_adv_weight, valid)             # [B, m]
            adv = torch.zeros(len(force), k)
            column = {int(t): j for j, t in enumerate(sched.tolist())}
            for i, t in enumerate(steps.tolist()):                    # unscheduled transitions: 0
                if int(t) in column:
                    adv[:, i] = cols[:, column[int(t)]]
        else:
            terminal = summed_advantages if c.advantage_mode == "summed" else fed_advantages
            adv = terminal(force, energy, group_index, c.force_adv_weight, c.energy_adv_weight,
                           c.adv_clip_max, stability, c.stability_adv_weight, valid)[:, None].expand(-1, k)  # [B, K]
        if c.zero_mean_groups:                  # every group's scored members: mean 0 per transition
            adv = group_center(adv, group_index, members=scored).clamp(-c.adv_clip_max, c.adv_clip_max)
        adv = torch.where(scored[:, None], adv, torch.zeros_like(adv))
        # the whole batch's advantages (every group is whole on its rank); this rank's rows train
        return {"trajectory": traj, "advantages": adv[gen["rows"]].to(self.device), "scores": s,
                "rows": gen["rows"], "n": gen["n"], "all_advantages": adv}

    # ------------------------------------------------------------------ update
    def update(self, p: dict) -> dict[str, float]:
        c, traj, adv = self.c, p["trajectory"], p["advantages"]           # adv [B_r, K] this rank's rows
        z, steps, logp_old = traj["z"], traj["t"], traj["logp"]           # [K+1, B_r, N, D], [K], [K, B_r]
        node_mask, sigma = traj["node_mask"], traj["sigma"]               # [B_r, N], [K]
        k_steps, ranks = adv.shape[1], world()[1]
        # Micro-batches of the whole batch's rows [B]; this rank takes its rows of each (all of
        # them on one learner), weighted by their share, so the ranks' gradients sum to the step
        # one learner takes on the whole micro-batches.
        local = torch.full((p["n"],), -1, dtype=torch.long)
        local[p["rows"]] = torch.arange(len(p["rows"]))                   # batch row -> this rank's row
        micro = [local[i:min(i + c.train_micro_batch_size, p["n"])] for i in range(0, p["n"], c.train_micro_batch_size)]
        stats: dict[str, list[float]] = {}
        self.model.train()
        acc = Accumulator([self.opt], c.max_grad_norm)       # grad_accumulation micro-batches a step
        for _ in range(c.epochs):
            acc.zero_grad()
            for m, batch_rows in enumerate(micro):
                rows, share = batch_rows[batch_rows >= 0], float((batch_rows >= 0).float().mean())
                for j in range(k_steps if len(rows) else 0):
                    t = int(steps[j])
                    logp, mu = step_log_prob(self.model, z[j, rows], z[j + 1, rows], t, node_mask[rows])  # [b], [b, N, D]
                    ratio = torch.exp(logp - logp_old[j, rows])
                    a = adv[rows, j]
                    pg = -ppo_clip_objective(ratio, a, c.clip).mean()
                    loss = pg
                    kl = torch.zeros(())
                    if c.kl_coeff > 0:
                        with torch.no_grad():
                            _, mu_ref = step_log_prob(self.reference, z[j, rows], z[j + 1, rows], t, node_mask[rows])
                        kl = reference_kl(mu, mu_ref, sigma[j], node_mask[rows]).mean()
                        loss = loss + c.kl_coeff * kl
                    # one learner stops the epoch at a non-finite loss; a group's ranks go on to the
                    # step together, which every rank then skips (flowrl_ray.optim)
                    if not acc.backward(loss * share / (c.grad_accumulation * k_steps)) and ranks == 1:
                        break
                    with torch.no_grad():
                        for name, v in (("pg_loss", pg), ("kl", kl), ("ratio_mean", ratio.mean()),
                                        ("ratio_max", ratio.max()), ("ratio_min", ratio.min()),
                                        ("clipfrac", ((ratio - 1).abs() > c.clip).float().mean())):
                            stats.setdefault(name, []).append(float(v) * share)
                if not acc.finite and ranks == 1:
                    break
                if (m + 1) % c.grad_accumulation == 0 or m + 1 == len(micro):
                    self._optimizer_step(acc, stats)
            if not acc.finite:                      # NaN loss: drop this epoch's gradients, count it
                self._optimizer_step(acc, stats)
        if ranks > 1:                               # the whole micro-batches' statistics: the shares' summed
            stats = self._reduce_stats(stats, k_steps * len(micro) * c.epochs)
        self.iteration += 1
        return self._metrics(stats, p)

    def policy_gradients(self, p: dict, advantages: list[torch.Tensor],
                         steps: list[int] | None = None) -> torch.Tensor:
        """The gradient of the update's policy term at the weights that generated (every ratio
        1, so the clip is inactive; no KL: its gradient is 0 at the reference) for each of
        several advantage tensors ``[B_r, K]`` over the same transitions, as ``[V, P]`` float64
        over the model's parameters:

            g_v = (1 / |S|) sum_{j in S} (1 / B_r) sum_i A_v[i, j] grad log p_theta(z_{j+1,i} | z_{j,i})

        ``S``: the transitions ``steps`` (indices into the trajectory's K, default all). The
        direction the update's first step follows before clipping and Adam, one forward pass per
        transition for all V. Diagnostics (two disjoint batches' agreement); weights untouched."""
        traj = p["trajectory"]
        z, t_of, node_mask = traj["z"], traj["t"], traj["node_mask"]     # [K+1, B_r, N, D], [K], [B_r, N]
        steps = list(range(len(t_of))) if steps is None else list(steps)
        adv = torch.stack([a.to(self.device, torch.float64) for a in advantages])      # [V, B_r, K]
        params = [q for q in self.model.parameters() if q.requires_grad]
        total = torch.zeros(len(advantages), sum(q.numel() for q in params), dtype=torch.float64)
        self.model.train()
        for j in steps:
            logp, _ = step_log_prob(self.model, z[j], z[j + 1], int(t_of[j]), node_mask)   # [B_r]
            for v in range(len(advantages)):
                objective = (adv[v, :, j] * logp.double()).mean() / len(steps)
                grads = torch.autograd.grad(objective, params, retain_graph=v + 1 < len(advantages),
                                            allow_unused=True)
                total[v] += torch.cat([(g if g is not None else torch.zeros_like(q)).double().flatten()
                                       for g, q in zip(grads, params)])
        return total

    @staticmethod
    def _reduce_stats(stats: dict[str, list[float]], entries: int) -> dict[str, list[float]]:
        """Each loss statistic's mean over its (micro-batch, step) entries, summed over the ranks
        (a rank without rows in a micro-batch adds nothing to it); grad_norm is every rank's."""
        names = ("pg_loss", "kl", "ratio_mean", "ratio_max", "ratio_min", "clipfrac")
        sums = reduce_sum(torch.tensor([sum(stats.get(k, [])) for k in names], dtype=torch.float64))
        out = {k: [v / entries] for k, v in zip(names, sums.tolist())}
        if "grad_norm" in stats:
            out["grad_norm"] = stats["grad_norm"]
        return out

    def _optimizer_step(self, acc: Accumulator, stats: dict) -> None:
        (norm,), stepped = acc.step()          # one optimiser: one norm; non-finite: skipped
        if stepped:
            self.scheduler.step()
            stats.setdefault("grad_norm", []).append(norm)
        else:
            self.skipped_updates += 1

    def _metrics(self, stats: dict, p: dict) -> dict[str, float]:
        s, adv = p["scores"], p["all_advantages"]
        out = {f"fed_grpo/{k}": float(np.mean(v)) for k, v in stats.items()}
        out.update(molecule_summary(s))
        out.update({"reward_mean": out["force_reward_mean"], "kl": out.get("fed_grpo/kl", float("nan")),
                    "clipfrac": out.get("fed_grpo/clipfrac", float("nan")),
                    "fed_grpo/advantage_mean": float(adv.mean()), "fed_grpo/advantage_std": float(adv.std()),
                    "fed_grpo/advantage_abs_max": float(adv.abs().max()),
                    "fed_grpo/transitions": float(adv.shape[1]), "fed_grpo/lr": self.scheduler.get_last_lr()[0],
                    "fed_grpo/skipped_updates": float(self.skipped_updates)})
        return out

    def eval_metrics(self, batches: list[Batch]) -> dict[str, float]:
        s = self._scores(batches, self.pending)
        out = {f"eval/{k}": v for k, v in molecule_summary(s).items()}
        out.update({"eval/return_mean": out["eval/force_reward_mean"], "eval/episodes": float(self.pending["n"])})
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "scheduler": self.scheduler.state_dict(), "generator": self.generator.get_state(),
                "iteration": self.iteration, "skipped_updates": self.skipped_updates,
                "node_histogram": self.node_distribution.probs.numpy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.resume_notes = tuple(load_scheduler(self.scheduler, state["scheduler"], "fed_grpo lr", "optimiser step"))
        self.generator.set_state(state["generator"])
        self.iteration, self.skipped_updates = state["iteration"], state["skipped_updates"]


# ---------------------------------------------------------------------- helpers

def _fill_with_group_mean(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """NaN entries (unscored rows) replaced by their group's mean of the scored rows (0 if none)."""
    out = values.clone()
    missing = torch.isnan(values)
    for g in torch.unique(group_index[missing]):
        rows = group_index == g
        known = values[rows & ~missing]
        out[rows & missing] = known.mean() if len(known) else 0.0
    return out


#: the per-molecule numbers of a molecule scorer's batch that FED-GRPO reads (float, one per row)
SCORE_KEYS = ("force_reward", "energy_reward", "stability_reward", "energy_eV", "formation_energy_per_atom_eV",
              "rms_force", "stable", "stable_atom_fraction", "valid", "force_gated", "energy_gated",
              "under_bonded", "over_bonded", "overlap")


def scores_of(batch) -> dict:
    """One scorer batch as :func:`molecule_summary` reads it: SCORE_KEYS as float tensors [K],
    ``smiles`` and ``reason`` as lists of str."""
    s = {k: torch.as_tensor(np.asarray(batch[k], dtype=np.float32)) for k in SCORE_KEYS}
    s["smiles"], s["reason"] = [str(x) for x in batch["smiles"]], [str(x) for x in batch["reason"]]
    return s


def molecule_summary(s: dict) -> dict[str, float]:
    """Means over the scored molecules of one batch: each reward channel and its gated fraction,
    energy, RMS force, under- / over-bonded atoms per molecule, the fraction with overlapping
    atoms, stability, validity and uniqueness (EDM's: unique canonical SMILES among the valid)."""
    def mean(x: torch.Tensor) -> float:
        x = x[~torch.isnan(x)]
        return float(x.mean()) if len(x) else float("nan")
    valid = [smi for smi, v in zip(s["smiles"], s["valid"].tolist()) if v == 1 and smi]
    uniqueness = len(set(valid)) / len(valid) if valid else 0.0
    reasons = {}
    for r in s["reason"]:
        reasons[r] = reasons.get(r, 0) + 1
    out = {"force_reward_mean": mean(s["force_reward"]), "energy_reward_mean": mean(s["energy_reward"]),
           "stability_reward_mean": mean(s["stability_reward"]),
           "force_gated_fraction": mean(s["force_gated"]), "energy_gated_fraction": mean(s["energy_gated"]),
           "under_bonded_atoms": mean(s["under_bonded"]), "over_bonded_atoms": mean(s["over_bonded"]),
           "overlap_fraction": mean(s["overlap"]),
           "energy_per_atom_eV": mean(s["formation_energy_per_atom_eV"]), "rms_force_eV_per_A": mean(s["rms_force"]),
           "molecule_stability": mean(s["stable"]), "atom_stability": mean(s["stable_atom_fraction"]),
           "validity": mean(s["valid"]), "uniqueness": uniqueness,
           "valid_and_unique": mean(s["valid"]) * uniqueness if valid else 0.0}
    out.update({f"reason/{k}": float(v) / len(s["reason"]) for k, v in sorted(reasons.items())})
    return out
