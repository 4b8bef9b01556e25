"""Flow-GRPO for the masked-diffusion language model: the math against hand values, the
behaviour log-probs recorded at generation time, the update's directions, and a tiny
SFT -> Flow-GRPO -> eval run through the CLI with real Chromium scorers on a real local Ray."""

import json
import math

import numpy as np
import pytest
import torch
import yaml

from flowrl_ray.algorithms.flow_grpo import FlowGRPO, group_advantages, k3_kl
from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.config import ConfigError, config_from_dict
from flowrl_ray.envs import EnvSpec
from flowrl_ray.envs.forms import FormCatalog

TINY_MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64,
              "max_len": 416, "vocab_size": 400}


def test_k3_is_zero_for_identical_models_and_matches_the_formula():
    logp = torch.tensor([-1.0, -3.0, 0.0])
    assert torch.equal(k3_kl(logp, logp), torch.zeros(3))
    # ref - logp = log 0.5: exp(d) - d - 1 = 0.5 + log 2 - 1
    value = k3_kl(torch.tensor([0.0]), torch.tensor([math.log(0.5)]))
    assert value.item() == pytest.approx(0.5 + math.log(2.0) - 1.0, abs=1e-7)
    assert (k3_kl(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])) > 0).all()


def test_group_advantages_use_the_population_std_and_zero_a_tied_group():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.7, 0.7]), group_size=2, adv_clip_max=5.0)
    # group (1, 0): mean 0.5, population std 0.5 -> +-1; group (0.7, 0.7): zeros
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-6)


def _config(tmp_path, sft: str, **algo) -> dict:
    return {"name": "fg-test", "algorithm": "flow_grpo",
            "env": {"family": "forms", "id": "train", "kwargs": {"pages": 2}},
            "train": {"iterations": 2},
            "runtime": {"num_workers": 1, "envs_per_worker": 1, "rollout_length": 1, "checkpoint_interval": 0},
            "eval": {"interval": 2, "episodes": 2, "at_start": True},
            "algo": {"sft_checkpoint": sft, "model": dict(TINY_MODEL), "prompts_per_iteration": 2,
                     "group_size": 2, "epochs": 2, "num_generation_steps": 6, "gen_length": 144,
                     "max_prompt_len": 256, **algo}}


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    """A tiny untrained model and its tokenizer saved as an SFT checkpoint (no SFT steps: the
    math tests only need fixed weights)."""
    from flowrl_ray.models.masked_diffusion import build_masked_lm
    from flowrl_ray.models.text_tokenizer import train_tokenizer
    from flowrl_ray.pretrain_text import sft_pairs
    cfg = config_from_dict(_config(None, "unused"))
    texts = [t for pair in sft_pairs(cfg.env)[:40] for t in pair]
    lm = build_masked_lm(TINY_MODEL, tokenizer=train_tokenizer(texts, TINY_MODEL["vocab_size"]), seed=0)
    out = tmp_path_factory.mktemp("sft") / "model"
    lm.save(out)
    return str(out)


def _algorithm(sft_dir, **algo) -> FlowGRPO:
    cfg = config_from_dict(_config(None, sft_dir, **algo))
    torch.manual_seed(0)
    return FlowGRPO(cfg, EnvSpec(obs_shape=(1,), action_dim=1), torch.device("cpu"))


def _scored(algo: FlowGRPO, chunks: list[dict], rewards: list[float]) -> list[Batch]:
    ids = np.concatenate([c["ids"] for c in chunks])
    r = np.asarray(rewards, np.float32)[ids]
    zeros = np.zeros_like(r)
    data = {"ids": ids, "rewards": r, "task_completion": zeros, "field_accuracy": r,
            "execution_completeness": zeros, "unparseable_lines": zeros}
    return [Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=len(ids)))]


def test_recorded_behaviour_log_probs_give_first_epoch_ratios_of_one(sft_dir):
    from flowrl_ray.models.masked_diffusion import trajectory_log_probs
    algo = _algorithm(sft_dir)
    chunks = algo.generate(2, "train")
    assert [c["task_ids"][0].split("/")[0] for c in chunks] == ["train", "train"]
    traj = algo.pending["trajectory"]
    steps, rows = traj["logp"].shape
    assert rows == 4 and steps == 6                       # 2 prompts x G=2, 6 unmasking steps
    algo.lm.model.train()                                 # the update's mode: dropout is 0
    recomputed = trajectory_log_probs(algo.lm.model, traj, algo.c.generation_temperature)
    ratio = torch.exp(recomputed - traj["logp"])          # before any update: rho = 1
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)


def test_tied_rewards_leave_the_model_unchanged(sft_dir):
    # A = 0 for every rollout and k3's gradient is 0 while theta == ref: no update at all.
    algo = _algorithm(sft_dir, learning_rate=1e-2)
    before = {k: v.clone() for k, v in algo.lm.model.state_dict().items()}
    chunks = algo.generate(1, "train")
    metrics = algo.update(algo.prepare(_scored(algo, chunks, [0.5, 0.5, 0.5, 0.5])))
    assert metrics["flow_grpo/advantage_abs_mean"] == 0.0
    after = algo.lm.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_update_raises_the_log_prob_of_the_better_rollout_and_moves_away_from_the_reference(sft_dir):
    from flowrl_ray.models.masked_diffusion import trajectory_log_probs
    algo = _algorithm(sft_dir, learning_rate=3e-3, epochs=1, kl_coeff=0.0)
    chunks = algo.generate(1, "train")
    traj = algo.pending["trajectory"]
    old = traj["logp"].sum(0)                                           # [4] log pi_old(completion)
    # within each group the first rollout is rewarded: A = (+1, -1, +1, -1)
    metrics = algo.update(algo.prepare(_scored(algo, chunks, [1.0, 0.0, 1.0, 0.0])))
    assert metrics["nonzero_reward_count"] == 2 and metrics["reward_mean"] == 0.5
    with torch.no_grad():
        algo.lm.model.eval()
        new = trajectory_log_probs(algo.lm.model, traj, algo.c.generation_temperature).sum(0)
        ref = trajectory_log_probs(algo.reference, traj, algo.c.generation_temperature).sum(0)
    change = new - old
    assert change[0] > 0 and change[2] > 0 and change[1] < 0 and change[3] < 0
    assert torch.allclose(ref, old, atol=1e-5)                          # the reference stays frozen
    assert (k3_kl(new, ref) > 0).all()


