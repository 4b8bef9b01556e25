"""Flow-GRPO for a masked-diffusion language model (Liu et al., 2025, adapted to iterative
unmasking as in the ReFusion spec): the model writes browser actions for a form task; the
browser's reward trains it with group-relative, PPO-clipped policy gradients over the steps of
its own generation trajectory.

    generate (learner):  P prompts x G rollouts each (groups are consecutive rows);
                         S unmasking steps; per step s the trajectory keeps the masked state x_s,
                         the newly unmasked positions U_s and their tokens, and the behaviour
                         log-prob  logp_old_s = sum_{j in U_s} log p_theta_old(tok_j | x_s)
                         as the sampler computed it (the update recomputes it, see below, and
                         reports the largest gap as flow_grpo/sampler_logp_gap)
    score (workers):     the completion runs as actions in headless Chromium -> reward r
    prepare:             A = clip((r - mean_g) / (std_g + 1e-8), +-adv_clip_max)
                         (population std over the *valid* members of the group of G; an
                         episode whose browser crashed or timed out is invalid: A = 0, left
                         out of the loss, counted per reason in the metrics)
    update:              the G*P rollouts are split into minibatches of ``minibatch_groups``
                         whole groups (a random partition per update), each with a random
                         subset T of K = ceil(timestep_fraction * S) of its S steps (drawn once
                         per update); for ``epochs`` epochs, each minibatch in a random order
                         takes one optimiser step over its T:
                         per step  rho_s = exp(logp_s - logp_old_s)
                         L = 1/K sum_{s in T} mean_{valid rollouts} [ -min(rho_s A, clip(rho_s, 1 +- eps) A)
                                                                     + kl_coeff * KL_s ]
                         k3(logp, ref) = exp(ref - logp) - (ref - logp) - 1, ref = the frozen SFT model
                         KL_s = k3(logp_s, logp_ref_s)                      (kl_estimator: step, the spec's)
                         KL_s = sum_{j in U_s} k3(logp_j, logp_ref_j)       (kl_estimator: token)
                         gradients accumulated step by step (one graph per step), grad-norm clip,
                         a non-finite loss or gradient skips (and counts) the step.

Step subsampling (Flow-GRPO's ``timestep_fraction``): T is drawn uniformly without replacement,
so the 1/K mean over T is an unbiased estimate of the 1/S mean over all S steps (of the loss and
its gradient) at K/S of the cost; fraction 1 is the full mean. T is kept across the update's
epochs (as Flow-GRPO keeps its training steps across inner epochs): every no-grad pass, old and
reference log-probs, then also shrinks to K/S. The draws (partition, order, T)
come from ``update_generator`` (seed + 1), saved in the state_dict: a resumed run picks the same.

Log-probs of a ratio: at the start of an update the old log-probs (the weights that generated)
are recomputed for every (minibatch, step) the update will use (the first minibatch's from its
own first forward pass, which comes before any step), the reference's on first use (cached for
the later epochs; :class:`~flowrl_ray.models.masked_diffusion.KLReference`: a LoRA model's base
with adapters off, or a frozen copy of its SFT adapter, never a second base), and the new ones in the loss, all with dropout off (:func:`dropout_off`, LoRA dropout included) and the sums
over a step's tokens in float64: every ratio is exactly 1 before the first optimiser step.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from flowrl_ray.algorithms.advantages import group_advantages
from flowrl_ray.algorithms.base import GroupAlgorithm
from flowrl_ray.optim import Accumulator, dropout_off, reduce_max, reduce_sum, world
from flowrl_ray.algorithms.losses import k3, ppo_clip_objective
from flowrl_ray.batch import Batch
from flowrl_ray.config import Config, ConfigError, TextSFTPretrainConfig, check
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.masked_diffusion import MaskedLMConfig

__all__ = ["group_advantages", "k3_kl", "kl_penalty", "line_advantages", "token_lines", "FlowGRPO",
           "FlowGRPOConfig"]
KL_ESTIMATORS = ("step", "token")


@dataclass
class FlowGRPOConfig:
    #: earlier or paper names of keys, accepted and mapped to the one name (config/compat.py)
    ALIASES = {"learning_rate": "lr", "clip_range": "clip", "grad_clip": "max_grad_norm"}
    model: MaskedLMConfig = field(default_factory=MaskedLMConfig)
    sft_checkpoint: Optional[str] = None       # `flowrl-ray pretrain` output: start and KL reference
    prompts_per_iteration: int = field(default=8, metadata=check(gt=0))
    group_size: int = field(default=2, metadata=check(gt=1))
    lr: float = field(default=1e-5, metadata=check(gt=0))
    epochs: int = field(default=2, metadata=check(gt=0))               # passes over each batch (2-4)
    minibatch_groups: Optional[int] = field(default=None, metadata=check(gt=0))   # whole groups per
    #                                          optimiser step; None: all prompts_per_iteration groups
    timestep_fraction: float = field(default=1.0, metadata=check(gt=0, le=1))      # of the unmasking
    #                                          steps in each minibatch's loss (Flow-GRPO's name)
    kl_coeff: float = field(default=0.04, metadata=check(ge=0))
    kl_estimator: str = "step"                 # step: k3 of the step's joint log-ratio (the spec's);
    #                                          token: the sum of the step's per-token k3 (see kl_penalty)
    clip: float = field(default=0.2, metadata=check(gt=0))
    adv_clip_max: float = field(default=5.0, metadata=check(gt=0))
    max_grad_norm: float = field(default=1.0, metadata=check(gt=0))
    num_generation_steps: int = field(default=10, metadata=check(gt=0))
    sampler: str = "gumbel_topk"               # which positions a step unmasks: gumbel_topk |
    #                                          confidence_topk (the ReFusion reference generate)
    generation_temperature: float = field(default=0.7, metadata=check(ge=0))
    gen_length: int = field(default=96, metadata=check(gt=0))         # completion tokens
    max_prompt_len: int = field(default=192, metadata=check(gt=0))
    advantage: str = "sequence"                # sequence: one group advantage per rollout (the
    #                                          spec's); line: each scored line's own (line_advantages)
    ratio: str = "step"                        # step: one ratio per unmasking step (the spec's);
    #                                          token: one per unmasked token, each clipped (line needs it)
    step_minibatches: int = field(default=1, metadata=check(gt=0))  # each minibatch's steps split
    #                                          into this many random parts per epoch (at most one per step),
    #                                          one optimiser step each
    advantage_shuffle: bool = False            # the no-signal control: outcomes permuted within each group
    eval_sampled: bool = False                 # evaluation also samples at generation_temperature
    #                                          (eval/sampled/*, the same noise for every policy)


#: the seed of the noise of sampled evaluations (eval_sampled): every policy sees the same draws
EVAL_NOISE_SEED = 20_251_128
ADVANTAGES = ("sequence", "line")
RATIOS = ("step", "token")


def line_advantages(seq_adv: torch.Tensor, slot_right: torch.Tensor, token_slot: torch.Tensor,
                    group_size: int, adv_clip_max: float | None, valid: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Per-token advantages from line-level outcomes (``advantage: line``).

    seq_adv [N] (the rollouts' group advantages), slot_right [N, C] float (1 where rollout n's
    script writes slot c's gold action: a scored line, :mod:`flowrl_ray.envs.forms.credit`),
    token_slot [N, Lg] long (the slot of the line each completion token lies on, -1: none),
    groups of ``group_size`` consecutive rows (one task each, so column c is the same slot in a
    group) -> [N, Lg] float:

        A_nc = clip((y_nc - mean_g y_c) / (std_g y_c + 1e-8), +-adv_clip_max)   per slot, as GRPO per rollout
        A_nj = A_{n, slot(j)}   on a line that addresses a slot
             = seq_adv_n        elsewhere (lines that address none, newlines, the [EOS] padding)

    A slot every valid member of a group writes right (or wrong) gets 0: no contrast, no credit.
    """
    slot_adv = group_advantages(slot_right, group_size, adv_clip_max, valid=valid)   # [N, C]
    on_slot = token_slot >= 0
    per_token = slot_adv.gather(1, token_slot.clamp(min=0)) if slot_adv.shape[1] else torch.zeros_like(
        token_slot, dtype=slot_adv.dtype)
    return torch.where(on_slot, per_token, seq_adv[:, None].to(slot_adv.dtype))


