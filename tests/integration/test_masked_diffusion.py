"""Masked-diffusion SFT overfits a few pairs and greedy decoding gives the answers back (300
steps: seconds, more than the unit folder's 2 s). The rest:
tests/unit/models/test_masked_diffusion.py."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from flowrl_ray.models import masked_diffusion as md  # noqa: E402
from flowrl_ray.pretrain.text_sft import fit_sft  # noqa: E402

from unit.models.test_masked_diffusion import PAIRS, TINY, tok_dir  # noqa: E402, F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_sft_overfits_and_greedy_reproduces_the_answer(tok_dir):
    policy = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir}, seed=1)
    gen_length = 12
    # each pair 8 times per batch: 8 masking draws per pair and step
    losses = fit_sft(policy, PAIRS * 8, epochs=300, batch_size=24, lr=2e-3,
                        gen_length=gen_length, seed=0)
    assert len(losses) == 300 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-20:]) / 20 < 0.1 * sum(losses[:20]) / 20
    assert not policy.model.training
    texts = [p for p, _ in PAIRS]
    for steps in (gen_length, 4):
        out = policy.generate_text(texts, gen_length, steps=steps, temperature=0.0)
        assert out == [a for _, a in PAIRS]
