"""Masked-diffusion language model: loading, SFT loss, trajectory-recording sampler, step log-probs.

The package: ``config`` (the ``algo.model`` schema and its checks), ``model`` (the holder, the KL
reference, building and loading), ``sampling`` (the forward, the sampler, the step log-probs) and
``sft`` (LLaDA's SFT loss; its training loop is :func:`flowrl_ray.pretrain.text_sft.fit_sft`).

The policy of masked-diffusion Flow-GRPO (ReFusion / LLaDA style). Pure torch + transformers;
no Ray here.

Model
-----
``build_masked_lm(model_cfg)`` returns a :class:`MaskedDiffusionLM` holding a Hugging Face model
whose forward ``model(input_ids [B, L], attention_mask) -> logits [B, L, V]`` predicts, at every
position, the clean token (no shift: position i's logits are for token i, as in LLaDA).

* ``path`` set: any checkpoint directory (or cached hub id) with ``trust_remote_code`` and a
  ``mask_token_id`` (ReFusion, LLaDA); ``AutoModelForCausalLM`` first, ``AutoModel`` as fallback.
  A directory with ``adapter_config.json`` is a peft adapter: its base is loaded, then the adapter.
* ``path`` None: the offline default, a small **bidirectional** Llama built from a
  ``LlamaConfig(is_causal=False)`` (a few million parameters) and a byte-level BPE tokenizer
  trained locally (:mod:`flowrl_ray.models.text_tokenizer`).

  Bidirectionality: for transformers-native models whose config says ``is_causal: false`` we do
  not rely on the library turning the 2-D padding mask into a non-causal one (with no padding it
  may return "no mask" and the attention kernel falls back to its causal flag); every forward
  passes an explicit full (non-causal) 4-D additive mask ``[B, 1, L, L]`` that only hides padded
  keys (:func:`masked_lm_logits`). Remote-code models (LLaDA, ReFusion) get the 2-D mask and do
  their own (bidirectional) attention.
* :func:`masked_lm_from_packaged`: a causal LM that a package ships (SmolLM2) with full attention
  and a mask token, the start of a Dream / DiffuLLaMA adaptation (not a trained policy by itself).
* :func:`check_model_config` is the driver's preflight (pure checks, errors name the key);
  :meth:`MaskedDiffusionLM.save` writes a checkpoint (after ``pretrain.text_sft.fit_sft``) that
  :func:`load_sft_checkpoint` reads back with the config's switches.
* ``lora``: peft LoRA adapters (only they are trainable). ``load_in_4bit``: QLoRA, bitsandbytes
  NF4 weights + ``prepare_model_for_kbit_training``; needs LoRA and bitsandbytes (a clear error
  otherwise). On a GPU the compute dtype is bfloat16 (float16 without bf16); without one the
  weights stay on the CPU in float32 compute (slow; dimensions that are multiples of 32).
* :class:`KLReference`: the frozen reference policy of the KL penalty without a second copy of
  a LoRA model's base weights (the base with adapters disabled, or a frozen named copy of the
  adapter); a model without adapters gets a frozen deep copy.

The mask token is never proposed: :func:`masked_lm_logits` sets its logit to ``-inf`` (the id is
kept on ``model.config.mask_token_id``), so the sampler, the log-probs and the SFT loss all use the
same distribution over real tokens.

Sampling (T steps, fixed completion region)
-------------------------------------------
The sequence is the left-padded prompt followed by ``gen_length`` = Lg [MASK] tokens:
``x_0 = [prompt ; M ... M]``, attention mask ``[prompt_mask ; 1 ... 1]``. Step s = 0..T-1 unmasks

    k_s = floor(Lg / T) + 1[s < Lg mod T]        (sum_s k_s = Lg; steps with k_s = 0 are skipped)

positions. With z = logits / tau (tau = temperature; 1 when temperature = 0) at every position:

    token     a_i = argmax_v (z_iv + g_iv)                  g ~ Gumbel(0, 1)   (Gumbel-max)
    log-prob  l_i = z_{i a_i} - logsumexp_v z_iv            (= log softmax(logits / tau)[a_i])
    score     c_i = l_i + h_i                               h ~ Gumbel(0, 1)   (Gumbel-top-k)

and the k_s still-masked positions with the largest score are unmasked (their tokens placed).
At temperature 0 there is no noise: tokens are the argmax, positions the k_s most confident.
The Gumbel-top-k on log-confidence draws positions without replacement with probability
proportional to the (tempered) confidence of their sampled token. This is ``sampler:
gumbel_topk`` (the default).

``sampler: confidence_topk`` is the ReFusion reference ``generate``: the same Gumbel-max tokens,
but positions chosen deterministically, the k_s largest untempered probabilities
``softmax(logits)_i[a_i]`` of the sampled tokens, with the reference's schedule
``k_s = floor((s + 1) Lg / T) - floor(s Lg / T)``. (Unlike the reference, [MASK] is never
proposed here, with either sampler.) A model fine-tuned with that ``generate`` is decoded as it
was trained. A final pass fills whatever is
still masked (with the schedule above nothing is left; the pass is a guard, recorded only when it
unmasks something, never as an empty step).

Flow-GRPO log-prob of step s, either sampler (only tokens count; which positions were chosen
does not):

    log pi_theta(step s) = sum_{i in U_s} log softmax(logits_theta(x_s) / tau)_i [a_i]

The behaviour policy sampled from the tempered distribution, so the recorded and recomputed
log-probs both use ``logits / tau`` (``tau = 1`` when the sampling was greedy).

SFT (LLaDA)
-----------
For a (prompt p, answer a) pair, t ~ U(0, 1), each answer token masked independently with
probability t (prompt never masked):

    L(theta) = - E_t E_{x_t} [ 1/t * 1/|a| * sum_{i in a, x_t^i = M} log p_theta(a_i | p, x_t) ]

(``t`` is drawn as ``eps + (1 - eps) u``, eps = 1e-3, to keep 1/t finite). Answers are the answer
tokens, [EOS], then [EOS] up to ``gen_length``: the model learns to fill the fixed completion
region, and :meth:`MaskedDiffusionLM.decode` stops at the first [EOS]/[PAD].
"""

