"""Masked-diffusion LM: tokenizer, bidirectional model, sampler + trajectory, step log-probs, SFT,
HF save/load, LoRA and 4-bit switches, config errors. Tiny models only (hidden 64, 2 layers)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from flowrl_ray.config import ConfigError  # noqa: E402
from flowrl_ray.models import masked_diffusion as md  # noqa: E402
from flowrl_ray.pretrain.text_sft import fit_sft  # noqa: E402
from flowrl_ray.models.text_tokenizer import load_tokenizer, train_tokenizer  # noqa: E402

PAIRS = [
    ("Fill the name field with Ann", 'type(name, "Ann")'),
    ("Fill the city field with Oslo", 'type(city, "Oslo")'),
    ("Press the submit button", "click(submit)"),
]
CORPUS = [t for pair in PAIRS for t in pair] * 4 + ["select(country, Norway)", "check(terms)"]
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128,
        "max_len": 64}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(CORPUS, vocab_size=320, path=path)
    return str(path)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def lm(tok_dir):
    return md.build_masked_lm({**TINY, "tokenizer_path": tok_dir}, seed=0)


def prompts(lm, texts=("Fill the name field with Ann", "Press submit", "x")):
    return lm.encode_prompts(list(texts))


# --------------------------------------------------------------------------- tokenizer

def test_tokenizer_round_trip_with_mask(tmp_path):
    tok = train_tokenizer(iter(CORPUS), vocab_size=300, path=tmp_path)
    assert [tok.convert_tokens_to_ids(t) for t in ["[PAD]", "[MASK]", "[BOS]", "[EOS]", "[UNK]"]] \
        == [0, 1, 2, 3, 4]
    assert tok.mask_token_id == 1 and tok.pad_token_id == 0 and len(tok) <= 300
    text = 'type(name, "Åsa 😀") [MASK] click(x)'
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.mask_token_id in ids and tok.unk_token_id not in ids
    assert tok.decode(ids[1:]) == text
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("[MASK]", "")
    again = load_tokenizer(tmp_path)
    assert again(text)["input_ids"] == ids and again.mask_token_id == 1
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=100)


def test_encode_prompts_left_pads_and_decode_stops(lm):
    ids, mask = lm.encode_prompts(["Press the submit button", "x"])
    assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape
    assert mask[0].all() and not mask[1, 0] and mask[1, -1]            # left padding
    assert (ids[~mask] == lm.pad_token_id).all() and ids[0, 0] == lm.tokenizer.bos_token_id
    ans = lm.encode_answers(["click(submit)"], gen_length=12)            # answer, EOS, EOS...
    seq = torch.cat([ids[:1], ans], dim=1)
    seq[0, -1] = lm.tokenizer.convert_tokens_to_ids("c")                 # after EOS: ignored
    assert lm.decode(seq, ids.shape[1]) == ["click(submit)"]
    seq[0, ids.shape[1] + 1] = lm.pad_token_id                           # PAD stops too
    assert len(lm.decode(seq, ids.shape[1])[0]) < len("click(submit)")


# --------------------------------------------------------------------------- model

def test_default_model_is_bidirectional_and_ignores_padding(lm):
    assert lm.model.config.is_causal is False and md.sampling._wants_full_mask(lm.model)
    ids = torch.randint(5, len(lm.tokenizer), (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)                           # no padding at all
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1 - 5) % (len(lm.tokenizer) - 5) + 5
    with torch.no_grad():
        a = md.masked_lm_logits(lm.model, ids, mask)
        b = md.masked_lm_logits(lm.model, changed, mask)
    assert (a[:, 0] - b[:, 0]).nan_to_num().abs().max() > 1e-4         # a later token moves pos 0
    assert torch.isinf(a[..., lm.mask_token_id]).all()                   # [MASK] never proposed
    # padded keys are invisible: changing a pad token changes nothing at real positions
    mask[0, :3] = False
    padded = ids.clone()
    padded[0, :3] = 7
    with torch.no_grad():
        c = md.masked_lm_logits(lm.model, ids, mask)
        d = md.masked_lm_logits(lm.model, padded, mask)
    torch.testing.assert_close(c[0, 3:], d[0, 3:])
    assert sum(p.numel() for p in lm.model.parameters()) < 200_000


def test_one_schema_the_offline_default_a_config_gets_is_about_a_million(tok_dir):
    """A plain mapping is completed from the config's own schema: what `algo.model` gives when a
    key is left out is what a mapping without it gives (the defaults once disagreed)."""
    from flowrl_ray.algorithms.flow_grpo import FlowGRPOConfig
    cfg = md.validate_model_cfg({"tokenizer_path": tok_dir})
    from_config = md.validate_model_cfg(FlowGRPOConfig().model)
    assert {k: v for k, v in cfg.items() if k != "tokenizer_path"} == \
        {k: v for k, v in from_config.items() if k != "tokenizer_path"}
    with torch.device("meta"):
        model = md.model._build_default_model(cfg, load_tokenizer(tok_dir), 1, None)
    n = sum(p.numel() for p in model.parameters())
    assert 0.5e6 < n < 3e6
    assert all(d % 32 == 0 for d in (cfg["hidden_size"], cfg["intermediate_size"]))


# --------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("gen_length,steps,ks", [(7, 3, [3, 2, 2]), (4, 10, [1, 1, 1, 1]),
                                                 (6, 6, [1] * 6)])
def test_generation_trajectory_shapes_and_schedule(lm, gen_length, steps, ks):
    ids, mask = prompts(lm)
    b, lp = ids.shape
    g = torch.Generator().manual_seed(0)
    seqs, traj = md.generate_with_trajectory(lm.model, ids, mask, gen_length, steps, 1.0,
                                             lm.mask_token_id, g)
    s, l = len(ks), lp + gen_length
    assert md.unmask_schedule(gen_length, steps) == ks
    assert seqs.shape == (b, l) and seqs.dtype == torch.long
    assert traj["states"].shape == traj["tokens"].shape == traj["unmasked"].shape == (s, b, l)
    assert traj["attention_mask"].shape == (b, l) and traj["logp"].shape == (s, b)
    assert traj["prompt_len"] == lp
    # every completion position unmasked exactly once, never a prompt position
    count = traj["unmasked"].sum(0)
    assert (count[:, lp:] == 1).all() and (count[:, :lp] == 0).all()
    assert traj["unmasked"][:, :, lp:].sum(-1).tolist() == [[k] * b for k in ks]
    # states: all [MASK] at first; each step places its tokens; the last one is the output
    assert (traj["states"][0, :, lp:] == lm.mask_token_id).all()
    for i in range(s):
        u = traj["unmasked"][i]
        assert (traj["states"][i][u] == lm.mask_token_id).all()
        assert (traj["tokens"][i][u] != lm.mask_token_id).all()
        if i + 1 < s:
            torch.testing.assert_close(traj["states"][i + 1], traj["tokens"][i])
        assert (traj["states"][i][~u] == traj["tokens"][i][~u]).all()
    torch.testing.assert_close(traj["tokens"][-1], seqs)
    assert (seqs[:, :lp] == ids).all() and not (seqs == lm.mask_token_id).any()
    assert torch.isfinite(traj["logp"]).all() and (traj["logp"] <= 0).all()


def test_greedy_is_deterministic_and_sampling_reproducible(lm):
    ids, mask = prompts(lm)
    run = lambda t, g: md.generate(lm.model, ids, mask, 8, 4, t, lm.mask_token_id, g)  # noqa: E731
    greedy = run(0.0, torch.Generator().manual_seed(1))
    assert torch.equal(greedy, run(0.0, torch.Generator().manual_seed(2)))
    assert torch.equal(greedy, run(0.0, None))
    a = run(1.0, torch.Generator().manual_seed(3))
    assert torch.equal(a, run(1.0, torch.Generator().manual_seed(3)))
    assert not torch.equal(a, run(1.0, torch.Generator().manual_seed(4)))
    assert not (a == lm.mask_token_id).any()
    # generate and generate_with_trajectory draw the same randomness
    seq, _ = md.generate_with_trajectory(lm.model, ids, mask, 8, 4, 1.0, lm.mask_token_id,
                                         torch.Generator().manual_seed(3))
    assert torch.equal(a, seq)


def test_mask_id_must_match_model_config(lm):
    ids, mask = prompts(lm)
    with pytest.raises(ValueError, match="mask_token_id"):
        md.generate(lm.model, ids, mask, 4, 2, 0.0, lm.mask_token_id + 1)


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_recorded_log_probs_equal_recomputation(lm, temperature):
    ids, mask = prompts(lm)
    _, traj = md.generate_with_trajectory(lm.model, ids, mask, 9, 4, temperature,
                                          lm.mask_token_id, torch.Generator().manual_seed(5))
    again = md.trajectory_log_probs(lm.model, traj, temperature)        # [S, B]
    assert again.shape == traj["logp"].shape
    torch.testing.assert_close(again, traj["logp"], atol=1e-5, rtol=0)
    # by hand for one step: sum of log softmax(logits / tau) at the unmasked positions
    s, tau = 1, temperature if temperature > 0 else 1.0
    with torch.no_grad():
        logits = md.masked_lm_logits(lm.model, traj["states"][s], traj["attention_mask"])
    logp = torch.log_softmax(logits / tau, -1).gather(-1, traj["tokens"][s][..., None])[..., 0]
    manual = torch.where(traj["unmasked"][s], logp, 0.0).sum(-1)
    torch.testing.assert_close(again[s], manual, atol=1e-5, rtol=0)
    # steps flattened into the batch give the same numbers (batch-agnostic)
    S, B, L = traj["states"].shape
    flat = md.step_log_prob(lm.model, traj["states"].reshape(S * B, L),
                            traj["attention_mask"].repeat(S, 1),
                            traj["unmasked"].reshape(S * B, L), traj["tokens"].reshape(S * B, L),
                            temperature)
    torch.testing.assert_close(flat.view(S, B), traj["logp"], atol=1e-5, rtol=0)


def test_step_token_log_probs_are_the_terms_of_the_step_log_prob(lm):
    """Per position: log softmax(logits / tau)[token] where the step unmasked, exactly 0 elsewhere,
    and their float64 sum is the step's log-prob."""
    ids, mask = prompts(lm)
    _, traj = md.generate_with_trajectory(lm.model, ids, mask, 6, 3, 1.0, lm.mask_token_id,
                                          torch.Generator().manual_seed(0))
    s, tau = 1, 0.7
    args = (lm.model, traj["states"][s], traj["attention_mask"], traj["unmasked"][s], traj["tokens"][s])
    with torch.no_grad():
        tok = md.step_token_log_probs64(*args, tau)                               # [B, L]
        logits = md.masked_lm_logits(lm.model, traj["states"][s], traj["attention_mask"])
    unmasked = traj["unmasked"][s]
    assert tok.dtype == torch.float64 and tok.shape == unmasked.shape
    assert (tok[~unmasked] == 0).all() and (tok[unmasked] < 0).all()
    b, i = unmasked.nonzero()[0].tolist()
    by_hand = torch.log_softmax(logits[b, i] / tau, -1)[traj["tokens"][s][b, i]]
    assert float(tok[b, i]) == pytest.approx(float(by_hand), abs=1e-5)
    assert torch.allclose(tok.sum(-1), md.step_log_prob64(*args, tau), rtol=0, atol=1e-12)
    assert torch.allclose(tok.sum(-1).float(), md.step_log_prob(*args, tau), atol=1e-4)


