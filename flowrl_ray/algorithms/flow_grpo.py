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
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from flowrl_ray.algorithms.advantages import group_advantages
from flowrl_ray.algorithms.base import GroupAlgorithm
from flowrl_ray.optim import Accumulator, dropout_off, reduce_max, reduce_sum, world
from flowrl_ray.algorithms.losses import k3, ppo_clip_objective
from flowrl_ray.batch import Batch
from flowrl_ray.config import Config, ConfigError, TextSFTPretrainConfig, check
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.masked_diffusion import MaskedLMConfig

__all__ = ["group_advantages", "k3_kl", "kl_penalty", "FlowGRPO", "FlowGRPOConfig"]
KL_ESTIMATORS = ("step", "token")


@dataclass
class FlowGRPOConfig:
    #: earlier or paper names of keys, accepted and mapped to the one name (config.py)
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


class FlowGRPO(GroupAlgorithm):
    name = "flow_grpo"
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
    def generate(self, num_chunks: int, mode: str = "train") -> list[dict]:
        """Sample this iteration's groups ("train") or the evaluation set ("eval"). In a learner
        group (training) every rank draws the same P prompts and samples the whole groups
        g = rank, rank + R, ... of them, with its own stream drawn from the shared generator;
        chunk ids are the rows' places in the whole batch [P * G]. Evaluation is one rank's."""
        from flowrl_ray.models.masked_diffusion import generate_with_trajectory
        from flowrl_ray.envs.forms import prompt_text
        c = self.c
        rank, ranks = world() if mode == "train" else (0, 1)
        tasks = self._draw_tasks(mode)
        group = 1 if mode == "eval" else c.group_size
        groups = torch.arange(rank, len(tasks), ranks)                         # [P_r] this rank's groups
        rows = [tasks[g] for g in groups.tolist() for _ in range(group)]      # [P_r*G], groups consecutive
        generator = self.generator
        if ranks > 1:       # every rank draws the same seed (the generators stay equal), then its own stream
            seed = int(torch.randint(2 ** 62, (1,), generator=self.generator))
            generator = torch.Generator().manual_seed(seed + rank)
        prompt_ids, prompt_mask = self.lm.encode_prompts([prompt_text(t, self.catalog) for t in rows],
                                                          c.max_prompt_len)
        temperature = 0.0 if mode == "eval" else c.generation_temperature
        self.lm.model.eval()
        sequences, traj = generate_with_trajectory(
            self.lm.model, prompt_ids.to(self.device), prompt_mask.to(self.device), c.gen_length,
            c.num_generation_steps, temperature, self.lm.mask_token_id, generator, sampler=c.sampler)
        texts = self.lm.decode(sequences, prompt_ids.shape[1])
        batch_rows = (groups[:, None] * group + torch.arange(group)).flatten()   # [P_r*G] places in the batch
        self.pending = {"mode": mode, "trajectory": traj, "n": len(tasks) * group, "rows": batch_rows,
                        "texts": texts, "splits": [t.split for t in rows]}
        return [{"ids": batch_rows[part].numpy(), "task_ids": [rows[i].task_id for i in part],
                 "texts": [texts[i] for i in part]}
                for part in np.array_split(np.arange(len(rows)), num_chunks) if len(part)]

    def _rewards(self, batches: list[Batch]) -> dict[str, torch.Tensor]:
        n = self.pending["n"]
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

    def prepare(self, batches: list[Batch]) -> dict:
        scores = self._rewards(batches)
        adv = group_advantages(scores["rewards"], self.c.group_size, self.c.adv_clip_max,
                               valid=scores["valid"])                                   # [P*G]
        # the whole batch's advantages and scores (every group is whole on its rank); the
        # trajectory is this rank's rows (``rows``: their places in the batch)
        return {"trajectory": self.pending["trajectory"], "advantages": adv.to(self.device),
                "rows": self.pending["rows"], **scores}

    # ------------------------------------------------------------------ update
    def _update_plan(self, groups: int, steps: int) -> tuple[list[torch.Tensor], list[list[tuple[int, list[int]]]]]:
        """The update's random draws, all from ``update_generator``: the minibatches (whole groups,
        a random partition) and, per epoch, the minibatch order with each minibatch's K steps.
        -> (rows of each minibatch [G * minibatch_groups] long, per epoch [(minibatch, steps)])."""
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
        picked = [sorted(torch.randperm(steps, generator=g)[:k].tolist()) for _ in minibatches]
        epochs = [[(int(m), picked[int(m)]) for m in torch.randperm(len(minibatches), generator=g)]
                  for _ in range(c.epochs)]
        return minibatches, epochs

    def _token_log_probs(self, model: torch.nn.Module, traj: dict, s: int, rows: torch.Tensor) -> torch.Tensor:
        """log pi of each token step s unmasked in ``rows`` under ``model`` (float64
        [len(rows), L], 0 elsewhere; their sum is log pi(step s)), dropout off."""
        from flowrl_ray.models.masked_diffusion import step_token_log_probs64
        temp = self.c.generation_temperature or 1.0
        with dropout_off(model):
            return step_token_log_probs64(model, traj["states"][s][rows], traj["attention_mask"][rows],
                                          traj["unmasked"][s][rows], traj["tokens"][s][rows], temp)

    def _step_log_prob(self, model: torch.nn.Module, traj: dict, s: int, rows: torch.Tensor) -> torch.Tensor:
        """log pi(step s) of ``rows`` under ``model`` (float64 [len(rows)]), dropout off."""
        return self._token_log_probs(model, traj, s, rows).sum(-1)

    @torch.no_grad()
    def _reference_log_probs(self, traj: dict, s: int, rows: torch.Tensor) -> torch.Tensor:
        """The KL reference's :meth:`_token_log_probs` (float64 [len(rows), L])."""
        with self.reference.model() as ref:
            return self._token_log_probs(ref, traj, s, rows)

    def update(self, p: dict) -> dict[str, float]:
        c, traj = self.c, p["trajectory"]
        adv = p["advantages"].double()                                        # [B] the whole batch
        batch, ranks = adv.shape[0], world()[1]
        valid = p.get("valid", torch.ones(batch, dtype=torch.bool)).to(adv.device)
        unmasked = traj["unmasked"]                                            # [S, B_r, L] this rank's rows
        steps = unmasked.shape[0]
        plan_rows, epochs = self._update_plan(batch // c.group_size, steps)   # minibatches of batch rows
        # In a learner group each rank takes its rows of every minibatch (all of them on one
        # learner): ``minibatches`` are its trajectory's rows, ``owned`` the batch rows they are.
        place = torch.full((batch,), -1, dtype=torch.long)
        place[p.get("rows", torch.arange(batch))] = torch.arange(unmasked.shape[1])
        owned = [r[place[r] >= 0] for r in plan_rows]
        minibatches = [place[r] for r in owned]
        # rows that unmasked at step s (valid ones) per minibatch, over every rank: a step's
        # loss is the mean over them
        counts = reduce_sum(torch.stack([(unmasked[:, r].any(-1) & valid[o]).double().sum(-1)
                                         for r, o in zip(minibatches, owned)]))            # [n_mb, S]
        model = self.lm.model
        model.train()
        # Old log-probs of every (minibatch, step) the update uses, computed before any step on
        # exactly the rows the loss will see (so rho = 1 holds to the last bit). The first
        # minibatch of the first epoch comes before any step: its own forward pass gives them.
        first_mb, first_steps = epochs[0][0]
        old: dict[tuple[int, int], torch.Tensor] = {}
        ref: dict[tuple[int, int], torch.Tensor] = {}         # the frozen reference per token [mb, L]: on first use
        with torch.no_grad():
            for key in sorted({(m, s) for plan in epochs for m, ss in plan for s in ss}):
                if (key[0] != first_mb or key[1] not in first_steps) and len(minibatches[key[0]]):
                    old[key] = self._step_log_prob(model, traj, key[1], minibatches[key[0]])
        sampler_gap = 0.0                  # |recomputed - sampler's| old log-prob: numerics only
        ratios: list[torch.Tensor] = []
        stats: dict[str, list[float]] = {}
        acc = Accumulator([self.opt], c.max_grad_norm)            # one optimiser step per minibatch
        acc.zero_grad()
        for plan in epochs:
            for mb, picked in plan:
                rows = minibatches[mb]
                a, keep = adv[owned[mb]], valid[owned[mb]]
                total = 0.0
                for s in picked:
                    if counts[mb, s] == 0:
                        continue
                    if not len(rows):                          # a rank without rows here: its share is 0
                        continue
                    weight = (unmasked[s][rows].any(-1) & keep).double()      # valid rows that unmasked at s
                    weight = weight / counts[mb, s] / len(picked)             # mean over rows, 1/K over steps
                    if c.kl_coeff > 0 and (mb, s) not in ref:              # before the graph is built:
                        ref[mb, s] = self._reference_log_probs(traj, s, rows)  # (adapters switch)
                    token_logp = self._token_log_probs(model, traj, s, rows)  # [mb, L] with gradients
                    logp = token_logp.sum(-1)                                  # [mb] log pi(step s)
                    if (mb, s) not in old:                                     # no step taken yet
                        old[mb, s] = logp.detach()
                    if plan is epochs[0]:
                        gap = (old[mb, s] - traj["logp"][s][rows].double()).abs()[unmasked[s][rows].any(-1)]
                        sampler_gap = max(sampler_gap, float(gap.max()) if gap.numel() else 0.0)
                    log_ratio = logp - old[mb, s]
                    ratio = torch.exp(log_ratio)
                    pg = -ppo_clip_objective(ratio, a, c.clip)
                    kl = (kl_penalty(token_logp, ref[mb, s], c.kl_estimator) if c.kl_coeff > 0
                          else torch.zeros_like(logp))
                    loss = ((pg + c.kl_coeff * kl) * weight).sum()
                    if not acc.backward(loss):                  # non-finite: the step is skipped
                        break
                    total += float(loss.detach())
                    with torch.no_grad():
                        w = weight * len(picked)
                        r = ratio.detach()[w > 0]
                        ratios.append(r)
                        for k, v in {"pg_loss": (pg * w).sum(), "kl": (kl * w).sum(),
                                     "approx_kl": (k3(log_ratio) * w).sum(),
                                     "clipfrac": (((ratio - 1).abs() > c.clip).double() * w).sum()}.items():
                            stats.setdefault(k, []).append(float(v))
                finite_loss = acc.finite
                if not finite_loss:
                    with torch.no_grad():          # still before any step: the old log-probs it left out
                        for key in [(mb, t) for t in picked if (mb, t) not in old and plan is epochs[0]]:
                            old[key] = self._step_log_prob(model, traj, key[1], rows)
                (norm,), stepped = acc.step()                                   # one optimiser: one norm
                self.skipped_updates += not stepped
                if stepped:
                    stats.setdefault("grad_norm", []).append(norm)
                if finite_loss:
                    stats.setdefault("loss", []).append(total)
        self.iteration += 1
        if ranks > 1:                                  # the whole minibatches' statistics, over the ranks
            entries = sum(int(counts[m, t] > 0) for plan in epochs for m, ss in plan for t in ss)
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
                    "flow_grpo/steps": float(steps), "flow_grpo/steps_per_minibatch": float(len(epochs[0][0][1])),
                    "flow_grpo/optimizer_steps": float(sum(len(e) for e in epochs)),
                    "flow_grpo/sampler_logp_gap": sampler_gap,
                    "flow_grpo/skipped_updates": float(self.skipped_updates)})
        return out

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
        s = self._rewards(batches)
        out = {"eval/return_mean": float(s["rewards"].mean()), "eval/episodes": len(s["rewards"]),
               "eval/invalid_episodes": float((~s["valid"]).sum())}       # crashed / timed out: scored 0
        splits = np.array(self.pending["splits"])
        for kind in ("", *sorted(set(splits))):
            rows = torch.as_tensor(splits == kind) if kind else torch.ones(len(splits), dtype=torch.bool)
            tag = f"eval/{kind}/" if kind else "eval/"
            for k in ("task_completion", "field_accuracy", "execution_completeness"):
                out[tag + k] = float(s[k][rows].mean())
            if kind:
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