def test_checkpoint_state_round_trips_and_holds_only_trainable_weights(sft_dir):
    algo = _algorithm(sft_dir)
    state = algo.state_dict()
    assert set(state["model"]) == {n for n, p in algo.lm.model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in algo.lm.model.parameters():
            p.add_(1.0)
    algo.load_state_dict(state)
    assert all(torch.equal(p, state["model"][n]) for n, p in algo.lm.model.named_parameters())
    lora = _algorithm(sft_dir, model={**TINY_MODEL, "lora": {"r": 4, "alpha": 8, "dropout": 0.0,
                                                             "target_modules": ["q_proj", "v_proj"]}})
    keys = set(lora.state_dict()["model"])
    assert keys and all("lora_" in k for k in keys)        # the frozen base is not checkpointed


def test_config_mistakes_name_the_key(sft_dir):
    bad_family = _config(None, sft_dir)
    bad_family["env"] = {"family": "robot", "id": "lift"}
    with pytest.raises(ConfigError, match="env.family"):
        config_from_dict(bad_family)
    short = _config(None, sft_dir)
    short["algo"]["model"]["max_len"] = 200
    with pytest.raises(ConfigError, match="algo.model.max_len"):
        config_from_dict(short)
    typo = _config(None, sft_dir)
    typo["algo"]["kl_coef"] = 0.1
    with pytest.raises(ConfigError, match="kl_coeff"):
        config_from_dict(typo)


def test_sft_pairs_with_more_tasks_per_form_keep_the_split_and_add_new_training_records():
    from flowrl_ray.pretrain_text import sft_pairs
    env = config_from_dict(_config(None, "unused")).env
    split, more = sft_pairs(env), sft_pairs(env, tasks_per_form=40)
    per_form = len(split) // len(FormCatalog.load().ids(heldout=False))
    assert per_form == 32 and len(more) == 40 * len(split) // 32
    # ordered by form then index: each form's first 32 are the split's own pairs
    for k in range(len(split) // 32):
        assert more[40 * k:40 * k + 32] == split[32 * k:32 * k + 32]
    assert len({p for p, _ in more}) == len(more)


def test_warn_if_cut_counts_prompts_and_answers_that_cannot_fit(sft_dir):
    import warnings as _warnings
    from flowrl_ray.algorithms.flow_grpo import warn_if_cut
    from flowrl_ray.envs.forms import gold_actions, load_tasks
    from flowrl_ray.models.masked_diffusion import load_sft_checkpoint
    from flowrl_ray.pretrain_text import prompt_text
    lm = load_sft_checkpoint(sft_dir, TINY_MODEL)
    catalog = FormCatalog.load()
    task = load_tasks("heldout_forms", catalog=catalog)[0]
    n_prompt = len(lm.tokenizer(prompt_text(task, catalog))["input_ids"])
    n_answer = len(lm.tokenizer(gold_actions(task, catalog), add_special_tokens=False)["input_ids"])
    with _warnings.catch_warnings():
        _warnings.simplefilter("error")          # fits exactly: no warning
        assert warn_if_cut(lm, [task], catalog, n_prompt, n_answer + 1, "held-out") == (0, 0)
    with pytest.warns(UserWarning, match="1 of 1 held-out prompts .* and 1 gold action scripts"):
        assert warn_if_cut(lm, [task], catalog, n_prompt - 1, n_answer, "held-out") == (1, 1)


def test_pretrain_cli_refuses_two_budgets_and_a_bad_task_count(tmp_path):
    from flowrl_ray.cli import main
    config = tmp_path / "fg.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path, str(tmp_path / "sft"))))
    assert main(["pretrain", str(config), "--epochs", "1", "--steps", "3"]) == 2
    assert main(["pretrain", str(config), "--tasks-per-form", "0"]) == 2
    assert not (tmp_path / "sft").exists()


@pytest.mark.slow
def test_sft_then_flow_grpo_then_eval_through_the_cli(tmp_path, capsys):
    from flowrl_ray.cli import main
    config = tmp_path / "fg.yaml"
    sft, run = tmp_path / "sft", tmp_path / "run"
    config.write_text(yaml.safe_dump(_config(tmp_path, str(sft))))
    assert main(["pretrain", str(config), "--steps", "3", "--tasks-per-form", "4", "--batch-size", "32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["pairs"] == 4 * len(FormCatalog.load().ids(heldout=False)) and summary["steps"] == 3
    assert summary["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")    # the GPU when there is one
    assert (sft / "sft_loss.png").is_file() and (sft / "config.json").is_file()

    assert main(["train", str(config), "--run-dir", str(run), "--no-tensorboard"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval/episodes"] == 2 and "eval/heldout_forms/field_accuracy" in rows[0]
    for row in rows[1:]:
        assert row["episodes_this_iter"] == 4              # 2 prompts x G=2, scored in Chromium
        assert 0.0 <= row["field_accuracy"] <= 1.0 and math.isfinite(row["flow_grpo/loss"])
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval/episodes"] == 2 and 0.0 <= result["eval/field_accuracy"] <= 1.0