def test_step_log_prob_has_gradients(lm):
    ids, mask = prompts(lm)
    _, traj = md.generate_with_trajectory(lm.model, ids, mask, 6, 3, 1.0, lm.mask_token_id,
                                          torch.Generator().manual_seed(0))
    lm.model.zero_grad()
    lp = md.step_log_prob(lm.model, traj["states"][1], traj["attention_mask"],
                          traj["unmasked"][1], traj["tokens"][1], 1.0)
    assert lp.shape == (ids.shape[0],) and lp.requires_grad
    lp.sum().backward()
    grads = {n: p.grad for n, p in lm.model.named_parameters()}
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight     # tied: one matrix
    assert "lm_head.weight" not in grads
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    assert grads["model.embed_tokens.weight"].abs().sum() > 0
    lm.model.zero_grad()
    # a small step along the gradient raises the log-prob (weights restored exactly after)
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    with torch.no_grad():
        for n, p in lm.model.named_parameters():
            if grads[n] is not None:
                p.add_(1e-3 * grads[n])
        up = md.step_log_prob(lm.model, traj["states"][1], traj["attention_mask"],
                              traj["unmasked"][1], traj["tokens"][1], 1.0)
        for n, p in lm.model.named_parameters():
            p.copy_(before[n])
    assert up.sum() > lp.sum()


