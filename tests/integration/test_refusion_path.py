"""A trust_remote_code model directory (as a hub repository ships one) loads, fine-tunes and
trains with Flow-GRPO (seconds, more than the unit folder's 2 s). The rest of the ReFusion path:
tests/unit/models/test_refusion_path.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from flowrl_ray.algorithms.flow_grpo import FlowGRPO  # noqa: E402
from flowrl_ray.config import ConfigError, config_from_dict  # noqa: E402
from flowrl_ray.envs import EnvSpec  # noqa: E402
from flowrl_ray.models import masked_diffusion as md  # noqa: E402
from flowrl_ray.pretrain.text_sft import fit_sft  # noqa: E402

from unit.models.test_refusion_path import PAIRS, _config, _update, tok_dir  # noqa: E402, F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------- trust_remote_code

CONFIG_PY = '''
from transformers import PretrainedConfig


class TinyMDMConfig(PretrainedConfig):
    model_type = "tiny_mdm"

    def __init__(self, vocab_size=320, hidden_size=32, num_layers=1, max_positions=160,
                 mask_token_id=None, **kwargs):
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden_size, num_layers
        self.max_positions, self.mask_token_id = max_positions, mask_token_id
        super().__init__(**kwargs)
'''

MODELING_PY = '''
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tiny_mdm import TinyMDMConfig


class TinyMDM(PreTrainedModel):
    """A bidirectional masked-diffusion LM in the remote-code style of LLaDA / ReFusion: it takes
    the 2-D padding mask and does its own (non-causal) attention."""
    config_class = TinyMDMConfig

    def __init__(self, config):
        super().__init__(config)
        h = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, h)
        self.pos = nn.Embedding(config.max_positions, h)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(h, nhead=2, dim_feedforward=2 * h, dropout=0.0, batch_first=True)
            for _ in range(config.num_layers))
        self.head = nn.Linear(h, config.vocab_size)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, attention_mask=None, **kwargs):
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        pad = None if attention_mask is None else ~attention_mask.bool()
        for block in self.blocks:
            x = block(x, src_key_padding_mask=pad)
        return CausalLMOutput(logits=self.head(x))
'''


@pytest.fixture(scope="module")
def remote_dir(tmp_path_factory, tok_dir):
    """A model directory as a hub repository with custom code ships it: config.json with an
    ``auto_map``, the configuration and modeling files, weights and the tokenizer."""
    import importlib.util
    import sys

    from flowrl_ray.models.text_tokenizer import load_tokenizer
    path = tmp_path_factory.mktemp("remote") / "tiny-mdm"
    path.mkdir()
    (path / "configuration_tiny_mdm.py").write_text(CONFIG_PY)
    (path / "modeling_tiny_mdm.py").write_text(MODELING_PY.replace(".configuration_tiny_mdm", "configuration_tiny_mdm"))
    sys.path.insert(0, str(path))
    try:                                  # build and save the weights with the very same code
        spec = importlib.util.spec_from_file_location("modeling_tiny_mdm", path / "modeling_tiny_mdm.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        tok = load_tokenizer(tok_dir)
        torch.manual_seed(0)
        model = mod.TinyMDM(mod.TinyMDMConfig(vocab_size=len(tok), mask_token_id=tok.mask_token_id))
        model.config.auto_map = {"AutoConfig": "configuration_tiny_mdm.TinyMDMConfig",
                                 "AutoModel": "modeling_tiny_mdm.TinyMDM"}
        model.save_pretrained(path)
        tok.save_pretrained(path)
    finally:
        sys.path.remove(str(path))
        for name in ("modeling_tiny_mdm", "configuration_tiny_mdm"):
            sys.modules.pop(name, None)
    (path / "modeling_tiny_mdm.py").write_text(MODELING_PY)      # as a hub repository has it
    assert "auto_map" in json.loads((path / "config.json").read_text())
    return str(path)

def test_a_trust_remote_code_directory_loads_fine_tunes_and_trains_with_flow_grpo(remote_dir):
    with pytest.raises(ConfigError, match=r"'algo.model.path'"):          # the switch is needed
        md.build_masked_lm({"path": remote_dir, "trust_remote_code": False})
    lm = md.build_masked_lm({"path": remote_dir, "trust_remote_code": True}, seed=0)
    assert type(lm.model).__name__ == "TinyMDM" and type(lm.model).__module__.startswith("transformers_modules")
    assert lm.mask_token_id == lm.tokenizer.mask_token_id
    losses = fit_sft(lm, PAIRS, epochs=None, steps=30, batch_size=3, lr=3e-3, gen_length=16)
    assert sum(losses[-5:]) < sum(losses[:5])                           # SFT learns
    sft = Path(remote_dir).parent / "sft"
    lm.save(sft)

    model = {"path": None, "trust_remote_code": True, "max_len": 160}
    algo = FlowGRPO(config_from_dict(_config(str(sft), model, gen_length=32, max_prompt_len=128)),
                    EnvSpec(obs_shape=(1,), action_dim=1), torch.device("cpu"))
    assert type(algo.lm.model).__name__ == "TinyMDM" and algo.reference.kind == "copy"
    for g in algo.opt.param_groups:
        g["lr"] = 0.0
    metrics = _update(algo)
    assert abs(metrics["flow_grpo/ratio_max"] - 1) < 1e-6 and metrics["flow_grpo/sampler_logp_gap"] < 1e-3
    for g in algo.opt.param_groups:
        g["lr"] = 1e-2
    before = [p.detach().clone() for p in algo.lm.model.parameters()]
    metrics = _update(algo)
    assert math.isfinite(metrics["flow_grpo/loss"])
    assert any(not torch.equal(b, p) for b, p in zip(before, algo.lm.model.parameters()))