def token_lines(completion: torch.Tensor, newlines: torch.Tensor, stop: torch.Tensor) -> torch.Tensor:
    """The line of each completion token: completion [N, Lg] long token ids, newlines [V] long
    (how many ``"\n"`` each token id decodes to), stop [V] bool (ids that end the text: [EOS],
    [PAD]) -> [N, Lg] long, the number of newlines before the token (its 0-based line in
    ``text.split("\n")``), -1 from the first stop token on (not part of the decoded text)."""
    before = newlines[completion].cumsum(-1) - newlines[completion]          # newlines before j
    ended = stop[completion].long().cumsum(-1) > 0
    return torch.where(ended, torch.full_like(before, -1), before)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) from samples of pi, elementwise:
    ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, exactly 0 where the two agree)."""
    return k3(ref_logp - logp)


def kl_penalty(token_logp: torch.Tensor, ref_token_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL(pi || ref) of one unmasking step per rollout, from the log-probs of the step's sampled
    tokens (token_logp, ref_token_logp [B, L], 0 off the step's positions) -> [B]:

        step:   k3(sum_j logp_j, sum_j ref_j)        the spec's: k3 of the joint log-ratio
        token:  sum_j k3(logp_j, ref_j)              per token, as GRPO and d1 penalise

    The step's tokens are drawn independently given the state, so its KL is the sum of the
    per-token KLs and both are unbiased estimates of it. The joint one exponentiates the sum of
    the log-ratios: with d_j = 2 nats on each of 5 tokens it is e^10 - 11 = 22,015 where the
    per-token sum is 5 (e^2 - 3) = 21.9."""
    if estimator == "step":
        return k3_kl(token_logp.sum(-1), ref_token_logp.sum(-1))
    if estimator == "token":
        return k3_kl(token_logp, ref_token_logp).sum(-1)     # 0 off the step: k3(0, 0) = 0
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def warn_if_cut(lm, tasks: list, catalog, max_prompt_len: int, gen_length: int, name: str) -> tuple[int, int]:
    """Warn when prompts are longer than ``max_prompt_len`` tokens (their end, the instruction's
    values, is cut off) or gold action scripts do not fit ``gen_length`` with their [EOS]:
    such a task cannot be solved, whatever the model. -> (prompts cut, answers cut)."""
    from flowrl_ray.envs.forms import gold_actions, prompt_text
    tok = lm.tokenizer
    prompts = sum(len(tok(prompt_text(t, catalog))["input_ids"]) > max_prompt_len for t in tasks)
    answers = sum(len(tok(gold_actions(t, catalog), add_special_tokens=False)["input_ids"]) >= gen_length
                  for t in tasks)
    if prompts or answers:
        warnings.warn(f"{prompts} of {len(tasks)} {name} prompts are longer than algo.max_prompt_len "
                      f"({max_prompt_len} tokens) and {answers} gold action scripts do not fit "
                      f"algo.gen_length ({gen_length}); those tasks cannot be solved: raise the lengths "
                      f"(and algo.model.max_len)", stacklevel=2)
    return prompts, answers


