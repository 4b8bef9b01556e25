"""Masked-diffusion language model: loading, SFT loss, trajectory-recording sampler, step log-probs.

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
* :func:`check_model_config` is the driver's preflight (pure checks, errors name the key);
  :meth:`MaskedDiffusionLM.save` writes a checkpoint (after :func:`fit_sft`) that
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

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from flowrl_ray.config import ConfigError, check, check_known_keys
from flowrl_ray.utils import frozen_copy

SFT_T_EPS = 1e-3

# --------------------------------------------------------------------------- config

@dataclass
class MaskedLMConfig:
    """``algo.model.*`` of Flow-GRPO, the one schema of the masked-diffusion LM: a Hugging Face
    checkpoint (``path``) or the small offline model (about 1M parameters with a 2k vocab).
    :func:`validate_model_cfg` checks what spans keys; a plain mapping is completed from these
    defaults (:data:`DEFAULT_MODEL_CFG`)."""
    path: Optional[str] = None                 # HF checkpoint dir (ReFusion, LLaDA) or cached hub id
    trust_remote_code: bool = False
    mask_token_id: Optional[int] = None        # None: the tokenizer's (then the model config's) [MASK]
    tokenizer_path: Optional[str] = None       # None with path: the checkpoint's tokenizer
    hidden_size: int = field(default=128, metadata=check(gt=0))     # offline model only (and the next three)
    num_layers: int = field(default=4, metadata=check(gt=0))
    num_heads: int = field(default=4, metadata=check(gt=0))
    intermediate_size: int = field(default=256, metadata=check(gt=0))
    max_len: int = field(default=384, metadata=check(gt=0))         # max prompt + completion tokens
    vocab_size: int = field(default=2048, metadata=check(gt=0))     # the offline tokenizer's (the
    #                                          model's vocabulary is len(tokenizer))
    # offline model: the output layer is the input embedding, so a token copied from the prompt
    # can be written even if no answer ever contained it (held-out values are made of such tokens)
    tie_embeddings: bool = True
    lora: Optional[dict] = None                # {r, alpha, dropout, target_modules}: peft LoRA
    load_in_4bit: bool = False                 # QLoRA (bitsandbytes NF4; CUDA, or CPU in float32); needs lora
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"   # HF checkpoints' weights


#: a plain model_cfg mapping's keys and defaults: MaskedLMConfig's
DEFAULT_MODEL_CFG: dict[str, Any] = dataclasses.asdict(MaskedLMConfig())
DEFAULT_LORA_CFG: dict[str, Any] = {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": None}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _err(prefix: str, key: str, msg: str) -> ConfigError:
    return ConfigError(f"config key '{prefix}.{key}': {msg}")


def _check_keys(data: Mapping, allowed: Sequence[str], prefix: str) -> None:
    check_known_keys(data, list(allowed), prefix + ".")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_model_cfg(model_cfg: Mapping | Any, prefix: str = "algo.model") -> dict:
    """Check `model_cfg` (a mapping or a dataclass) and return it completed with defaults.

    Pure checks, nothing loaded; whether CUDA/bitsandbytes exist for 4-bit is checked by
    :func:`build_masked_lm`. Every error is a ``ConfigError`` naming ``<prefix>.<key>``.
    """
    if dataclasses.is_dataclass(model_cfg) and not isinstance(model_cfg, type):
        model_cfg = dataclasses.asdict(model_cfg)
    if model_cfg is None:
        model_cfg = {}
    if not isinstance(model_cfg, Mapping):
        raise ConfigError(f"config key '{prefix}': expected a mapping, got {model_cfg!r}")
    _check_keys(model_cfg, list(DEFAULT_MODEL_CFG), prefix)
    cfg = {**DEFAULT_MODEL_CFG, **model_cfg}

    if cfg["path"] is not None and not (isinstance(cfg["path"], (str, os.PathLike)) and str(cfg["path"])):
        raise _err(prefix, "path", f"expected a checkpoint directory or null, got {cfg['path']!r}")
    if cfg["tokenizer_path"] is not None and not isinstance(cfg["tokenizer_path"], (str, os.PathLike)):
        raise _err(prefix, "tokenizer_path", f"expected a directory or null, got {cfg['tokenizer_path']!r}")
    for key in ("trust_remote_code", "load_in_4bit", "tie_embeddings"):
        if not isinstance(cfg[key], bool):
            raise _err(prefix, key, f"expected true or false, got {cfg[key]!r}")
    mid = cfg["mask_token_id"]
    if mid is not None and not (_is_int(mid) and mid >= 0):
        raise _err(prefix, "mask_token_id", f"expected a non-negative int or null, got {mid!r}")
    for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_len"):
        if not (_is_int(cfg[key]) and cfg[key] > 0):
            raise _err(prefix, key, f"expected a positive int, got {cfg[key]!r}")
    from flowrl_ray.models.text_tokenizer import MIN_VOCAB_SIZE
    if not (_is_int(cfg["vocab_size"]) and cfg["vocab_size"] >= MIN_VOCAB_SIZE):
        raise _err(prefix, "vocab_size", f"expected an int >= {MIN_VOCAB_SIZE} (byte-level BPE), "
                   f"got {cfg['vocab_size']!r}")
    if cfg["hidden_size"] % cfg["num_heads"] or (cfg["hidden_size"] // cfg["num_heads"]) % 2:
        raise _err(prefix, "num_heads", f"hidden_size {cfg['hidden_size']} must split into "
                   f"{cfg['num_heads']} heads of an even size (rotary embeddings)")
    if cfg["dtype"] not in ("auto", *DTYPES):
        raise _err(prefix, "dtype", f"must be one of {['auto', *DTYPES]}, got {cfg['dtype']!r}")

    lora = cfg["lora"]
    if lora is not None:
        if dataclasses.is_dataclass(lora) and not isinstance(lora, type):
            lora = dataclasses.asdict(lora)
        if not isinstance(lora, Mapping):
            raise _err(prefix, "lora", f"expected a mapping {{r, alpha, dropout, target_modules}} "
                       f"or null, got {lora!r}")
        _check_keys(lora, list(DEFAULT_LORA_CFG), f"{prefix}.lora")
        lora = {**DEFAULT_LORA_CFG, **lora}
        if not (_is_int(lora["r"]) and lora["r"] > 0):
            raise _err(prefix, "lora.r", f"expected a positive int, got {lora['r']!r}")
        if isinstance(lora["alpha"], bool) or not isinstance(lora["alpha"], (int, float)) \
                or lora["alpha"] <= 0:
            raise _err(prefix, "lora.alpha", f"expected a positive number, got {lora['alpha']!r}")
        if isinstance(lora["dropout"], bool) or not isinstance(lora["dropout"], (int, float)) \
                or not 0 <= lora["dropout"] < 1:
            raise _err(prefix, "lora.dropout", f"expected a number in [0, 1), got {lora['dropout']!r}")
        tm = lora["target_modules"]
        if tm is not None and not (isinstance(tm, (list, tuple)) and tm
                                   and all(isinstance(m, str) for m in tm)):
            raise _err(prefix, "lora.target_modules",
                       f"expected a non-empty list of module names or null, got {tm!r}")
        cfg["lora"] = lora

    if cfg["load_in_4bit"]:
        if cfg["lora"] is None:
            raise _err(prefix, "load_in_4bit", "4-bit weights are frozen; QLoRA needs "
                       f"'{prefix}.lora' set (e.g. {{r: 8, alpha: 16}})")
        if cfg["path"] is None:   # offline default: keep every linear dimension a multiple of 32
            for key in ("hidden_size", "intermediate_size"):
                if cfg[key] % 32:
                    raise _err(prefix, key, f"must be a multiple of 32 with load_in_4bit, "
                               f"got {cfg[key]}")
    return cfg


def looks_like_hub_id(path: str) -> bool:
    parts = str(path).split("/")
    return len(parts) == 2 and all(parts) and not str(path).startswith((".", "~"))


def check_model_config(model_cfg: Mapping | Any, sft_checkpoint: str | None = None,
                       prefix: str = "algo.model", sft_key: str = "algo.sft_checkpoint") -> dict:
    """Preflight for the driver (nothing loaded, no CUDA check): :func:`validate_model_cfg` and
    the directories it needs exist. Returns the completed config; ``ConfigError`` names the key."""
    cfg = validate_model_cfg(model_cfg, prefix)
    if sft_checkpoint is not None:
        if not os.path.isdir(sft_checkpoint):
            raise ConfigError(f"config key '{sft_key}': no checkpoint directory at "
                              f"{sft_checkpoint!r} (written by MaskedDiffusionLM.save)")
        return cfg
    for key in ("path", "tokenizer_path"):
        value = cfg[key]
        if value is not None and not os.path.isdir(value) and not looks_like_hub_id(value):
            raise _err(prefix, key, f"no directory at {str(value)!r}")
    if cfg["path"] is None and cfg["tokenizer_path"] is None:
        raise _err(prefix, "tokenizer_path", "the offline default model needs a tokenizer "
                   "directory (train_tokenizer(texts, vocab_size, path)) or a checkpoint in "
                   f"'{prefix}.path'")
    return cfg


def _check_4bit_available(prefix: str) -> None:
    """bitsandbytes is installed (the ``text`` extra). It runs NF4 on a CUDA GPU and, slowly, on
    the CPU (float32 compute); without a GPU the weights stay on the CPU."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise _err(prefix, "load_in_4bit", "4-bit QLoRA needs bitsandbytes: `pip install "
                   f"'flowrl-ray[text]'` (or set {prefix}.load_in_4bit=false) ({e})") from e