from flowrl_ray.models.masked_diffusion.config import (DEFAULT_LORA_CFG, DEFAULT_MODEL_CFG, DTYPES, MaskedLMConfig,
                                                       check_model_config, looks_like_hub_id, validate_model_cfg)
from flowrl_ray.models.masked_diffusion.model import (REFERENCE_ADAPTER, KLReference, MaskedDiffusionLM,
                                                      build_masked_lm, load_sft_checkpoint, masked_lm_from_packaged)
from flowrl_ray.models.masked_diffusion.sampling import (SAMPLERS, full_attention_bias, generate,
                                                         generate_with_trajectory, masked_lm_logits, step_log_prob,
                                                         step_log_prob64, step_token_log_probs64,
                                                         trajectory_log_probs, unmask_schedule)
from flowrl_ray.models.masked_diffusion.sft import SFT_T_EPS, sft_loss

__all__ = ["DEFAULT_LORA_CFG", "DEFAULT_MODEL_CFG", "DTYPES", "KLReference", "MaskedDiffusionLM", "MaskedLMConfig",
           "REFERENCE_ADAPTER", "SAMPLERS", "SFT_T_EPS", "build_masked_lm", "check_model_config",
           "full_attention_bias", "generate", "generate_with_trajectory", "load_sft_checkpoint", "looks_like_hub_id",
           "masked_lm_from_packaged", "masked_lm_logits", "sft_loss", "step_log_prob", "step_log_prob64",
           "step_token_log_probs64", "trajectory_log_probs", "unmask_schedule", "validate_model_cfg"]
