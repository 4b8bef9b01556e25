"""LLaDA's masked-diffusion SFT loss (the training loop is :mod:`flowrl_ray.pretrain.text_sft`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flowrl_ray.models.masked_diffusion.sampling import _uniform, masked_lm_logits


SFT_T_EPS = 1e-3            # t = eps + (1 - eps) u keeps 1/t finite


# --------------------------------------------------------------------------- SFT

def sft_loss(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
             answer_ids: torch.Tensor, answer_mask: torch.Tensor, mask_token_id: int,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """LLaDA masked-diffusion SFT loss (a scalar, with gradients):

        t_b ~ eps + (1 - eps) U(0, 1)                          per sequence
        m_bi ~ Bernoulli(t_b)  for answer tokens (answer_mask), prompt never masked
        loss = 1/B sum_b 1/(t_b |a_b|) sum_{i : m_bi} -log p_theta(a_bi | prompt_b, x_t)

    prompt_ids [B, Lp] long (left-padded), prompt_mask [B, Lp] bool, answer_ids [B, La] long,
    answer_mask [B, La] bool (False: not part of the answer; not attended, not scored),
    |a_b| = answer_mask[b].sum().
    """
    b, lp = prompt_ids.shape
    device = prompt_ids.device
    answer_mask = answer_mask.bool() & (answer_ids != mask_token_id)
    t = SFT_T_EPS + (1.0 - SFT_T_EPS) * _uniform((b,), generator, device)           # [B]
    masked = (_uniform(tuple(answer_ids.shape), generator, device) < t[:, None]) & answer_mask
    noisy = torch.where(masked, torch.full_like(answer_ids, mask_token_id), answer_ids)  # [B, La]
    x = torch.cat([prompt_ids, noisy], dim=1)                                           # [B, L]
    attn = torch.cat([prompt_mask.bool(), answer_mask], dim=1)                          # [B, L]
    logits = masked_lm_logits(model, x, attn, keep=F.pad(masked, (lp, 0)))             # [M, V] masked only
    nll = F.cross_entropy(logits, answer_ids[masked], reduction="none")                 # [M]
    weight = 1.0 / (t[:, None] * answer_mask.sum(-1, keepdim=True).clamp(min=1))        # [B, 1]
    return (nll * weight.expand_as(masked)[masked]).sum() / b
