"""The masked-diffusion LM holder (:class:`MaskedDiffusionLM`), the KL reference without a second
copy of the base, and building / loading (the offline default, a checkpoint or hub id, peft LoRA,
4-bit QLoRA, an SFT checkpoint)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowrl_ray.config import ConfigError
from flowrl_ray.models.masked_diffusion.config import DTYPES, _check_4bit_available, _err, validate_model_cfg
from flowrl_ray.models.masked_diffusion.sampling import generate
from flowrl_ray.utils import frozen_copy


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


def masked_lm_from_packaged(name: str, mask_token: str = "<|mask|>", max_len: int | None = None,
                            dtype: torch.dtype = torch.float32) -> MaskedDiffusionLM:
    """A pretrained causal LM that a package ships (:mod:`flowrl_ray.models.packaged_lm`), made the
    starting point of a masked-diffusion adaptation (Dream / DiffuLLaMA): the same weights with
    full (non-causal) attention and a mask token.

    * ``config.is_causal = False``: :func:`masked_lm_logits` passes the explicit full 4-D mask.
    * ``mask_token``: a token of the vocabulary, or else a new special token whose embedding row
      (and output row, when untied) is the mean of the existing ones (the vocabulary grows by one).
    * Positions predict their own token, the project's convention (LLaDA); Dream's variant that
      keeps the causal model's next-token shift is not built here.

    Before any adaptation the model is not a masked-diffusion model: it is what adaptation would
    start from (its cost per step is what ``benchmarks/forms_packaged_lm_cost.py`` measures)."""
    from flowrl_ray.models.packaged_lm import load_packaged_lm
    lm = load_packaged_lm(name, dtype=dtype)
    model, tokenizer = lm.model, lm.tokenizer
    tokenizer.padding_side = "left"
    vocab = tokenizer.get_vocab()
    if mask_token in vocab:
        mask_id = int(vocab[mask_token])
        if mask_id in (tokenizer.eos_token_id, tokenizer.pad_token_id):
            raise ValueError(f"mask_token {mask_token!r} is the tokenizer's end or padding token")
    else:
        tokenizer.add_special_tokens({"additional_special_tokens": [mask_token]})
        mask_id = tokenizer.convert_tokens_to_ids(mask_token)
        old = model.get_input_embeddings().weight.shape[0]
        if mask_id >= old:                    # a new row, set to the mean of the others (deterministic)
            model.resize_token_embeddings(mask_id + 1, mean_resizing=False)
            with torch.no_grad():
                for layer in {model.get_input_embeddings(), model.get_output_embeddings()} - {None}:
                    layer.weight[old:] = layer.weight[:old].mean(0)
    model.config.is_causal = False
    model.config.mask_token_id = mask_id
    model.config.use_cache = False
    model.eval()
    return MaskedDiffusionLM(model=model, tokenizer=tokenizer, mask_token_id=mask_id,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             max_len=max_len)


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