# --------------------------------------------------------------------------- SFT

class UniformLM(nn.Module):
    """Logits 0 everywhere: CE = log V at every masked position."""

    def __init__(self, vocab: int, mask_id: int):
        super().__init__()
        self.vocab = vocab
        self.config = SimpleNamespace(mask_token_id=mask_id)
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.w + torch.zeros(*input_ids.shape, self.vocab))


def test_sft_loss_matches_hand_computation():
    v, mask_id = 11, 1
    model = UniformLM(v, mask_id)
    prompt = torch.tensor([[0, 5, 6], [7, 8, 9]])
    pmask = prompt != 0
    answer = torch.tensor([[2, 3, 4, 5], [6, 7, 3, 3]])
    amask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    loss = md.sft_loss(model, prompt, pmask, answer, amask, mask_id,
                                    torch.Generator().manual_seed(0))
    # replay the generator: t per row, then the Bernoulli(t) masks
    g = torch.Generator().manual_seed(0)
    t = md.SFT_T_EPS + (1 - md.SFT_T_EPS) * torch.rand(2, generator=g)
    masked = (torch.rand(2, 4, generator=g) < t[:, None]) & amask
    logv = math.log(v - 1)                             # [MASK] is excluded from the softmax
    expected = sum(masked[b].sum() * logv / (t[b] * amask[b].sum()) for b in range(2)) / 2
    torch.testing.assert_close(loss, expected.float())
    assert loss.requires_grad


