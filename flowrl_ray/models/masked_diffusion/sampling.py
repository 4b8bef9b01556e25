"""The masked-diffusion LM's forward (bidirectional, [MASK] never proposed), the trajectory-recording
sampler and the step log-probs of Flow-GRPO (the equations are in the package's docstring)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn



# --------------------------------------------------------------------------- forward

def _base_model(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _wants_full_mask(model: nn.Module) -> bool:
    """transformers-native model configured non-causal: pass an explicit 4-D mask."""
    base = _base_model(model)
    config = getattr(base, "config", None)
    return (getattr(config, "is_causal", True) is False
            and type(base).__module__.startswith("transformers."))


def full_attention_bias(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-causal additive mask: attention_mask [B, L] bool -> [B, 1, L, L] with 0 where the key
    is a real token and the dtype's minimum where it is padding (every query sees every key)."""
    b, l = attention_mask.shape
    bias = torch.zeros(b, 1, 1, l, dtype=dtype, device=attention_mask.device)
    bias = bias.masked_fill(~attention_mask.bool()[:, None, None, :], torch.finfo(dtype).min)
    return bias.expand(b, 1, l, l)


def _takes_logits_to_keep(model: nn.Module) -> bool:
    """The model's forward computes logits only where asked (transformers' ``logits_to_keep``:
    hidden states sliced before the output layer); remote-code models may not."""
    import inspect
    return "logits_to_keep" in inspect.signature(_base_model(model).forward).parameters


def masked_lm_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     start: int = 0, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits [B, L - start, V] of positions ``start..L-1``, or with ``keep`` (bool
    [B, L]) the logits of the kept positions only, [keep.sum(), V] in row-major order; the mask
    token's logit is -inf (never proposed). input_ids [B, L] long, attention_mask [B, L] bool.
    Models that take ``logits_to_keep`` (transformers' Llama and most others) apply their
    output layer to those positions alone; others compute every position's and slice."""
    if _wants_full_mask(model):
        dtype = model.get_input_embeddings().weight.dtype
        am = full_attention_bias(attention_mask, dtype if dtype.is_floating_point else torch.float32)
    else:
        am = attention_mask.long()
    kwargs = {}
    sliced = _takes_logits_to_keep(model)
    if sliced and keep is not None:
        kwargs["logits_to_keep"] = keep.bool()
    elif sliced and start > 0:
        kwargs["logits_to_keep"] = input_ids.shape[1] - start
    out = model(input_ids=input_ids, attention_mask=am, **kwargs)
    raw = out.logits if hasattr(out, "logits") else out[0]
    if not sliced:                                                   # every position's: slice here
        raw = raw[keep.bool()] if keep is not None else raw[:, start:]
    # a fresh float32 tensor (never the model's own output), so the in-place fill below is safe
    logits = raw.float() if raw.dtype != torch.float32 else raw.clone()
    mask_id = getattr(_base_model(model).config, "mask_token_id", None)
    if mask_id is not None:
        logits[..., mask_id] = float("-inf")
    return logits


def _token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float
                     ) -> torch.Tensor:
    """log softmax(logits / tau)[token]: logits [B, N, V], tokens [B, N] -> [B, N]
    (tau = temperature, or 1 when temperature <= 0)."""
    z = logits / _tau(temperature)
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def _tau(temperature: float) -> float:
    return float(temperature) if temperature > 0 else 1.0


# --------------------------------------------------------------------------- sampling

#: the samplers: which positions a step unmasks (see the module docstring)
SAMPLERS = ("gumbel_topk", "confidence_topk")


