"""A small text tokenizer trained locally with `tokenizers` (no hub download).

Byte-level BPE: every string encodes without [UNK] and decodes back exactly (the byte-level
alphabet is always in the vocabulary, so ``vocab_size >= 256 + 5``). Before the byte-level step the
pre-tokenizer isolates every whitespace character, every punctuation mark and every digit, so a
word is always tokenized the same way whatever surrounds it: a value quoted in a prompt has the
same token ids as the same value in the target action (what a copying policy relies on).
Special tokens, with fixed
ids in this order:

    [PAD]=0  [MASK]=1  [BOS]=2  [EOS]=3  [UNK]=4

Encoding with ``add_special_tokens=True`` prepends [BOS]; [EOS] is appended by whoever builds
answers (the masked-diffusion SFT does). The tokenizer is wrapped in a
``transformers.PreTrainedTokenizerFast``, so the offline default and Hugging Face checkpoints
(ReFusion, LLaDA) share one interface (``tokenizer(text)``, ``batch_decode``, ``save_pretrained``)
and a saved directory loads back with :func:`load_tokenizer` or ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import os
from typing import Iterable

PAD, MASK, BOS, EOS, UNK = "[PAD]", "[MASK]", "[BOS]", "[EOS]", "[UNK]"
SPECIAL_TOKENS = [PAD, MASK, BOS, EOS, UNK]
#: bytes of the byte-level alphabet + the special tokens: the smallest vocabulary possible
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)


def train_tokenizer(texts: Iterable[str], vocab_size: int, path: str | os.PathLike | None = None):
    """Train a byte-level BPE tokenizer on `texts` (any iterator of strings), optionally save it
    to the directory `path`, and return it as a ``PreTrainedTokenizerFast``.

    The vocabulary holds at most `vocab_size` entries (fewer when the corpus has fewer merges
    to learn); ``len(tokenizer)`` is the real size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 byte tokens + "
                         f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = isolating_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(iter(texts), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    tokenizer = _wrap(tok)
    if path is not None:
        save_tokenizer(tokenizer, path)
    return tokenizer


#: one pre-token per whitespace character, punctuation mark or digit; letters group into words
ISOLATE_PATTERN = r"\s|\d|[^\w\s]|_"


def isolating_pre_tokenizer():
    """Split off spaces, punctuation and digits one by one, then map bytes (no regex of its own)."""
    from tokenizers import Regex, pre_tokenizers
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(ISOLATE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, mask_token=MASK,
                                   bos_token=BOS, eos_token=EOS, unk_token=UNK,
                                   padding_side="left")


def save_tokenizer(tokenizer, path: str | os.PathLike) -> None:
    """Write the tokenizer to the directory `path` (``tokenizer.json`` + its config)."""
    os.makedirs(path, exist_ok=True)
    tokenizer.save_pretrained(str(path))


def load_tokenizer(path: str | os.PathLike, trust_remote_code: bool = False):
    """Load a tokenizer directory: one saved by :func:`train_tokenizer` or any Hugging Face one."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