def test_sft_step_budget_follows_warmup_then_cosine(tok_dir, monkeypatch):
    policy = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir}, seed=1)
    seen = []
    step = torch.optim.AdamW.step

    def recording_step(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    # 6 steps over 2 pairs with batch 1: three reshuffled passes
    losses = fit_sft(policy, PAIRS[:2], epochs=None, steps=6, batch_size=1, lr=1e-2,
                        gen_length=12, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    # warm-up (s + 1) / 2, then 0.1 + 0.9 * (1 + cos(pi * (s - 2) / 4)) / 2
    c = math.cos(math.pi / 4)
    expected = [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + c), 0.55, 0.1 + 0.45 * (1 - c)]
    assert seen == pytest.approx([1e-2 * m for m in expected])
    with pytest.raises(ValueError, match="either epochs or steps"):
        fit_sft(policy, PAIRS, epochs=1, steps=3, batch_size=2, lr=1e-3)
    with pytest.raises(ValueError, match="either epochs or steps"):
        fit_sft(policy, PAIRS, epochs=None, batch_size=2, lr=1e-3)


def test_sft_resumed_from_a_checkpoint_state_ends_where_the_uninterrupted_run_ends(tok_dir):
    """fit_sft stopped after 3 of 7 steps (mid-pass: 3 pairs, batch 2) and continued from the state
    its checkpoint callback received, in a new model holding the step-3 weights, takes the same
    steps: the same losses and, bit for bit, the same final weights as one run of 7 steps."""
    import copy
    kw = dict(epochs=None, steps=7, batch_size=2, lr=1e-2, gen_length=12, warmup_steps=2,
              lr_schedule="cosine", min_lr_ratio=0.1, seed=3)
    whole = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir}, seed=1)
    full = fit_sft(whole, PAIRS, **kw)

    first = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir}, seed=1)
    saved = []
    fit_sft(first, PAIRS, **kw, checkpoint_every=3,
            on_checkpoint=lambda st: saved.append((st, copy.deepcopy(first.model.state_dict()))))
    (state, weights), final = saved[0], saved[-1][0]
    assert state["step"] == 3 and state["position"] == 2 and final["step"] == 7   # mid-pass, and at the end
    second = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir}, seed=5)      # other initial weights
    second.model.load_state_dict(weights)
    resumed = fit_sft(second, PAIRS, **kw, state=state)
    assert resumed == full
    for (name, a), b in zip(whole.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="orders 3 pairs, these are 2"):
        fit_sft(second, PAIRS[:2], **kw, state=state)


def test_sft_stops_after_max_seconds_with_its_state_handed_over(tok_dir):
    policy = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir}, seed=1)
    saved = []
    losses = fit_sft(policy, PAIRS, epochs=None, steps=50, batch_size=1, lr=1e-3, gen_length=12,
                     max_seconds=1e-9, on_checkpoint=saved.append)
    assert len(losses) == 1 and [s["step"] for s in saved] == [1]


