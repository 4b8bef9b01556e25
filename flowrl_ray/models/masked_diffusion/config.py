"""The masked-diffusion LM's `algo.model` schema (:class:`MaskedLMConfig`) and its checks:
every key validated before anything loads, errors naming the key."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch

from flowrl_ray.config import ConfigError, check, check_known_keys


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