@dataclass
class _Update:
    """What one update carries between its parts (:meth:`FlowGRPO.update`)."""
    adv: torch.Tensor                 # [B] the whole batch's group advantages
    valid: torch.Tensor               # [B] bool
    unmasked: torch.Tensor            # [S, B_r, L] this rank's rows: the tokens each step unmasked
    token_adv: torch.Tensor | None    # [B_r, L] per-token advantages (advantage: line)
    epochs: list                      # per epoch: [(minibatch, picked steps)], one optimiser step each
    owned: list                       # per minibatch: the batch rows this rank holds
    minibatches: list                 # per minibatch: their rows in this rank's trajectory
    counts: torch.Tensor              # [n_mb, S] valid rows unmasking at each step, over every rank
    old: dict = field(default_factory=dict)      # (minibatch, step) -> old token log-probs [mb, L]
    ref: dict = field(default_factory=dict)      # (minibatch, step) -> reference token log-probs
    ratios: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    sampler_gap: float = 0.0          # |recomputed - sampler's| old log-prob: numerics only
    old_s: float = 0.0
    reference_s: float = 0.0


class FlowGRPO(GroupAlgorithm):
    config_class = FlowGRPOConfig
    pretrain_config_class = TextSFTPretrainConfig
    data_parallel = True              # runtime.num_learners > 1: each rank samples and trains whole groups

    @staticmethod
    def validate_config(cfg: Config) -> None:
        c: FlowGRPOConfig = cfg.algo
        if cfg.env.family != "forms":
            raise ConfigError(f"config key 'env.family': Flow-GRPO scores generated text in the browser "
                              f"(family 'forms'), got {cfg.env.family!r}")
        if c.model.max_len < c.max_prompt_len + c.gen_length:
            raise ConfigError(f"config key 'algo.model.max_len': {c.model.max_len} is shorter than "
                              f"algo.max_prompt_len + algo.gen_length ({c.max_prompt_len + c.gen_length})")
        if c.minibatch_groups is not None and c.prompts_per_iteration % c.minibatch_groups:
            raise ConfigError(f"config key 'algo.minibatch_groups': {c.minibatch_groups} groups per minibatch "
                              f"must divide algo.prompts_per_iteration ({c.prompts_per_iteration} groups per "
                              f"iteration)" + (" (it is larger)" if c.minibatch_groups > c.prompts_per_iteration else ""))
        from flowrl_ray.models.masked_diffusion import SAMPLERS
        if c.sampler not in SAMPLERS:
            raise ConfigError(f"config key 'algo.sampler': {c.sampler!r} is not one of {', '.join(SAMPLERS)}")
        if c.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"config key 'algo.kl_estimator': {c.kl_estimator!r} is not one of "
                              f"{', '.join(KL_ESTIMATORS)}")
        if cfg.runtime.num_learners > c.prompts_per_iteration:
            raise ConfigError(f"config key 'runtime.num_learners': {cfg.runtime.num_learners} ranks share "
                              f"algo.prompts_per_iteration={c.prompts_per_iteration} groups (a group is never split)")
        if c.advantage not in ADVANTAGES:
            raise ConfigError(f"config key 'algo.advantage': {c.advantage!r} is not one of {', '.join(ADVANTAGES)}")
        if c.ratio not in RATIOS:
            raise ConfigError(f"config key 'algo.ratio': {c.ratio!r} is not one of {', '.join(RATIOS)}")
        if c.advantage == "line" and c.ratio != "token":
            raise ConfigError("config key 'algo.ratio': advantage 'line' gives the tokens of one unmasking "
                              "step different advantages, so each token needs its own ratio: set ratio: token")
        if c.num_generation_steps > c.gen_length:
            raise ConfigError(f"config key 'algo.num_generation_steps': {c.num_generation_steps} steps "
                              f"for {c.gen_length} tokens (algo.gen_length)")

    @staticmethod
    def preflight(cfg: Config, spec: EnvSpec) -> None:
        from flowrl_ray.models.masked_diffusion import check_model_config
        check_model_config(model_config(cfg), cfg.algo.sft_checkpoint)

    def __init__(self, cfg: Config, spec: EnvSpec, device: torch.device):
        super().__init__(cfg, spec, device)
        from flowrl_ray.envs.forms import FormCatalog, FormsSettings, evaluation_tasks, load_tasks
        self.c: FlowGRPOConfig = cfg.algo
        from flowrl_ray.models.masked_diffusion import KLReference
        self.lm = load_policy_lm(cfg, device)                          # theta (trainable)
        # pi_ref of k3, the SFT model: a LoRA model's base with adapters off (or a frozen copy
        # of its SFT adapter), never a second copy of an 8B base
        self.reference = KLReference(self.lm.model) if self.c.kl_coeff > 0 else None
        params = [p for p in self.lm.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=self.c.lr, weight_decay=0.0)
        forms = FormsSettings.from_env_cfg(cfg.env)
        self.catalog = FormCatalog.load(forms.forms_dir)
        # the RL prompts: a task file's tasks (env.kwargs.task_file) or the config's split
        self.train_tasks = forms.file_tasks(self.catalog) or load_tasks(cfg.env.id, seed=forms.task_seed,
                                                                        catalog=self.catalog)
        heldout = load_tasks("heldout", seed=forms.task_seed, catalog=self.catalog)
        # eval.episodes tasks spread evenly over the held-out values and the held-out forms
        self.eval_tasks = evaluation_tasks(cfg.eval.episodes, seed=forms.task_seed, catalog=self.catalog)
        for name, tasks in (("training", self.train_tasks), ("held-out", heldout)):
            warn_if_cut(self.lm, tasks, self.catalog, self.c.max_prompt_len, self.c.gen_length, name)
        self.generator = torch.Generator().manual_seed(cfg.seed)       # prompts and sampling
        # minibatch partition and order, step subsets: apart from sampling, so that changing
        # epochs / timestep_fraction leaves the generated episodes as they were
        self.update_generator = torch.Generator().manual_seed(cfg.seed + 1)
        # what a token id decodes to, for the line of each token (advantage: line)
        tok = self.lm.tokenizer
        vocab = self.lm.model.get_input_embeddings().weight.shape[0]
        self._newlines = torch.tensor([tok.decode([i], skip_special_tokens=True).count("\n")
                                       for i in range(vocab)])                        # [V]
        self._stop = torch.zeros(vocab, dtype=torch.bool)                             # [V] ends the text
        for i in (self.lm.eos_token_id, self.lm.pad_token_id):
            if i is not None:
                self._stop[i] = True
        self.pending: dict = {}
        self.iteration = 0
        self.skipped_updates = 0

    # ------------------------------------------------------------------ generation
    def _draw_tasks(self, mode: str) -> list:
        if mode == "eval":
            return self.eval_tasks[: self.cfg.eval.episodes]
        idx = torch.randint(len(self.train_tasks), (self.c.prompts_per_iteration,), generator=self.generator)
        return [self.train_tasks[i] for i in idx.tolist()]

    @torch.no_grad()
    def generate(self, num_chunks: int, mode: str = "train", tasks: list | None = None) -> list[dict]:
        """Sample this iteration's groups ("train") or the evaluation set ("eval"). In a learner
        group (training) every rank draws the same P prompts and samples the whole groups
        g = rank, rank + R, ... of them, with its own stream drawn from the shared generator;
        chunk ids are the rows' places in the whole batch [P * G]. Evaluation is one rank's:
        greedy, and with ``eval_sampled`` the same tasks again at ``generation_temperature``
        (rows n..2n-1) with noise from a fixed seed, the same for every policy. ``tasks``: these
        prompts instead of the drawn ones (diagnostics)."""
        from flowrl_ray.models.masked_diffusion import generate, generate_with_trajectory
        from flowrl_ray.envs.forms import prompt_text
        c, t0 = self.c, time.perf_counter()
        rank, ranks = world() if mode == "train" else (0, 1)
        tasks = self._draw_tasks(mode) if tasks is None else list(tasks)
        group = 1 if mode == "eval" else c.group_size
        groups = torch.arange(rank, len(tasks), ranks)                         # [P_r] this rank's groups
        rows = [tasks[g] for g in groups.tolist() for _ in range(group)]      # [P_r*G], groups consecutive
        generator = self.generator
        if ranks > 1:       # every rank draws the same seed (the generators stay equal), then its own stream
            seed = int(torch.randint(2 ** 62, (1,), generator=self.generator))
            generator = torch.Generator().manual_seed(seed + rank)
        prompt_ids, prompt_mask = self.lm.encode_prompts([prompt_text(t, self.catalog) for t in rows],
                                                          c.max_prompt_len)
        ids, mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        self.lm.model.eval()
        sampled = [False] * len(rows)
        if mode == "eval":
            sequences = generate(self.lm.model, ids, mask, c.gen_length, c.num_generation_steps, 0.0,
                                 self.lm.mask_token_id, None, sampler=c.sampler)
            texts, traj = self.lm.decode(sequences, prompt_ids.shape[1]), None
            if c.eval_sampled:
                noise = torch.Generator().manual_seed(EVAL_NOISE_SEED)
                sequences = generate(self.lm.model, ids, mask, c.gen_length, c.num_generation_steps,
                                     c.generation_temperature, self.lm.mask_token_id, noise, sampler=c.sampler)
                texts += self.lm.decode(sequences, prompt_ids.shape[1])
                rows, sampled = rows + rows, sampled + [True] * len(rows)
        else:
            sequences, traj = generate_with_trajectory(
                self.lm.model, ids, mask, c.gen_length, c.num_generation_steps, c.generation_temperature,
                self.lm.mask_token_id, generator, sampler=c.sampler)
            texts = self.lm.decode(sequences, prompt_ids.shape[1])
        batch_rows = (groups[:, None] * group + torch.arange(group)).flatten()   # [P_r*G] places in the batch
        if mode == "eval":
            batch_rows = torch.arange(len(rows))
        self.pending = {"mode": mode, "trajectory": traj, "n": len(tasks) * group * (1 + any(sampled)),
                        "rows": batch_rows, "texts": texts, "tasks": rows, "splits": [t.split for t in rows],
                        "sampled": sampled, "generate_s": time.perf_counter() - t0}
        return [{"ids": batch_rows[part].numpy(), "task_ids": [rows[i].task_id for i in part],
                 "texts": [texts[i] for i in part]}
                for part in np.array_split(np.arange(len(rows)), num_chunks) if len(part)]

    def _rewards(self, batches: list[Batch], gen: dict) -> dict[str, torch.Tensor]:
        """The scores of generation ``gen``'s samples, by their ids in the batch."""
        n = gen["n"]
        keys = ("rewards", "task_completion", "field_accuracy", "execution_completeness", "unparseable_lines")
        out = {k: torch.zeros(n) for k in keys}
        out["valid"] = torch.ones(n, dtype=torch.bool)
        reasons = [""] * n
        for b in batches:
            ids = torch.as_tensor(np.array(b["ids"]), dtype=torch.long)
            for k in keys:
                out[k][ids] = torch.tensor(np.asarray(b[k], dtype=np.float32))    # a copy: Ray arrays are read-only
            if "valid" in b.data:
                out["valid"][ids] = torch.tensor(np.asarray(b["valid"], dtype=bool))
            if "reason" in b.data:
                for i, r in zip(ids.tolist(), b["reason"]):
                    reasons[i] = str(r)
        out["reasons"] = reasons
        return out

    def prepare(self, batches: list[Batch], generation: dict | None = None) -> dict:
        """Advantages of the scored batch: the rollouts' group advantages [N] (the whole batch:
        every group is whole on its rank) and, for ``advantage: line``, per completion token of
        this rank's rows [B_r, Lg] (:func:`line_advantages`). ``advantage_shuffle``: first the
        outcomes (reward and scored lines) are permuted among the valid members of each group,
        so every rollout keeps its tokens but is credited with a peer's outcome. ``generation``:
        what ``generate`` kept for these samples (None: the last generation)."""
        c, gen = self.c, self.pending if generation is None else generation
        scores = self._rewards(batches, gen)
        rewards, valid, rows = scores["rewards"], scores["valid"], gen["rows"]
        slot_right = token_slot = None
        if c.advantage == "line":
            slot_right, token_slot = self._line_outcomes(gen)                 # [B_r, C], [B_r, Lg]
        if c.advantage_shuffle:
            perm = self._within_group_permutation(valid)                       # [N] batch rows
            rewards = rewards[perm]
            if slot_right is not None:
                place = torch.full((len(rewards),), -1, dtype=torch.long)
                place[rows] = torch.arange(len(rows))
                slot_right = slot_right[place[perm[rows]]]                     # a peer's, same group
        adv = group_advantages(rewards, c.group_size, c.adv_clip_max, valid=valid)           # [P*G]
        token_adv = None
        if slot_right is not None:
            token_adv = line_advantages(adv[rows], slot_right, token_slot, c.group_size, c.adv_clip_max,
                                        valid=valid[rows]).to(self.device)
        # the whole batch's advantages and scores (every group is whole on its rank); the
        # trajectory is this rank's rows (``rows``: their places in the batch)
        return {"trajectory": gen["trajectory"], "advantages": adv.to(self.device),
                "token_advantages": token_adv, "rows": rows, "generate_s": gen["generate_s"], **scores}

    def _line_outcomes(self, gen: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows' scored lines (:mod:`flowrl_ray.envs.forms.credit`): slot_right
        [B_r, C] float (1: the script writes slot c's gold action; C: the most slots of a task)
        and token_slot [B_r, Lg] long (the slot of each completion token's line, -1: none)."""
        from flowrl_ray.envs.forms.credit import gold_slots, line_outcomes
        traj, tasks, texts = gen["trajectory"], gen["tasks"], gen["texts"]
        completion = traj["tokens"][-1][:, traj["prompt_len"]:].cpu()                   # [B_r, Lg]
        lines = token_lines(completion, self._newlines, self._stop)                     # [B_r, Lg]
        keys = [[s.key for s in gold_slots(t, self.catalog)] for t in tasks]
        slot_right = torch.zeros(len(tasks), max(map(len, keys)))
        token_slot = torch.full_like(completion, -1)
        for k, (task, text) in enumerate(zip(tasks, texts)):
            column = {key: i for i, key in enumerate(keys[k])}
            outcomes = line_outcomes(task, text, self.catalog)
            line_slot = torch.tensor([column[o.slot] if o.slot else -1 for o in outcomes])   # per line
            for o in outcomes:
                if o.right:
                    slot_right[k, column[o.slot]] = 1.0
            on = lines[k] >= 0
            token_slot[k, on] = line_slot[lines[k, on]]
        return slot_right, token_slot

    def _within_group_permutation(self, valid: torch.Tensor) -> torch.Tensor:
        """A random permutation [N] of the batch rows that moves each valid row to another valid
        row of its group (invalid rows stay), drawn from ``update_generator``."""
        perm = torch.arange(len(valid))
        for start in range(0, len(valid), self.c.group_size):
            members = torch.arange(start, start + self.c.group_size)[valid[start:start + self.c.group_size]]
            perm[members] = members[torch.randperm(len(members), generator=self.update_generator)]
        return perm

    # ------------------------------------------------------------------ update
    def _update_plan(self, groups: int, steps: int) -> tuple[list[torch.Tensor], list[list[tuple[int, list[int]]]]]:
        """The update's random draws, all from ``update_generator``: the minibatches (whole groups,
        a random partition), each minibatch's K steps (drawn once, kept by every epoch) and, per
        epoch, the minibatch order with each minibatch's K steps split at random into
        ``step_minibatches`` parts. -> (rows of each minibatch [G * minibatch_groups] long, per
        epoch [(minibatch, steps of one optimiser step)])."""
        c, g = self.c, self.update_generator
        per = c.minibatch_groups or groups
        if groups % per:
            raise ValueError(f"algo.minibatch_groups={per} does not divide the {groups} groups of this batch")
        order = torch.randperm(groups, generator=g)
        minibatches = [(order[i:i + per, None] * c.group_size + torch.arange(c.group_size)).flatten()
                       for i in range(0, groups, per)]
        k = math.ceil(c.timestep_fraction * steps)
        # each minibatch's K steps are drawn once per update and kept by every epoch: the
        # reference and old log-probs of a step are then computed once (the first epoch's own
        # forward pass gives the old ones), so the whole update costs K/S of the full one
        picked = [torch.randperm(steps, generator=g)[:k] for _ in minibatches]
        parts = min(c.step_minibatches, k)
        epochs = []
        for _ in range(c.epochs):
            plan = []
            for m in torch.randperm(len(minibatches), generator=g).tolist():
                if parts == 1:                 # (no draw: the plan of an update without parts)
                    plan.append((m, sorted(picked[m].tolist())))
                    continue
                shuffled = picked[m][torch.randperm(k, generator=g)]
                plan += [(m, sorted(part.tolist())) for part in shuffled.tensor_split(parts)]
            epochs.append(plan)
        return minibatches, epochs

    def _token_log_probs(self, model: torch.nn.Module, traj: dict, s: int, rows: torch.Tensor) -> torch.Tensor:
        """log pi of each token step s unmasked in ``rows`` under ``model`` (float64
        [len(rows), L], 0 elsewhere; their sum is log pi(step s)), dropout off."""
        from flowrl_ray.models.masked_diffusion import step_token_log_probs64
        temp = self.c.generation_temperature or 1.0
        with dropout_off(model):
            return step_token_log_probs64(model, traj["states"][s][rows], traj["attention_mask"][rows],
                                          traj["unmasked"][s][rows], traj["tokens"][s][rows], temp)

    @torch.no_grad()
    def _reference_log_probs(self, traj: dict, s: int, rows: torch.Tensor) -> torch.Tensor:
        """The KL reference's :meth:`_token_log_probs` (float64 [len(rows), L])."""
        with self.reference.model() as ref:
            return self._token_log_probs(ref, traj, s, rows)

    def _surrogate(self, token_logp: torch.Tensor, old: torch.Tensor, on: torch.Tensor, adv: torch.Tensor,
                   token_adv: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The clipped surrogate of one step for a minibatch's rows, to minimise, per row [mb]:

            ratio: step    rho = exp(sum_j logp_j - sum_j old_j),  pg = -min(rho A, clip(rho) A)
            ratio: token   rho_j = exp(logp_j - old_j),  pg = -sum_{j in U_s} min(rho_j A_j, clip(rho_j) A_j)

        token_logp, old [mb, L] float64 (0 off the step's positions ``on`` [mb, L]); adv [mb]
        (the rollouts'); token_adv [mb, L] or None (then A_j = A of the row). At rho = 1 both
        have the gradient sum_j A_j grad logp_j. -> (pg [mb], the ratios [mb] or [mb, L] (1 off
        the step), k3 of old -> new per row [mb], clipped ratios per row [mb]: the fraction)."""
        c = self.c
        if c.ratio == "step":
            log_ratio = token_logp.sum(-1) - old.sum(-1)                                # [mb]
            ratio = torch.exp(log_ratio)
            pg = -ppo_clip_objective(ratio, adv, c.clip)
            return pg, ratio, k3(log_ratio), ((ratio - 1).abs() > c.clip).double()
        a = token_adv if token_adv is not None else adv[:, None].expand_as(token_logp)
        log_ratio = torch.where(on, token_logp - old, 0.0)                              # [mb, L]
        ratio = torch.exp(log_ratio)
        pg = -(ppo_clip_objective(ratio, a, c.clip) * on).sum(-1)
        clipped = (((ratio - 1).abs() > c.clip) & on).double().sum(-1) / on.sum(-1).clamp(min=1)
        return pg, ratio, (k3(log_ratio) * on).sum(-1), clipped

    def update(self, p: dict) -> dict[str, float]:
        """Epochs of optimiser steps over the plan's minibatches (:meth:`_update_plan`): each step
        is the mean over its minibatch's valid rows and picked unmasking steps of the surrogate
        plus ``kl_coeff`` times the KL to the reference (module docstring)."""
        t0 = time.perf_counter()
        u = self._layout(p)
        model = self.lm.model
        model.train()
        self._old_log_probs(model, p["trajectory"], u)
        u.old_s = time.perf_counter() - t0
        acc = Accumulator([self.opt], self.c.max_grad_norm)       # one optimiser step per plan entry
        acc.zero_grad()
        for plan in u.epochs:
            for mb, picked in plan:
                self._minibatch_step(model, p["trajectory"], u, acc, mb, picked, first_epoch=plan is u.epochs[0])
        self.iteration += 1
        return self._update_metrics(p, u, t0)

    def _layout(self, p: dict) -> "_Update":
        """The update's minibatches of this rank's rows, their advantages and the row counts of
        each (minibatch, step) over every rank (a step's loss is the mean over them)."""
        c = self.c
        adv = p["advantages"].double()                                        # [B] the whole batch
        batch = adv.shape[0]
        valid = p.get("valid", torch.ones(batch, dtype=torch.bool)).to(adv.device)
        unmasked = p["trajectory"]["unmasked"]                                 # [S, B_r, L] this rank's rows
        token_adv = p.get("token_advantages")                                  # [B_r, Lg] or None
        if token_adv is not None:                                             # at the sequence's places
            token_adv = F.pad(token_adv.double(), (unmasked.shape[2] - token_adv.shape[1], 0))   # [B_r, L]
        plan_rows, epochs = self._update_plan(batch // c.group_size, unmasked.shape[0])   # minibatches of batch rows
        # In a learner group each rank takes its rows of every minibatch (all of them on one
        # learner): ``minibatches`` are its trajectory's rows, ``owned`` the batch rows they are.
        place = torch.full((batch,), -1, dtype=torch.long)
        place[p.get("rows", torch.arange(batch))] = torch.arange(unmasked.shape[1])
        owned = [r[place[r] >= 0] for r in plan_rows]
        minibatches = [place[r] for r in owned]
        # rows that unmasked at step s (valid ones) per minibatch, over every rank
        counts = reduce_sum(torch.stack([(unmasked[:, r].any(-1) & valid[o]).double().sum(-1)
                                         for r, o in zip(minibatches, owned)]))            # [n_mb, S]
        return _Update(adv, valid, unmasked, token_adv, epochs, owned, minibatches, counts)

    @torch.no_grad()
    def _old_log_probs(self, model, traj: dict, u: "_Update") -> None:
        """Old log-probs (per token) of every (minibatch, step) the update uses, computed before
        any step on exactly the rows the loss will see (so rho = 1 holds to the last bit). The
        first optimiser step of the first epoch comes before any step: its own forward pass gives them."""
        first_mb, first_steps = u.epochs[0][0]
        for key in sorted({(m, s) for plan in u.epochs for m, ss in plan for s in ss}):
            if (key[0] != first_mb or key[1] not in first_steps) and len(u.minibatches[key[0]]):
                u.old[key] = self._token_log_probs(model, traj, key[1], u.minibatches[key[0]])

    def _minibatch_step(self, model, traj: dict, u: "_Update", acc: Accumulator, mb: int, picked: list[int],
                        first_epoch: bool) -> None:
        """One optimiser step on minibatch ``mb``: the gradients of its ``picked`` steps, each
        weighted by 1 / (its valid unmasking rows) / (the steps picked), accumulated then applied."""
        c, rows = self.c, u.minibatches[mb]
        a, keep = u.adv[u.owned[mb]], u.valid[u.owned[mb]]
        total = 0.0
        for s in picked:
            if u.counts[mb, s] == 0 or not len(rows):          # a rank without rows here: its share is 0
                continue
            on = u.unmasked[s][rows]                                                  # [mb, L] this step's tokens
            weight = (on.any(-1) & keep).double()                                     # valid rows that unmasked at s
            weight = weight / u.counts[mb, s] / len(picked)                           # mean over rows and steps
            if c.kl_coeff > 0 and (mb, s) not in u.ref:             # before the graph is built:
                t_ref = time.perf_counter()
                u.ref[mb, s] = self._reference_log_probs(traj, s, rows)      # (adapters switch)
                u.reference_s += time.perf_counter() - t_ref
            token_logp = self._token_log_probs(model, traj, s, rows)         # [mb, L] with gradients
            if (mb, s) not in u.old:                                          # no step taken yet
                u.old[mb, s] = token_logp.detach()
            if first_epoch:
                gap = (u.old[mb, s].sum(-1) - traj["logp"][s][rows].double()).abs()[on.any(-1)]
                u.sampler_gap = max(u.sampler_gap, float(gap.max()) if gap.numel() else 0.0)
            pg, ratio, approx, clipped = self._surrogate(
                token_logp, u.old[mb, s], on, a, None if u.token_adv is None else u.token_adv[rows])
            kl = kl_penalty(token_logp, u.ref[mb, s], c.kl_estimator) if c.kl_coeff > 0 else torch.zeros_like(pg)
            loss = ((pg + c.kl_coeff * kl) * weight).sum()
            if not acc.backward(loss):                          # non-finite: the step is skipped
                break
            total += float(loss.detach())
            with torch.no_grad():
                w = weight * len(picked)
                u.ratios.append(ratio.detach()[on & (w > 0)[:, None]] if ratio.ndim == 2 else ratio.detach()[w > 0])
                for k, v in {"pg_loss": (pg * w).sum(), "kl": (kl * w).sum(), "approx_kl": (approx * w).sum(),
                             "clipfrac": (clipped * w).sum()}.items():
                    u.stats.setdefault(k, []).append(float(v))
        finite_loss = acc.finite
        if not finite_loss:
            with torch.no_grad():                  # still before any step: the old log-probs it left out
                for key in [(mb, t) for t in picked if (mb, t) not in u.old and first_epoch]:
                    u.old[key] = self._token_log_probs(model, traj, key[1], rows)
        (norm,), stepped = acc.step()                                   # one optimiser: one norm
        self.skipped_updates += not stepped
        if stepped:
            u.stats.setdefault("grad_norm", []).append(norm)
        if finite_loss:
            u.stats.setdefault("loss", []).append(total)

    def _update_metrics(self, p: dict, u: "_Update", t0: float) -> dict[str, float]:
        stats, ratios, sampler_gap, epochs = u.stats, u.ratios, u.sampler_gap, u.epochs
        if world()[1] > 1:                             # the whole minibatches' statistics, over the ranks
            entries = sum(int(u.counts[m, t] > 0) for plan in epochs for m, ss in plan for t in ss)
            stats, sampler_gap = self._reduce_stats(stats, entries, sum(len(e) for e in epochs), sampler_gap, ratios)
            ratios = []
        ratio_stats = stats.pop("_ratios", {})
        out = {f"flow_grpo/{k}": float(np.mean(v)) for k, v in stats.items()}
        if ratios:
            r = torch.cat(ratios)
            out.update({"flow_grpo/ratio_mean": float(r.mean()), "flow_grpo/ratio_min": float(r.min()),
                        "flow_grpo/ratio_max": float(r.max())})
        out.update(ratio_stats)
        out.update(self._episode_metrics(p))
        out.update({"kl": out.get("flow_grpo/kl", float("nan")), "clipfrac": out.get("flow_grpo/clipfrac", float("nan")),
                    "approx_kl": out.get("flow_grpo/approx_kl", float("nan")),
                    "flow_grpo/advantage_abs_mean": float(p["advantages"].abs().mean()),
                    "flow_grpo/steps": float(u.unmasked.shape[0]),
                    "flow_grpo/steps_per_minibatch": float(len(epochs[0][0][1])),
                    "flow_grpo/optimizer_steps": float(sum(len(e) for e in epochs)),
                    "flow_grpo/sampler_logp_gap": sampler_gap,
                    "flow_grpo/skipped_updates": float(self.skipped_updates),
                    # where an iteration's learner time goes (the scoring is the rest of sample_time_s)
                    "flow_grpo/generate_s": float(p.get("generate_s", float("nan"))),
                    "flow_grpo/update_s": time.perf_counter() - t0, "flow_grpo/update_old_logp_s": u.old_s,
                    "flow_grpo/update_reference_s": u.reference_s})
        if u.token_adv is not None:
            on_any = u.unmasked.any(0)                                        # [B_r, L] completion tokens
            out["flow_grpo/token_advantage_abs_mean"] = float(u.token_adv[on_any].abs().mean())
        return out

    def policy_gradient(self, p: dict, steps: list[int] | None = None) -> torch.Tensor:
        """The gradient of the update's surrogate at the weights that generated (every ratio 1,
        no KL: its gradient is 0 at the reference) over all of this rank's valid rows and the
        given unmasking ``steps`` (default all), as one flat float64 vector over the trainable
        parameters: the direction the update's first step follows before clipping and Adam.
        Diagnostics (two disjoint batches' agreement); the weights are left as they were."""
        traj = p["trajectory"]
        rows = torch.arange(traj["unmasked"].shape[1])
        adv = p["advantages"].double()[p["rows"]]
        keep = p["valid"][p["rows"]].to(adv.device) if "valid" in p else torch.ones(len(rows), dtype=torch.bool)
        token_adv = p.get("token_advantages")
        if token_adv is not None:
            token_adv = F.pad(token_adv.double(), (traj["unmasked"].shape[2] - token_adv.shape[1], 0))
        steps = list(range(traj["unmasked"].shape[0])) if steps is None else steps
        params = [q for q in self.lm.model.parameters() if q.requires_grad]
        total = [torch.zeros_like(q, dtype=torch.float64) for q in params]
        self.lm.model.train()
        for s in steps:
            on = traj["unmasked"][s]
            weight = (on.any(-1) & keep).double()
            if not weight.any():
                continue
            token_logp = self._token_log_probs(self.lm.model, traj, s, rows)
            pg, *_ = self._surrogate(token_logp, token_logp.detach(), on, adv, token_adv)
            loss = (pg * weight / weight.sum() / len(steps)).sum()
            for t, g in zip(total, torch.autograd.grad(loss, params, allow_unused=True)):
                if g is not None:
                    t += g.double()
        return torch.cat([t.flatten() for t in total])

    @staticmethod
    def _reduce_stats(stats: dict, entries: int, minibatch_steps: int, sampler_gap: float,
                      ratios: list) -> tuple[dict, float]:
        """A learner group's statistics: each loss statistic's share-weighted sum over its
        (minibatch, step) entries, added over the ranks, divided by the entries (the steps some
        rank had rows for; ``loss`` by the minibatch steps); the ratios' mean, min and max and
        the sampler gap over every rank's rows; grad_norm is the same on every rank. Fixed-size
        collectives only, whatever each rank's own entries."""
        names = ("pg_loss", "kl", "approx_kl", "clipfrac", "loss")
        r = torch.cat(ratios) if ratios else torch.zeros(0, dtype=torch.float64)
        sums = reduce_sum(torch.tensor([sum(stats.get(k, [])) for k in names] + [float(r.sum()), float(r.numel())],
                                       dtype=torch.float64)).tolist()
        out = {k: [v / max(1, minibatch_steps if k == "loss" else entries)]
               for k, v in zip(names, sums) if k in stats or v}
        if "grad_norm" in stats:
            out["grad_norm"] = stats["grad_norm"]
        extremes = reduce_max(torch.tensor([float(r.max()) if r.numel() else -math.inf,
                                            float(-r.min()) if r.numel() else -math.inf, sampler_gap],
                                           dtype=torch.float64)).tolist()
        if sums[-1] > 0:
            out["_ratios"] = {"flow_grpo/ratio_mean": sums[-2] / sums[-1],
                              "flow_grpo/ratio_min": -extremes[1], "flow_grpo/ratio_max": extremes[0]}
        return out, extremes[2]

    @staticmethod
    def _episode_metrics(p: dict) -> dict[str, float]:
        """The reward and its three components (means over all episodes, an invalid one scoring
        0), and the invalid episodes: their number and their number per reason."""
        from flowrl_ray.envs.forms.reward import INVALID_REASONS
        r = p["rewards"]
        valid = p.get("valid", torch.ones(len(r), dtype=torch.bool))
        reasons = p.get("reasons", [""] * len(r))
        out = {"reward_mean": float(r.mean()), "nonzero_reward_count": float((r > 0).sum()),
               "field_accuracy": float(p["field_accuracy"].mean()),
               "task_completion": float(p["task_completion"].mean()),
               "execution_completeness": float(p["execution_completeness"].mean()),
               "unparseable_lines_mean": float(p["unparseable_lines"].mean()),
               "invalid_episodes": float((~valid).sum())}
        for reason in INVALID_REASONS:
            out[f"invalid/{reason}"] = float(sum(1 for ok, why in zip(valid.tolist(), reasons)
                                                 if not ok and why == reason))
        return out

    def eval_metrics(self, batches: list[Batch]) -> dict[str, float]:
        """Greedy generations on held-out tasks: overall and per held-out kind (new values on
        training forms, forms never seen in training)."""
        s = self._rewards(batches, self.pending)
        sampled = torch.as_tensor(self.pending.get("sampled", [False] * len(s["rewards"])))
        greedy = ~sampled
        out = {"eval/return_mean": float(s["rewards"][greedy].mean()), "eval/episodes": int(greedy.sum()),
               "eval/invalid_episodes": float((~s["valid"]).sum())}       # crashed / timed out: scored 0
        splits = np.array(self.pending["splits"])
        for prefix, part in (("eval/", greedy), ("eval/sampled/", sampled)):
            if not part.any():
                continue
            for kind in ("", *sorted(set(splits))):
                rows = part & (torch.as_tensor(splits == kind) if kind else True)
                tag = f"{prefix}{kind}/" if kind else prefix
                for k in ("task_completion", "field_accuracy", "execution_completeness"):
                    out[tag + k] = float(s[k][rows].mean())
                if kind or prefix != "eval/":
                    out[tag + "return_mean"] = float(s["rewards"][rows].mean())
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        # Only what trains (all weights of the small model; the adapters of a LoRA model): the
        # frozen base of an 8B model comes back from algo.model / algo.sft_checkpoint.
        trainable = {n: p.detach().clone() for n, p in self.lm.model.named_parameters() if p.requires_grad}
        return {"model": trainable, "opt": self.opt.state_dict(), "generator": self.generator.get_state(),
                "update_generator": self.update_generator.get_state(),
                "iteration": self.iteration, "skipped_updates": self.skipped_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unexpected = self.lm.model.load_state_dict(state["model"], strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"checkpoint weights the model does not have: {unexpected[:5]}")
        self.opt.load_state_dict(state["opt"])
        self.generator.set_state(state["generator"])
        if "update_generator" in state:            # checkpoints from before step subsampling lack it
            self.update_generator.set_state(state["update_generator"])
        self.iteration, self.skipped_updates = state["iteration"], state["skipped_updates"]


def model_config(cfg: Config) -> dict:
    from dataclasses import asdict
    return asdict(cfg.algo.model)


def load_policy_lm(cfg: Config, device: torch.device):
    """The trainable model: the SFT checkpoint when given, else a fresh model from the config."""
    from flowrl_ray.models.masked_diffusion import build_masked_lm, load_sft_checkpoint
    c = cfg.algo
    lm = load_sft_checkpoint(c.sft_checkpoint, model_config(cfg)) if c.sft_checkpoint else build_masked_lm(model_config(cfg))
    lm.model.to(device)
    return lm