# --------------------------------------------------------------------------- holder

@dataclass
class MaskedDiffusionLM:
    """A masked-diffusion LM with its tokenizer and special ids.

    model: HF module, ``model(input_ids, attention_mask).logits -> [B, L, V]`` (use
    :func:`masked_lm_logits`); tokenizer: a ``transformers`` tokenizer.
    """

    model: nn.Module
    tokenizer: Any
    mask_token_id: int
    pad_token_id: int
    eos_token_id: int | None = None
    max_len: int | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: torch.device | str) -> "MaskedDiffusionLM":
        self.model.to(device)
        return self

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def encode_prompts(self, texts: Sequence[str], max_len: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokenise (with the tokenizer's special tokens, e.g. [BOS]), keep the first `max_len`
        tokens (default: ``self.max_len``), left-pad to the longest.

        -> ids [B, Lp] long (pad id in front), mask [B, Lp] bool (True at real tokens).
        """
        max_len = max_len or self.max_len
        rows = [self.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
        if max_len:
            rows = [r[:max_len] for r in rows]
        lp = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), lp), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), lp, dtype=torch.bool)
        for b, r in enumerate(rows):
            if r:
                ids[b, lp - len(r):] = torch.tensor(r, dtype=torch.long)
                mask[b, lp - len(r):] = True
        return ids.to(self.device), mask.to(self.device)

    def encode_answers(self, texts: Sequence[str], gen_length: int) -> torch.Tensor:
        """SFT targets: answer tokens (no [BOS]), [EOS], then [EOS] up to `gen_length`
        (truncated to it) -> [B, gen_length] long."""
        fill = self.eos_token_id if self.eos_token_id is not None else self.pad_token_id
        out = torch.full((len(texts), gen_length), fill, dtype=torch.long)
        for b, t in enumerate(texts):
            r = self.tokenizer(t, add_special_tokens=False)["input_ids"][:gen_length]
            if r:
                out[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        return out.to(self.device)

    def decode(self, sequences: torch.Tensor, prompt_len: int) -> list[str]:
        """Completion text of each row of `sequences` [B, Lp + Lg] (from `prompt_len` on),
        stopping at the first [EOS] or [PAD]; other special tokens are dropped."""
        comp = sequences[:, prompt_len:].detach().cpu()                     # [B, Lg]
        stop = comp == self.pad_token_id
        if self.eos_token_id is not None:
            stop |= comp == self.eos_token_id
        keep = stop.long().cumsum(dim=1) == 0                               # before the first stop
        rows = [c[k].tolist() for c, k in zip(comp, keep)]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)

    @torch.no_grad()
    def generate_text(self, texts: Sequence[str], gen_length: int, steps: int,
                      temperature: float = 0.0, generator: torch.Generator | None = None,
                      max_prompt_len: int | None = None, sampler: str = "gumbel_topk") -> list[str]:
        """Prompts in, completions out (encode -> :func:`generate` -> decode)."""
        ids, mask = self.encode_prompts(texts, max_prompt_len)
        seqs = generate(self.model, ids, mask, gen_length, steps, temperature,
                        self.mask_token_id, generator, sampler=sampler)
        return self.decode(seqs, ids.shape[1])

    def save(self, path: str | os.PathLike) -> None:
        """``save_pretrained`` of model and tokenizer into `path` (loadable as ``model_cfg.path``).

        A peft model writes its adapter; when its base has no directory of its own (the offline
        default built in memory) the base is saved too, under ``path/base_model``.
        """
        path = str(path)
        os.makedirs(path, exist_ok=True)
        model = self.model
        if hasattr(model, "peft_config"):
            base = model.get_base_model()
            home = getattr(base.config, "name_or_path", "") or ""
            # built in memory, or loaded from a directory that is gone (a temp dir): save it
            if not home or (os.path.isabs(home) and not os.path.isdir(home)):
                base_dir = os.path.abspath(os.path.join(path, "base_model"))
                # the base's own weights: LoRA layers wrap them as `<name>.base_layer`
                clean = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items()
                         if "lora_" not in k}
                base.save_pretrained(base_dir, state_dict=clean)
                self.tokenizer.save_pretrained(base_dir)
                for cfg in model.peft_config.values():
                    cfg.base_model_name_or_path = base_dir
            # the KL reference's frozen adapter copy is not part of the policy
            names = [n for n in model.peft_config if n != REFERENCE_ADAPTER]
            model.save_pretrained(path, selected_adapters=names)
        else:
            model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


# --------------------------------------------------------------------------- KL reference

#: the name of the frozen adapter copy that :class:`KLReference` adds to a trained loaded adapter
REFERENCE_ADAPTER = "kl_reference"


class KLReference:
    """The reference policy pi_ref of the KL penalty: ``model`` as it is when this is made (the
    SFT model), frozen. ``with ref.model() as m:`` gives a module whose forward is pi_ref's; run it
    under ``no_grad``. Three cases, chosen by what ``model`` is:

    * ``"adapters_disabled"``: a peft LoRA model whose adapter is still a no-op (every
      ``lora_B`` is zero: a fresh RL adapter on the SFT weights). pi_ref is the base with the
      adapters switched off (peft's ``disable_adapter``, as TRL and verl do): no extra memory.
    * ``"adapter_copy"``: a peft LoRA model that trains a loaded (SFT) adapter. The adapter is
      copied, frozen, as a second named adapter (:data:`REFERENCE_ADAPTER`) on the same base and
      switched in for the reference's forward (``set_adapter``): one more adapter, not a base.
    * ``"copy"``: no adapters (the small offline model, full fine-tuning): a frozen deep copy.

    Switching adapters leaves every parameter's ``requires_grad`` as it was.
    """

    def __init__(self, model: nn.Module):
        self.policy = model
        self._copy: nn.Module | None = None
        if not hasattr(model, "peft_config"):
            self.kind, self._copy = "copy", frozen_copy(model)
            return
        name = model.active_adapter
        if model.peft_config[name].peft_type != "LORA":               # (a str enum)
            self.kind, self._copy = "copy", frozen_copy(model)         # other peft methods
            return
        self.adapter = name
        lora_b = [p for n, p in model.named_parameters() if f".lora_B.{name}." in n]
        if lora_b and not any(bool(p.detach().any()) for p in lora_b):
            self.kind = "adapters_disabled"
            return
        import copy

        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        model.add_adapter(REFERENCE_ADAPTER, copy.deepcopy(model.peft_config[name]))
        set_peft_model_state_dict(model, get_peft_model_state_dict(model, adapter_name=name),
                                  adapter_name=REFERENCE_ADAPTER)
        model.set_adapter(name)
        for n, p in model.named_parameters():
            p.requires_grad_(flags.get(n, False))                    # the copy: frozen
        self.kind = "adapter_copy"

    @contextlib.contextmanager
    def model(self):
        """The module to run pi_ref with (under ``no_grad``)."""
        if self._copy is not None:
            yield self._copy
        elif self.kind == "adapters_disabled":
            with self.policy.disable_adapter():
                yield self.policy
        else:
            flags = [(p, p.requires_grad) for p in self.policy.parameters()]
            self.policy.set_adapter(REFERENCE_ADAPTER)
            try:
                yield self.policy
            finally:
                self.policy.set_adapter(self.adapter)
                for p, flag in flags:
                    p.requires_grad_(flag)

    def extra_parameters(self) -> int:
        """Parameters pi_ref holds beyond the policy's own (the memory it costs)."""
        if self._copy is not None:
            return sum(p.numel() for p in self._copy.parameters())
        return sum(p.numel() for n, p in self.policy.named_parameters() if f".{REFERENCE_ADAPTER}." in n)


# --------------------------------------------------------------------------- building

def build_masked_lm(model_cfg: Mapping | Any, tokenizer: Any = None, seed: int | None = 0,
                    device: torch.device | str | None = None,
                    prefix: str = "algo.model") -> MaskedDiffusionLM:
    """Build the policy from `model_cfg` (keys: :data:`DEFAULT_MODEL_CFG`).

    tokenizer: overrides ``tokenizer_path`` (e.g. one just trained with ``train_tokenizer``).
    seed: initialises the offline default's weights (without touching the global RNG).
    device: where the model goes (4-bit models are placed by bitsandbytes on the current GPU).
    """
    cfg = validate_model_cfg(model_cfg, prefix)
    if cfg["load_in_4bit"]:
        _check_4bit_available(prefix)

    if cfg["path"] is None:
        tokenizer = tokenizer if tokenizer is not None else _default_tokenizer(cfg, prefix)
        mask_id = _resolve_mask_id(cfg, tokenizer, None, prefix)
        model = _build_default_model(cfg, tokenizer, mask_id, seed)
        if cfg["load_in_4bit"]:            # quantise through from_pretrained (bitsandbytes)
            with tempfile.TemporaryDirectory() as tmp:
                model.save_pretrained(tmp)
                model = _load_pretrained(tmp, cfg, prefix)
    else:
        model, tokenizer = _load_checkpoint(cfg, tokenizer, prefix)
        mask_id = _resolve_mask_id(cfg, tokenizer, model, prefix)

    vocab = model.get_input_embeddings().weight.shape[0]
    if mask_id >= vocab:
        raise _err(prefix, "mask_token_id", f"{mask_id} is outside the model's vocabulary ({vocab})")
    model.config.mask_token_id = mask_id     # read by masked_lm_logits: [MASK] never proposed
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False

    if cfg["load_in_4bit"] and not torch.cuda.is_available():
        # bitsandbytes repacks a CPU layer's weights for speed on its first eval-mode forward
        # without gradients (sampling), into a layout whose matmul has no backward: the update
        # after it would get zero gradients. Keep the layout that trains.
        for m in model.modules():
            if hasattr(m, "support_avx512bf16_for_cpu"):
                m.support_avx512bf16_for_cpu = False
    if cfg["load_in_4bit"] and not hasattr(model, "peft_config"):   # (adapters: done on the base)
        from peft import prepare_model_for_kbit_training
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg["lora"] is not None and not hasattr(model, "peft_config"):
        from peft import LoraConfig, get_peft_model
        lora = cfg["lora"]
        model = get_peft_model(model, LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=float(lora["dropout"]),
            target_modules=list(lora["target_modules"]) if lora["target_modules"] else None,
            task_type="CAUSAL_LM"))
    if device is not None and not cfg["load_in_4bit"]:
        model.to(device)
    model.eval()

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise _err(prefix, "tokenizer_path", "the tokenizer has neither a pad nor an eos token")
    return MaskedDiffusionLM(model=model, tokenizer=tokenizer, mask_token_id=mask_id,
                             pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id,
                             max_len=cfg["max_len"])


def load_sft_checkpoint(path: str | os.PathLike, model_cfg: Mapping | Any, tokenizer: Any = None,
                        device: torch.device | str | None = None, prefix: str = "algo.model",
                        sft_key: str = "algo.sft_checkpoint") -> MaskedDiffusionLM:
    """The model that :meth:`MaskedDiffusionLM.save` wrote (e.g. after :func:`fit_sft`), with the
    switches of `model_cfg` (``trust_remote_code``, ``mask_token_id``, ``lora``,
    ``load_in_4bit``, ``dtype``); architecture and tokenizer come from the checkpoint.
    A LoRA adapter checkpoint stays trainable only when `model_cfg` sets ``lora``."""
    if not os.path.isdir(path):
        raise ConfigError(f"config key '{sft_key}': no checkpoint directory at {str(path)!r}")
    cfg = validate_model_cfg(model_cfg, prefix)
    return build_masked_lm({**cfg, "path": str(path), "tokenizer_path": None}, tokenizer=tokenizer,
                           device=device, prefix=prefix)


def _default_tokenizer(cfg: dict, prefix: str):
    from flowrl_ray.models.text_tokenizer import load_tokenizer
    path = cfg["tokenizer_path"]
    if path is None:
        raise _err(prefix, "tokenizer_path", "the offline default model needs a tokenizer "
                   "directory (make one with flowrl_ray.models.text_tokenizer.train_tokenizer"
                   "(texts, vocab_size, path)) or a checkpoint in 'path'")
    if not os.path.isdir(path):
        raise _err(prefix, "tokenizer_path", f"no tokenizer directory at {path!r}")
    return load_tokenizer(path)


def _resolve_mask_id(cfg: dict, tokenizer, model, prefix: str) -> int:
    for mid in (cfg["mask_token_id"], getattr(tokenizer, "mask_token_id", None),
                getattr(getattr(model, "config", None), "mask_token_id", None)):
        if mid is not None:
            return int(mid)
    raise _err(prefix, "mask_token_id", "neither the config, the tokenizer nor the model config "
               "names a mask token; set it (e.g. 126336 for LLaDA)")


def _build_default_model(cfg: dict, tokenizer, mask_id: int, seed: int | None) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_layers"],
        num_attention_heads=cfg["num_heads"], num_key_value_heads=cfg["num_heads"],
        max_position_embeddings=cfg["max_len"], rms_norm_eps=1e-6, tie_word_embeddings=cfg["tie_embeddings"],
        attention_dropout=0.0, use_cache=False, is_causal=False, mask_token_id=mask_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def _load_pretrained(path: str, cfg: dict, prefix: str) -> nn.Module:
    """AutoModelForCausalLM (AutoModel for checkpoints that only register that, e.g. LLaDA)."""
    from transformers import AutoModel, AutoModelForCausalLM
    kwargs: dict[str, Any] = {"trust_remote_code": cfg["trust_remote_code"],
                              "dtype": DTYPES.get(cfg["dtype"], "auto")}
    if cfg["path"] is None:
        kwargs["dtype"] = torch.float32
    if cfg["load_in_4bit"]:
        from transformers import BitsAndBytesConfig
        if torch.cuda.is_available():
            compute = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
            place: Any = torch.cuda.current_device()
        else:                                  # bitsandbytes' CPU path: float32 compute
            compute, place = torch.float32, "cpu"
        kwargs.update(dtype=compute, device_map={"": place},
                      quantization_config=BitsAndBytesConfig(
                          load_in_4bit=True, bnb_4bit_quant_type="nf4",
                          bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute))
    try:
        try:
            return AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except ValueError as first:           # config class not registered for this auto class
            try:
                return AutoModel.from_pretrained(path, **kwargs)
            except Exception:
                raise first from None
    except (OSError, ValueError) as e:
        raise _err(prefix, "path", f"cannot load a model from {path!r}: {e}") from e


def _load_checkpoint(cfg: dict, tokenizer, prefix: str):
    """(model, tokenizer) from ``cfg['path']``: a full checkpoint or a peft adapter directory."""
    from flowrl_ray.models.text_tokenizer import load_tokenizer
    path = str(cfg["path"])
    adapter_cfg = os.path.join(path, "adapter_config.json")
    if os.path.isfile(adapter_cfg):
        from peft import PeftModel
        with open(adapter_cfg) as f:
            base_path = json.load(f).get("base_model_name_or_path")
        if not base_path:
            raise _err(prefix, "path", f"the adapter in {path!r} names no base model")
        base = _load_pretrained(base_path, cfg, prefix)
        if cfg["load_in_4bit"]:
            from peft import prepare_model_for_kbit_training
            base = prepare_model_for_kbit_training(
                base, use_gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": False})
        # trainable adapter when the config asks for LoRA (its r/alpha are the adapter's own)
        model = PeftModel.from_pretrained(base, path, is_trainable=cfg["lora"] is not None)
    else:
        model = _load_pretrained(path, cfg, prefix)
    if tokenizer is None:
        tok_path = cfg["tokenizer_path"] or path
        try:
            tokenizer = load_tokenizer(tok_path, trust_remote_code=cfg["trust_remote_code"])
        except (OSError, ValueError) as e:
            key = "tokenizer_path" if cfg["tokenizer_path"] else "path"
            raise _err(prefix, key, f"cannot load a tokenizer from {tok_path!r}: {e}") from e
    return model, tokenizer


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


def masked_lm_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     start: int = 0) -> torch.Tensor:
    """Float32 logits [B, L - start, V] of positions ``start..L-1``; the mask token's logit is
    -inf (never proposed). input_ids [B, L] long, attention_mask [B, L] bool."""
    if _wants_full_mask(model):
        dtype = model.get_input_embeddings().weight.dtype
        am = full_attention_bias(attention_mask, dtype if dtype.is_floating_point else torch.float32)
    else:
        am = attention_mask.long()
    out = model(input_ids=input_ids, attention_mask=am)
    raw = (out.logits if hasattr(out, "logits") else out[0])[:, start:]   # [B, L - start, V]
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
        logits = masked_lm_logits(model, x, attn, start=lp)                  # [B, Lg, V]
        if temperature > 0:
            cand = (logits / temperature + _gumbel(logits.shape, generator, device)).argmax(-1)
        else:
            cand = logits.argmax(-1)                                          # [B, Lg]
        cand_logp = _token_log_probs(logits, cand, temperature)               # [B, Lg]
        if k is None:                                                         # final fill
            new = masked.clone()
        else:
            if sampler == "confidence_topk":                  # untempered p(a_i), no noise
                score = _token_log_probs(logits, cand, 0.0)
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
    cols = unmasked.any(dim=0).nonzero()
    start = int(cols[0, 0]) if cols.numel() else state.shape[1] - 1
    logits = masked_lm_logits(model, state, attention_mask, start=start)     # [B, L - start, V]
    lp = _token_log_probs(logits, tokens[:, start:], temperature).double()    # [B, L - start]
    lp = torch.where(unmasked[:, start:], lp, 0.0)
    return F.pad(lp, (start, 0))                                              # [B, L]


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
    logits = masked_lm_logits(model, x, attn, start=lp)                                 # [B, La, V]
    nll = F.cross_entropy(logits[masked], answer_ids[masked], reduction="none")        # [M]
    weight = 1.0 / (t[:, None] * answer_mask.sum(-1, keepdim=True).clamp(min=1))        # [B, 1]
    return (nll * weight.expand_as(masked)[masked]).sum() / b


def fit_sft(policy: MaskedDiffusionLM, pairs: Sequence[tuple[str, str]], epochs: int | None,
            batch_size: int, lr: float, gen_length: int | None = None,
            max_prompt_len: int | None = None, seed: int = 0, grad_clip: float | None = 1.0,
            weight_decay: float = 0.0, progress: bool = False, steps: int | None = None,
            warmup_steps: int = 0, lr_schedule: str = "constant", min_lr_ratio: float = 0.0
            ) -> list[float]:
    """Masked-diffusion SFT on (instruction, gold answer text) pairs with AdamW on the
    trainable parameters (all, or the LoRA adapters).

    The budget is ``epochs`` passes over the pairs or, when ``steps`` is given (then ``epochs``
    must be None), that many optimiser steps over reshuffled passes. The learning rate follows
    ``lr_multiplier(lr_schedule, total steps, warmup_steps, min_lr_ratio)``.
    gen_length: the completion region (answers are padded with [EOS] up to it; generate with the
    same value); default: the longest answer + 1. Returns the loss of every optimiser step
    (NaN where a non-finite loss or gradient skipped the update). Leaves the model in eval mode.
    """
    from flowrl_ray.optim import lr_multiplier, minibatches, optimizer_step   # as in the RL updates

    if not pairs:
        raise ValueError("fit_sft needs at least one (prompt, answer) pair")
    if (epochs is None) == (steps is None):
        raise ValueError(f"fit_sft takes either epochs or steps, got epochs={epochs}, steps={steps}")
    prompts = [p for p, _ in pairs]
    answers = [a for _, a in pairs]
    if gen_length is None:
        gen_length = 1 + max(len(policy.tokenizer(a, add_special_tokens=False)["input_ids"])
                             for a in answers)
    ids, pmask = policy.encode_prompts(prompts, max_prompt_len)                # [N, Lp]
    ans = policy.encode_answers(answers, gen_length)                          # [N, Lg]
    amask = torch.ones_like(ans, dtype=torch.bool)
    n = len(pairs)
    steps_per_epoch = math.ceil(n / batch_size)
    total = steps if steps is not None else epochs * steps_per_epoch
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_multiplier(lr_schedule, total, warmup_steps, min_lr_ratio))
    gen = torch.Generator().manual_seed(seed)
    losses, skipped, start = [], 0, time.perf_counter()
    policy.model.train()
    try:
        while len(losses) < total:
            for idx in minibatches(n, batch_size, gen, ids.device):
                if len(losses) == total:
                    break
                keep = pmask[idx].any(dim=0)                                  # drop all-pad columns
                loss = sft_loss(policy.model, ids[idx][:, keep], pmask[idx][:, keep], ans[idx],
                                amask[idx], policy.mask_token_id, gen)
                _, ok = optimizer_step(loss, opt, grad_clip)       # a non-finite one: skipped
                skipped += not ok
                losses.append(loss.item() if ok else float("nan"))
                sched.step()
                done = len(losses)
                if progress and (done % steps_per_epoch == 0 or done == total):
                    elapsed = time.perf_counter() - start
                    recent = [v for v in losses[-steps_per_epoch:] if math.isfinite(v)]
                    mean = sum(recent) / len(recent) if recent else float("nan")
                    eta = elapsed / done * (total - done)
                    print(f"[sft] step {done}/{total} (epoch {done / steps_per_epoch:.1f}) loss "
                          f"{mean:.4f} lr {sched.get_last_lr()[0]:.2e} skipped {skipped} "
                          f"({elapsed:.1f}s, eta {eta:.1f}s)", flush=True)
    finally:
        policy.model.eval()
    return losses