# --------------------------------------------------------------------------- HF, LoRA, 4-bit

def _logits(lm, ids, mask):
    with torch.no_grad():
        return md.masked_lm_logits(lm.model, ids, mask)


def test_hf_save_load_round_trip(lm, tmp_path):
    lm.save(tmp_path / "ck")
    again = md.build_masked_lm({"path": str(tmp_path / "ck"), "trust_remote_code": True})
    assert type(again.model).__name__ == "LlamaForCausalLM" and again.model.config.is_causal is False
    assert (again.mask_token_id, again.pad_token_id, again.eos_token_id) == \
        (lm.mask_token_id, lm.pad_token_id, lm.eos_token_id)
    ids, mask = prompts(lm)
    torch.testing.assert_close(_logits(again, ids, mask), _logits(lm, ids, mask))
    assert again.encode_prompts(["Press submit"])[0].tolist() == lm.encode_prompts(["Press submit"])[0].tolist()
    # the SFT-checkpoint loader: architecture and tokenizer from the checkpoint
    sft = md.load_sft_checkpoint(tmp_path / "ck", {**TINY, "hidden_size": 128})
    torch.testing.assert_close(_logits(sft, ids, mask), _logits(lm, ids, mask))
    with pytest.raises(ConfigError, match="'algo.sft_checkpoint'"):
        md.load_sft_checkpoint(tmp_path / "nothing", TINY)
    # mask id from the config wins; one outside the vocabulary is refused
    assert md.build_masked_lm({"path": str(tmp_path / "ck"), "mask_token_id": 4}).mask_token_id == 4
    with pytest.raises(ConfigError, match="'algo.model.mask_token_id'"):
        md.build_masked_lm({"path": str(tmp_path / "ck"), "mask_token_id": 10_000})


def test_lora_switch_trains_only_adapters_and_round_trips(tok_dir, tmp_path):
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    policy = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir, "lora": lora}, seed=0)
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 2 * 2                                   # layers x (q, v) x (A, B)
    assert all(not p.requires_grad for n, p in policy.model.named_parameters() if "lora_" not in n)
    ids, mask = prompts(policy)
    _, traj = md.generate_with_trajectory(policy.model, ids, mask, 6, 3, 1.0,
                                          policy.mask_token_id, torch.Generator().manual_seed(0))
    torch.testing.assert_close(md.trajectory_log_probs(policy.model, traj, 1.0), traj["logp"],
                               atol=1e-5, rtol=0)
    md.step_log_prob(policy.model, traj["states"][0], traj["attention_mask"], traj["unmasked"][0],
                     traj["tokens"][0]).sum().backward()
    assert all(p.grad is not None for p in policy.trainable_parameters())
    with torch.no_grad():                                       # make the adapter non-trivial
        for p in policy.trainable_parameters():
            p.add_(0.05)
    policy.save(tmp_path / "adapter")                           # adapter + the in-memory base
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    again = md.build_masked_lm({"path": str(tmp_path / "adapter"), "lora": lora})
    torch.testing.assert_close(_logits(again, ids, mask), _logits(policy, ids, mask))
    assert again.trainable_parameters() and all(
        "lora_" in n for n, p in again.model.named_parameters() if p.requires_grad)


def test_4bit_switch_errors_clearly_without_bitsandbytes(tok_dir, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_bitsandbytes(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bitsandbytes)
    cfg = {**TINY, "tokenizer_path": tok_dir, "load_in_4bit": True, "lora": {"r": 4}}
    with pytest.raises(ConfigError, match=r"'algo.model.load_in_4bit'.*bitsandbytes"):
        md.build_masked_lm(cfg)
    with pytest.raises(ConfigError, match=r"'algo.model.load_in_4bit'.*lora"):
        md.build_masked_lm({**cfg, "lora": None})
    with pytest.raises(ConfigError, match=r"'algo.model.hidden_size'.*multiple of 32"):
        md.build_masked_lm({**cfg, "hidden_size": 72, "num_heads": 2})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="4-bit QLoRA (bitsandbytes) needs a CUDA GPU")
