"""The path a user of the ReFusion spec takes, with every part that does not need the 8B weights
real: the KL reference of a LoRA model without a second base (adapters disabled, or a frozen
named copy of an SFT adapter), the reference's ``generate`` (deterministic top-k by confidence),
a 4-bit Flow-GRPO update through bitsandbytes, a ``trust_remote_code`` model directory that
loads, fine-tunes and runs a Flow-GRPO update, and the shipped ReFusion config and jobs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")

from flowrl_ray.algorithms.flow_grpo import FlowGRPO  # noqa: E402
from flowrl_ray.batch import Batch, BatchMeta  # noqa: E402
from flowrl_ray.config import ConfigError, config_from_dict, read_yaml  # noqa: E402
from flowrl_ray.envs import EnvSpec  # noqa: E402
from flowrl_ray.models import masked_diffusion as md  # noqa: E402
from flowrl_ray.models.text_tokenizer import train_tokenizer  # noqa: E402

from conftest import REPO  # noqa: E402

PAIRS = [("Fill the name field with Ann", 'fill(name, "Ann")'),
         ("Fill the city field with Oslo", 'fill(city, "Oslo")'),
         ("Press the submit button", "click(submit)")]
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128, "max_len": 64}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer([t for p in PAIRS for t in p] * 4, vocab_size=320, path=path)
    return str(path)


def _logits(model: nn.Module, lm: md.MaskedDiffusionLM) -> torch.Tensor:
    ids, mask = lm.encode_prompts([p for p, _ in PAIRS])
    with torch.no_grad():
        logits = md.masked_lm_logits(model, ids, mask)
    return logits.masked_fill(torch.isinf(logits), 0.0)         # the [MASK] column is -inf


def _storages(*modules: nn.Module) -> int:
    """Bytes of the distinct parameter storages of the modules together."""
    seen = {}
    for m in modules:
        for p in m.parameters():
            seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


# --------------------------------------------------------------------------- KL reference

def test_reference_of_a_fresh_lora_is_the_base_with_adapters_disabled(tok_dir):
    lm = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir, "lora": LORA}, seed=0)
    sft = _logits(lm.model, lm)                          # B = 0: the policy is the SFT model
    ref = md.KLReference(lm.model)
    assert ref.kind == "adapters_disabled" and ref.extra_parameters() == 0
    with torch.no_grad():                                # RL moves the adapter
        for p in lm.trainable_parameters():
            p.add_(0.1)
    assert (_logits(lm.model, lm) - sft).abs().max() > 1e-3
    flags = {n: p.requires_grad for n, p in lm.model.named_parameters()}
    with ref.model() as m:
        torch.testing.assert_close(_logits(m, lm), sft, rtol=0, atol=1e-6)
    assert (_logits(lm.model, lm) - sft).abs().max() > 1e-3      # adapters back on after
    assert flags == {n: p.requires_grad for n, p in lm.model.named_parameters()}


def test_reference_of_a_trained_sft_adapter_is_a_frozen_named_copy_without_a_second_base(tok_dir, tmp_path):
    first = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir, "lora": LORA}, seed=0)
    with torch.no_grad():                                # an SFT adapter that is not a no-op
        for p in first.trainable_parameters():
            p.add_(0.05)
    first.save(tmp_path / "sft")
    lm = md.build_masked_lm({"path": str(tmp_path / "sft"), "lora": LORA})    # trains the SFT adapter
    sft = _logits(lm.model, lm)
    adapter = sum(p.numel() for p in lm.trainable_parameters())
    before = _storages(lm.model)
    ref = md.KLReference(lm.model)
    assert ref.kind == "adapter_copy" and ref.extra_parameters() == adapter
    # memory: one more adapter (a few thousand numbers), not a second copy of the base
    assert _storages(lm.model) - before == 4 * adapter
    trainable = {n for n, p in lm.model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)           # the copy is frozen
    with torch.no_grad():
        for p in lm.trainable_parameters():
            p.mul_(-3.0)
    assert (_logits(lm.model, lm) - sft).abs().max() > 1e-3
    with ref.model() as m:
        torch.testing.assert_close(_logits(m, lm), sft, rtol=0, atol=1e-6)
    assert trainable == {n for n, p in lm.model.named_parameters() if p.requires_grad}
    assert (_logits(lm.model, lm) - sft).abs().max() > 1e-3                 # the policy again
    lm.save(tmp_path / "rl")                                                 # the copy is not saved
    assert not (tmp_path / "rl" / md.REFERENCE_ADAPTER).exists()


def test_reference_of_a_model_without_adapters_is_a_frozen_copy(tok_dir):
    lm = md.build_masked_lm({**TINY, "tokenizer_path": tok_dir}, seed=0)
    ref = md.KLReference(lm.model)
    assert ref.kind == "copy"
    assert ref.extra_parameters() == sum(p.numel() for p in lm.model.parameters())
    with ref.model() as m:
        assert m is not lm.model and not any(p.requires_grad for p in m.parameters())


# --------------------------------------------------------------------------- the reference generate

class FixedLogits(nn.Module):
    """A stand-in model whose logits do not depend on the input: position j of the completion has
    a dominant token ``j + 1`` (logit 20) and every other token logit ``c_j``."""

    def __init__(self, c: list[float], prompt_len: int, vocab: int = 8, mask_id: int = 7):
        super().__init__()
        self.config = SimpleNamespace(mask_token_id=mask_id)
        self.w = nn.Parameter(torch.zeros(1))
        logits = torch.full((len(c), vocab), 0.0)
        for j, cj in enumerate(c):
            logits[j] = cj
            logits[j, j + 1] = 20.0
        self.table = torch.cat([torch.zeros(prompt_len, vocab), logits])     # [L, V]

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.table.expand(input_ids.shape[0], -1, -1) + 0 * self.w)


def test_the_reference_schedule_by_hand():
    assert md.unmask_schedule(10, 4, "confidence_topk") == [2, 3, 2, 3]     # floor((s+1)10/4) - floor(10s/4)
    assert md.unmask_schedule(10, 4, "gumbel_topk") == [3, 3, 2, 2]
    assert md.unmask_schedule(4, 4, "confidence_topk") == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="unknown sampler"):
        md.unmask_schedule(10, 4, "top_p")


def test_confidence_topk_unmasks_the_most_probable_positions_whatever_the_noise():
    # c_j = 8, 5, 7, 6: p(token) is highest where c_j is lowest: positions 1, 3 first, then 2, 0
    model = FixedLogits([8.0, 5.0, 7.0, 6.0], prompt_len=2)
    ids, mask = torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.bool)
    orders = set()
    for seed in range(6):
        seq, traj = md.generate_with_trajectory(model, ids, mask, 4, 2, 0.7, 7, torch.Generator().manual_seed(seed),
                                                sampler="confidence_topk")
        assert seq[0, 2:].tolist() == [1, 2, 3, 4]                             # the dominant tokens
        steps = [traj["unmasked"][s, 0, 2:].nonzero().flatten().tolist() for s in range(2)]
        assert steps == [[1, 3], [0, 2]]
        # the step's log-prob: the tempered log-probs of its tokens, as the update recomputes them
        z = model.table[2:] / 0.7
        lp = z[torch.arange(4), torch.tensor([1, 2, 3, 4])] - torch.logsumexp(z, -1)
        torch.testing.assert_close(traj["logp"][:, 0], torch.stack([lp[[1, 3]].sum(), lp[[0, 2]].sum()]))
        _, other = md.generate_with_trajectory(model, ids, mask, 4, 2, 0.7, 7, torch.Generator().manual_seed(seed))
        orders.add(tuple(other["unmasked"][0, 0, 2:].nonzero().flatten().tolist()))
    assert len(orders) > 1                     # the default sampler draws positions at random


# --------------------------------------------------------------------------- Flow-GRPO on the path

def _config(sft: str | None, model: dict, **algo) -> dict:
    return {"name": "refusion-path", "algorithm": "flow_grpo",
            "env": {"family": "forms", "id": "train", "kwargs": {"pages": 2}},
            "train": {"iterations": 1},
            "runtime": {"num_workers": 1, "envs_per_worker": 1, "rollout_length": 1, "checkpoint_interval": 0},
            "eval": {"interval": 1, "episodes": 2, "at_start": False},
            "algo": {"sft_checkpoint": sft, "model": model, "prompts_per_iteration": 2, "group_size": 2,
                     "epochs": 2, "num_generation_steps": 4, "gen_length": 32, "max_prompt_len": 96,
                     "lr": 1e-2, **algo}}


def _update(algo: FlowGRPO, rewards=(1.0, 0.0, 0.0, 1.0)) -> dict:
    chunks = algo.generate(1, "train")
    ids = np.concatenate([c["ids"] for c in chunks])
    r = np.asarray(rewards, np.float32)[ids]
    zeros = np.zeros_like(r)
    batch = Batch({"ids": ids, "rewards": r, "task_completion": zeros, "field_accuracy": r,
                   "execution_completeness": zeros, "unparseable_lines": zeros},
                  BatchMeta(policy_version=0, worker_id=0, env_steps=len(ids)))
    return algo.update(algo.prepare([batch]))


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, tok_dir):
    """A tiny full model (dimensions multiples of 32, for 4-bit) saved as an SFT checkpoint."""
    lm = md.build_masked_lm({**TINY, "max_len": 128, "tokenizer_path": tok_dir}, seed=0)
    out = tmp_path_factory.mktemp("sft") / "model"
    lm.save(out)
    return str(out)


def _reference_logp(algo: FlowGRPO) -> torch.Tensor:
    traj = algo.pending["trajectory"]
    rows = torch.arange(traj["states"].shape[1])
    return torch.stack([algo._reference_log_probs(traj, s, rows).sum(-1) for s in range(traj["states"].shape[0])])


def test_flow_grpo_with_lora_keeps_the_sft_model_as_its_reference(sft_dir):
    model = {**TINY, "max_len": 128, "lora": {**LORA, "dropout": 0.05}}
    algo = FlowGRPO(config_from_dict(_config(sft_dir, model)), EnvSpec(obs_shape=(1,), action_dim=1),
                    torch.device("cpu"))
    assert algo.reference.kind == "adapters_disabled" and algo.reference.extra_parameters() == 0
    sft = md.build_masked_lm({"path": sft_dir})                   # the SFT model itself
    algo.generate(1, "train")
    traj = algo.pending["trajectory"]
    want = md.trajectory_log_probs(sft.model, traj, algo.c.generation_temperature).double()
    torch.testing.assert_close(_reference_logp(algo), want, rtol=0, atol=1e-4)
    before = {n: p.detach().clone() for n, p in algo.lm.model.named_parameters() if p.requires_grad}
    for _ in range(2):
        metrics = _update(algo)
    assert any(not torch.equal(before[n], p) for n, p in algo.lm.model.named_parameters() if n in before)
    assert metrics["kl"] > 0                                     # the policy left the reference
    algo.pending["trajectory"] = traj
    torch.testing.assert_close(_reference_logp(algo), want, rtol=0, atol=1e-4)   # ... which stayed


def test_a_4bit_flow_grpo_update_runs_on_the_cpu(sft_dir):
    bnb = pytest.importorskip("bitsandbytes")
    model = {**TINY, "max_len": 128, "lora": LORA, "load_in_4bit": True}
    algo = FlowGRPO(config_from_dict(_config(sft_dir, model)), EnvSpec(obs_shape=(1,), action_dim=1),
                    torch.device("cpu"))
    quantised = [m for m in algo.lm.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantised) == 2 * 7                      # layers x (q, k, v, o, gate, up, down)
    assert algo.reference.kind == "adapters_disabled"
    frozen = {n: p.detach().clone() for n, p in algo.lm.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in algo.lm.model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    for g in algo.opt.param_groups:                     # lr 0 first: every ratio is a start ratio
        g["lr"] = 0.0
    metrics = _update(algo)
    assert abs(metrics["flow_grpo/ratio_min"] - 1) < 1e-6 and abs(metrics["flow_grpo/ratio_max"] - 1) < 1e-6
    for g in algo.opt.param_groups:
        g["lr"] = 1e-2
    metrics = _update(algo)
    assert math.isfinite(metrics["flow_grpo/loss"]) and metrics["flow_grpo/skipped_updates"] == 0
    assert any(not torch.equal(adapters[n], p) for n, p in algo.lm.model.named_parameters()
               if n in adapters and "lora_B" in n)
    assert all(torch.equal(frozen[n], p) for n, p in algo.lm.model.named_parameters() if n in frozen)


# --------------------------------------------------------------------------- shipped config and jobs

def test_the_refusion_config_names_the_hub_model_mask_and_sampler_and_validates_offline():
    from flowrl_ray.models.masked_diffusion import validate_model_cfg
    data = read_yaml(REPO / "configs" / "flow_grpo" / "forms_refusion.yaml")
    m = data["algo"]["model"]
    assert m["path"] == "GSAI-ML/ReFusion" and m["mask_token_id"] == 151670 and m["trust_remote_code"]
    assert data["algo"]["sampler"] == "confidence_topk"
    cfg = config_from_dict(data)                                   # the schema, nothing loaded
    FlowGRPO.validate_config(cfg)
    assert validate_model_cfg(m)["load_in_4bit"] is True
    with pytest.raises(ConfigError, match=r"'algo.sampler'"):
        FlowGRPO.validate_config(config_from_dict({**data, "algo": {**data["algo"], "sampler": "nucleus"}}))


def test_a_dry_run_of_the_refusion_config_checks_it_without_loading_8b(tmp_path, capsys):
    from flowrl_ray.cli import main
    config = str(REPO / "configs" / "flow_grpo" / "forms_refusion.yaml")
    assert main(["train", config, "--dry-run", f"algo.sft_checkpoint={tmp_path / 'none'}"]) == 2
    assert "algo.sft_checkpoint" in capsys.readouterr().err          # pretrain it first
    (tmp_path / "sft").mkdir()
    assert main(["train", config, "--dry-run", f"algo.sft_checkpoint={tmp_path / 'sft'}",
                 "--run-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "algo.model.path = GSAI-ML/ReFusion (a Hugging Face hub id)" in out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("job", ["flow_grpo_forms_refusion_train.yaml", "flow_grpo_forms_refusion_eval.yaml"])
def test_the_refusion_jobs_take_the_hugging_face_token_at_submission_and_cache_the_hub(job):
    text = (REPO / "jobs" / job).read_text()
    spec = yaml.safe_load(text)
    submit = [line for line in text.splitlines() if "anyscale job submit" in line]
    assert submit and all(f"-f jobs/{job} --env HF_TOKEN=$HF_TOKEN" in line for line in submit)
    assert "HF_TOKEN" not in spec["env_vars"]                   # never a secret in the file
    assert spec["env_vars"]["HF_HOME"].startswith("/mnt/user_storage/")    # outlives the cluster
    assert "algo.model.path" not in spec["entrypoint"]           # the config's hub id