def unmask_schedule(gen_length: int, steps: int, sampler: str = "gumbel_topk") -> list[int]:
    """Positions unmasked per step, zero entries dropped; sums to gen_length.

    gumbel_topk:      k_s = floor(Lg / T) + 1[s < Lg mod T]
    confidence_topk:  k_s = floor((s + 1) Lg / T) - floor(s Lg / T)     (the reference generate)
    """
    if gen_length <= 0 or steps <= 0:
        raise ValueError(f"gen_length and steps must be positive, got {gen_length}, {steps}")
    if sampler == "confidence_topk":
        ks = [(s + 1) * gen_length // steps - s * gen_length // steps for s in range(steps)]
    elif sampler == "gumbel_topk":
        base, rem = divmod(gen_length, steps)
        ks = [base + (s < rem) for s in range(steps)]
    else:
        raise ValueError(f"unknown sampler {sampler!r} (one of {', '.join(SAMPLERS)})")
    return [k for k in ks if k > 0]


def _uniform(shape: tuple, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else device
    u = torch.rand(shape, generator=generator, device=gen_device).to(device)
    return u.clamp_(min=torch.finfo(u.dtype).tiny, max=1.0 - torch.finfo(u.dtype).eps)


def _gumbel(shape: tuple, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return -torch.log(-torch.log(_uniform(shape, generator, device)))


def _check_mask_id(model: nn.Module, mask_token_id: int) -> None:
    cfg_id = getattr(getattr(_base_model(model), "config", None), "mask_token_id", None)
    if cfg_id != mask_token_id:
        raise ValueError(f"mask_token_id {mask_token_id} differs from model.config.mask_token_id "
                         f"{cfg_id}; build the model with build_masked_lm (or set the config's id) "
                         "so that sampling and step_log_prob suppress the same token")


@torch.no_grad()
def _sample(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
            gen_length: int, steps: int, temperature: float, mask_token_id: int,
            generator: torch.Generator | None, record: bool, sampler: str = "gumbel_topk"):
    _check_mask_id(model, mask_token_id)
    schedule = unmask_schedule(gen_length, steps, sampler)          # (checks the sampler's name)
    b, lp = prompt_ids.shape
    device = prompt_ids.device
    x = torch.cat([prompt_ids, prompt_ids.new_full((b, gen_length), mask_token_id)], dim=1)  # [B, L]
    attn = torch.cat([prompt_mask.bool(), prompt_mask.new_ones((b, gen_length), dtype=torch.bool)],
                     dim=1)                                                   # [B, L]
    masked = torch.ones(b, gen_length, dtype=torch.bool, device=device)       # [B, Lg] still [MASK]
    states, unmasked, tokens, logps = [], [], [], []

    def step(k: int | None) -> None:
        # candidates at the still-masked positions only (the others keep their tokens)
        logits = masked_lm_logits(model, x, attn, keep=F.pad(masked, (lp, 0)))   # [n, V], n = masked.sum()
        if temperature > 0:
            drawn = (logits / temperature + _gumbel(logits.shape, generator, device)).argmax(-1)
        else:
            drawn = logits.argmax(-1)                                         # [n]
        drawn_logp = _token_log_probs(logits[:, None], drawn[:, None], temperature)[:, 0]   # [n]
        cand = torch.full_like(masked, mask_token_id, dtype=torch.long).masked_scatter(masked, drawn)  # [B, Lg]
        cand_logp = torch.zeros(masked.shape, device=device).masked_scatter(masked, drawn_logp)      # [B, Lg]
        if k is None:                                                         # final fill
            new = masked.clone()
        else:
            if sampler == "confidence_topk":                  # untempered p(a_i), no noise
                score = torch.zeros(masked.shape, device=device).masked_scatter(
                    masked, _token_log_probs(logits[:, None], drawn[:, None], 0.0)[:, 0])
            elif temperature > 0:
                score = cand_logp + _gumbel(cand_logp.shape, generator, device)
            else:
                score = cand_logp.clone()
            score = score.masked_fill(~masked, float("-inf"))
            top = score.topk(k, dim=-1).indices                               # [B, k]
            new = torch.zeros_like(masked).scatter_(1, top, True)             # [B, Lg]
        if record:
            states.append(x.clone())
            logps.append(torch.where(new, cand_logp, 0.0).sum(-1))            # [B]
        x[:, lp:] = torch.where(new, cand, x[:, lp:])
        masked.logical_and_(~new)
        if record:
            full_new = torch.zeros_like(attn)
            full_new[:, lp:] = new
            unmasked.append(full_new)
            tokens.append(x.clone())

    for k in schedule:
        step(k)
    if masked.any():                                  # guard: never taken with the schedule
        step(None)
    if not record:
        return x, None
    trajectory = {
        "states": torch.stack(states),          # [S, B, L] sequence before step s
        "attention_mask": attn,                 # [B, L] bool
        "unmasked": torch.stack(unmasked),      # [S, B, L] bool, positions unmasked at step s
        "tokens": torch.stack(tokens),          # [S, B, L] sequence after step s
        "logp": torch.stack(logps),             # [S, B] log-prob of step s (behaviour policy)
        "prompt_len": lp,
        "temperature": float(temperature),
        "mask_token_id": mask_token_id,
        "sampler": sampler,
    }
    return x, trajectory


def generate_with_trajectory(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                             gen_length: int, steps: int, temperature: float, mask_token_id: int,
                             generator: torch.Generator | None = None, sampler: str = "gumbel_topk"
                             ) -> tuple[torch.Tensor, dict]:
    """Iterative unmasking (see the module docstring), recording the trajectory.

    prompt_ids [B, Lp] long (left-padded), prompt_mask [B, Lp] bool -> sequences [B, L] long
    (L = Lp + gen_length, no [MASK] left) and a trajectory dict, S = number of steps that
    unmasked something (``len(unmask_schedule(gen_length, steps))`` = min(steps, gen_length)):

        states         [S, B, L] long   the sequence before step s
        attention_mask [B, L]    bool   prompt mask + ones over the completion
        unmasked       [S, B, L] bool   positions newly unmasked at step s (completion only)
        tokens         [S, B, L] long   the sequence after step s (= states[s+1]; the placed
                                        tokens at ``unmasked[s]``)
        logp           [S, B]    float  sum of log softmax(logits / tau) at unmasked[s], from
                                        the forward pass that chose the tokens (no grad)
        prompt_len int, temperature float, mask_token_id int, sampler str

    Each completion position is unmasked exactly once; step s unmasks ``k_s`` per row
    (:func:`unmask_schedule` of the sampler). Runs under ``no_grad``; call with the model in eval
    mode for reproducible log-probs.
    """
    return _sample(model, prompt_ids, prompt_mask, gen_length, steps, temperature,
                   mask_token_id, generator, record=True, sampler=sampler)


def generate(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             gen_length: int, steps: int, temperature: float, mask_token_id: int,
             generator: torch.Generator | None = None, sampler: str = "gumbel_topk") -> torch.Tensor:
    """:func:`generate_with_trajectory` without recording: -> sequences [B, Lp + gen_length]."""
    return _sample(model, prompt_ids, prompt_mask, gen_length, steps, temperature,
                   mask_token_id, generator, record=False, sampler=sampler)[0]


def step_log_prob(model: nn.Module, state: torch.Tensor, attention_mask: torch.Tensor,
                  unmasked: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
                  ) -> torch.Tensor:
    """Flow-GRPO log-prob of one unmasking step, with gradients:

        log pi(step) = sum_{i : unmasked_i} log softmax(logits(state) / tau)_i [tokens_i]

    state [B, L] long (the sequence before the step), attention_mask [B, L] bool,
    unmasked [B, L] bool, tokens [B, L] long (read at the unmasked positions) -> [B].
    tau = temperature (1 when temperature = 0, the greedy sampler's case). Batch-agnostic: steps
    may be flattened into the batch (``states.flatten(0, 1)`` with the mask repeated).
    """
    cols = unmasked.any(dim=0).nonzero()
    # logits only from the first unmasked column on (the last one when nothing was unmasked)
    start = int(cols[0, 0]) if cols.numel() else state.shape[1] - 1
    logits = masked_lm_logits(model, state, attention_mask, start=start)     # [B, L - start, V]
    lp = _token_log_probs(logits, tokens[:, start:], temperature)             # [B, L - start]
    return torch.where(unmasked[:, start:], lp, 0.0).sum(-1)                  # [B]


def step_token_log_probs64(model: nn.Module, state: torch.Tensor, attention_mask: torch.Tensor,
                           unmasked: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
                           ) -> torch.Tensor:
    """The terms of :func:`step_log_prob`, one per position: ``log softmax(logits(state) / tau)_i
    [tokens_i]`` where ``unmasked_i``, 0 elsewhere -> [B, L] float64 (computed in float32).
    Their sum over L is the step's log-prob; a per-token KL reads them one by one."""
    unmasked = unmasked.bool()
    keep = unmasked                  # logits of the step's tokens alone; none: the last column's
    if not unmasked.any():           # (zeros that still hang on the graph, as every step's do)
        keep = F.pad(torch.ones_like(unmasked[:, -1:]), (unmasked.shape[1] - 1, 0))
    logits = masked_lm_logits(model, state, attention_mask, keep=keep)        # [n, V]
    lp = _token_log_probs(logits[:, None], tokens[keep][:, None], temperature)[:, 0]   # [n]
    lp = torch.where(unmasked[keep], lp, 0.0).double()
    return torch.zeros(state.shape, dtype=torch.float64, device=state.device).masked_scatter(keep, lp)


def step_log_prob64(model: nn.Module, state: torch.Tensor, attention_mask: torch.Tensor,
                    unmasked: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
                    ) -> torch.Tensor:
    """:func:`step_log_prob` with the sum over the step's tokens taken in float64 -> [B] float64
    (the per-token log-probs stay float32): ratios ``exp(logp - logp_old)`` of long steps lose no
    precision to the sum's rounding."""
    return step_token_log_probs64(model, state, attention_mask, unmasked, tokens, temperature).sum(-1)


def trajectory_log_probs(model: nn.Module, trajectory: Mapping, temperature: float,
                         grad: bool = False) -> torch.Tensor:
    """:func:`step_log_prob` of every recorded step -> [S, B] (with gradients if `grad`)."""
    with torch.set_grad_enabled(grad):
        return torch.stack([
            step_log_prob(model, trajectory["states"][s], trajectory["attention_mask"],
                          trajectory["unmasked"][s], trajectory["tokens"][s], temperature)
            for s in range(trajectory["states"].shape[0])])