def test_qlora_4bit_on_cuda_trains_only_adapters(tok_dir):
    bnb = pytest.importorskip("bitsandbytes")
    lora = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    policy = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir, "load_in_4bit": True, "lora": lora},
                                seed=0)
    assert policy.device.type == "cuda"
    quantised = [m for m in policy.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantised) == 2 * 7                  # layers x (q, k, v, o, gate, up, down)
    trainable = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}
    ids, mask = prompts(policy)
    _, traj = md.generate_with_trajectory(policy.model, ids, mask, 6, 3, 1.0,
                                          policy.mask_token_id, torch.Generator().manual_seed(0))
    torch.testing.assert_close(md.trajectory_log_probs(policy.model, traj, 1.0), traj["logp"],
                               atol=1e-3, rtol=0)
    losses = fit_sft(policy, PAIRS, epochs=None, steps=60, batch_size=3, lr=1e-2, seed=0)
    assert sum(losses[-10:]) < sum(losses[:10])
    assert all(not torch.equal(before[n], p) for n, p in trainable.items() if "lora_B" in n)
    assert all(torch.equal(frozen[n], p) for n, p in policy.model.named_parameters() if n in frozen)


@pytest.mark.parametrize("override,key", [
    ({"hidden_size": -1}, "hidden_size"),
    ({"num_layers": 2.5}, "num_layers"),
    ({"num_heads": 3}, "num_heads"),
    ({"load_in_4bit": "yes"}, "load_in_4bit"),
    ({"mask_token_id": -2}, "mask_token_id"),
    ({"lora": {"r": 0}}, "lora.r"),
    ({"lora": {"r": 4, "dropout": 1.5}}, "lora.dropout"),
    ({"lora": {"r": 4, "target_modules": "q_proj"}}, "lora.target_modules"),
    ({"lora": {"rank": 4}}, "lora.rank"),
    ({"hidden_sise": 64}, "hidden_sise"),
    ({"dtype": "float8"}, "dtype"),
    ({"tokenizer_path": None}, "tokenizer_path"),
    ({"tokenizer_path": "/no/such/dir"}, "tokenizer_path"),
    ({"path": "/no/such/checkpoint"}, "path"),
])
def test_model_cfg_errors_name_the_key(tok_dir, override, key):
    cfg = {**TINY, "tokenizer_path": tok_dir, **override}
    with pytest.raises(ConfigError, match=rf"'algo\.model\.{key}'"):
        md.build_masked_lm(cfg)


def test_preflight_check_names_the_key(tok_dir, tmp_path):
    @dataclasses.dataclass
    class ModelCfg:                       # configs may come as dataclasses (asdict)
        path: str | None = None
        tokenizer_path: str | None = tok_dir
        hidden_size: int = 64
        num_heads: int = 2
        vocab_size: int = 2048
        lora: dict | None = None

    cfg = md.check_model_config(ModelCfg())
    assert cfg["hidden_size"] == 64 and cfg["num_layers"] == md.DEFAULT_MODEL_CFG["num_layers"]
    assert md.check_model_config(ModelCfg(tokenizer_path=None), sft_checkpoint=str(tmp_path))
    with pytest.raises(ConfigError, match="'algo.sft_checkpoint'"):
        md.check_model_config(ModelCfg(), sft_checkpoint=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="'algo.model.tokenizer_path'"):
        md.check_model_config(ModelCfg(tokenizer_path=None))
    with pytest.raises(ConfigError, match="'algo.model.path'"):
        md.check_model_config(ModelCfg(path=str(tmp_path / "missing")))
    assert md.check_model_config(ModelCfg(path="GSAI-ML/LLaDA-8B-Instruct"))   # a hub id: at build
    with pytest.raises(ConfigError, match="'algo.model.vocab_size'"):
        md.check_model_config(ModelCfg(vocab_size=100))
    with pytest.raises(ConfigError, match="'algo.model.lora.alpha'"):
        md.check_model_config(ModelCfg(lora={"r": 4, "alpha": -1}))


def test_missing_mask_token_names_the_key(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    tok = train_tokenizer(CORPUS, 300)
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="[EOS]")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    model.save_pretrained(tmp_path)
    bare.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="'algo.model.mask_token_id'"):
        md.build_masked_lm({"path": str(tmp_path)})
    loaded = md.build_masked_lm({"path": str(tmp_path), "mask_token_id": 1})
    assert loaded.mask_token_id == 1 and loaded.pad_token_id == loaded.eos_token_id
