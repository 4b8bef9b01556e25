"""Flow-GRPO for the masked-diffusion language model: the math against hand values, the
behaviour log-probs recorded at generation time, the update's directions, and a tiny
SFT -> Flow-GRPO -> eval run through the CLI with real Chromium scorers on a real local Ray."""

import json
import math

import numpy as np
import pytest
import torch
import yaml

from flowrl_ray.algorithms.flow_grpo import FlowGRPO, group_advantages, k3_kl, kl_penalty
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


def test_kl_penalty_of_a_step_jointly_and_per_token_by_hand():
    # two tokens unmasked at positions 1 and 2; d_j = ref_j - logp_j
    logp = torch.tensor([[0.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -2.0, 0.0, 0.0]], dtype=torch.float64)      # d = (-1, +1): they cancel
    assert float(kl_penalty(logp, ref, "step")) == pytest.approx(0.0, abs=1e-12)           # k3(0)
    by_hand = (math.exp(-1) + 1 - 1) + (math.exp(1) - 1 - 1)                              # 1.0862
    assert float(kl_penalty(logp, ref, "token")) == pytest.approx(by_hand, rel=1e-12)
    ref = torch.tensor([[0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)       # d = (2, 2)
    assert float(kl_penalty(logp, ref, "step")) == pytest.approx(math.exp(4) - 4 - 1, rel=1e-12)   # 49.6
    assert float(kl_penalty(logp, ref, "token")) == pytest.approx(2 * (math.exp(2) - 2 - 1), rel=1e-12)  # 8.78
    assert torch.equal(kl_penalty(ref, ref, "token"), torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, "joint")


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
    # before any update rho = 1: the log-probs agree up to float32 summation order, a few ulps of
    # the step sums (up to ~150 nats here); dropout on would move them by whole nats
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(recomputed, traj["logp"], rtol=8 * eps, atol=1e-5)


@pytest.mark.parametrize("kl_estimator", ["step", "token"])
def test_tied_rewards_leave_the_model_unchanged(sft_dir, kl_estimator):
    # A = 0 for every rollout and k3's gradient is 0 while theta == ref: no update at all.
    algo = _algorithm(sft_dir, learning_rate=1e-2, kl_estimator=kl_estimator)
    before = {k: v.clone() for k, v in algo.lm.model.state_dict().items()}
    chunks = algo.generate(1, "train")
    metrics = algo.update(algo.prepare(_scored(algo, chunks, [0.5, 0.5, 0.5, 0.5])))
    assert metrics["flow_grpo/advantage_abs_mean"] == 0.0
    after = algo.lm.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_update_raises_the_log_prob_of_the_better_rollout_and_moves_away_from_the_reference(sft_dir):
    from flowrl_ray.models.masked_diffusion import trajectory_log_probs
    from flowrl_ray.utils import frozen_copy
    algo = _algorithm(sft_dir, learning_rate=3e-3, epochs=1, kl_coeff=0.0)
    assert algo.reference is None                     # no KL term: no reference kept
    start = frozen_copy(algo.lm.model)
    chunks = algo.generate(1, "train")
    traj = algo.pending["trajectory"]
    old = traj["logp"].sum(0)                                           # [4] log pi_old(completion)
    # within each group the first rollout is rewarded: A = (+1, -1, +1, -1)
    metrics = algo.update(algo.prepare(_scored(algo, chunks, [1.0, 0.0, 1.0, 0.0])))
    assert metrics["nonzero_reward_count"] == 2 and metrics["reward_mean"] == 0.5
    with torch.no_grad():
        algo.lm.model.eval()
        new = trajectory_log_probs(algo.lm.model, traj, algo.c.generation_temperature).sum(0)
        ref = trajectory_log_probs(start, traj, algo.c.generation_temperature).sum(0)
    change = new - old
    assert change[0] > 0 and change[2] > 0 and change[1] < 0 and change[3] < 0
    assert torch.allclose(ref, old, atol=1e-5)                          # the start policy
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
    estimator = _config(None, sft_dir)
    estimator["algo"]["kl_estimator"] = "joint"
    with pytest.raises(ConfigError, match="algo.kl_estimator"):
        config_from_dict(estimator)
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
    assert main(["pretrain", str(config), "--copy-aux", "-0.5"]) == 2
    assert not (tmp_path / "sft").exists()


def test_pretrain_cli_copy_aux_adds_that_fraction_of_copy_pairs(tmp_path, capsys):
    from flowrl_ray.cli import main
    config = tmp_path / "fg.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path, str(tmp_path / "sft"))))
    n_forms = len(FormCatalog.load().ids(heldout=False))
    assert main(["pretrain", str(config), "--steps", "1", "--tasks-per-form", "2", "--batch-size", "4",
                 "--copy-aux", "0.5"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["pairs"] == 2 * n_forms + round(0.5 * 2 * n_forms)      # task pairs + half as many copy pairs
    assert (tmp_path / "sft" / "config.json").is_file()


def test_train_prompts_come_from_the_task_file_when_one_is_given(sft_dir, tmp_path):
    from flowrl_ray.envs.forms.tasks import load_tasks
    catalog = FormCatalog.load()
    picked = load_tasks("rl", per_form=1, catalog=catalog)[:3]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"instruction": t.instruction, "url": t.url,
                                        "ground_truth_fields": t.ground_truth_fields}) + "\n" for t in picked))
    raw = _config(None, sft_dir)
    raw["env"]["kwargs"]["task_file"] = str(path)
    algo = FlowGRPO(config_from_dict(raw), EnvSpec(obs_shape=(1,), action_dim=1), torch.device("cpu"))
    assert [t.task_id for t in algo.train_tasks] == ["file/mine/1", "file/mine/2", "file/mine/3"]
    assert [t.instruction for t in algo.train_tasks] == [t.instruction for t in picked]
    drawn = {t.task_id for _ in range(10) for t in algo._draw_tasks("train")}
    assert drawn <= {"file/mine/1", "file/mine/2", "file/mine/3"} and len(drawn) > 1


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
    assert rows[0]["eval/invalid_episodes"] == 0
    for row in rows[1:]:
        assert row["episodes_this_iter"] == 4              # 2 prompts x G=2, scored in Chromium
        assert 0.0 <= row["field_accuracy"] <= 1.0 and math.isfinite(row["flow_grpo/loss"])
        for k in ("flow_grpo/ratio_mean", "flow_grpo/ratio_min", "flow_grpo/ratio_max", "approx_kl", "kl",
                  "clipfrac", "task_completion", "execution_completeness", "invalid_episodes"):
            assert math.isfinite(row[k]), k            # per-iteration metrics in metrics.jsonl
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval/episodes"] == 2 and 0.0 <= result["eval/field_accuracy"] <= 1.0


# --------------------------------------------------------------------------- epochs, minibatches,
# step subsampling, dropout, invalid episodes

def _scored_with(algo: FlowGRPO, chunks: list[dict], rewards: list[float], reasons: list[str]) -> list[Batch]:
    from flowrl_ray.envs.forms.reward import INVALID_REASONS
    [batch] = _scored(algo, chunks, rewards)
    ids = batch.data["ids"]
    batch.data["reason"] = np.array([reasons[i] for i in ids], dtype=str)
    batch.data["valid"] = np.array([reasons[i] not in INVALID_REASONS for i in ids], dtype=bool)
    return [batch]


def test_group_advantages_leave_a_crashed_member_out_of_its_group_by_hand():
    # group 1: (1, 0, crash, 0.5) -> valid (1, 0, 0.5): mean 0.5, population std sqrt(1/6)
    # group 2: (0.2, 0.2, 0.2, 1.0) all valid: mean 0.4, std sqrt(0.12)
    r = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.2, 0.2, 0.2, 1.0])
    valid = torch.tensor([True, True, False, True, True, True, True, True])
    adv = group_advantages(r, 4, valid=valid)
    s1, s2 = math.sqrt(1 / 6), math.sqrt(0.12)
    want = torch.tensor([0.5 / s1, -0.5 / s1, 0.0, 0.0, -0.2 / s2, -0.2 / s2, -0.2 / s2, 0.6 / s2])
    assert torch.allclose(adv, want, atol=1e-5)
    # counting the crash as a 0 would have given the crash and the 0 the same negative advantage
    assert group_advantages(r, 4)[2] < 0
    # a group with one valid member (or none) gets zeros; all valid == the old behaviour
    one = group_advantages(torch.tensor([1.0, 0.0]), 2, valid=torch.tensor([True, False]))
    assert torch.equal(one, torch.zeros(2))
    assert torch.equal(group_advantages(r, 4, valid=torch.ones(8, dtype=torch.bool)), group_advantages(r, 4))


def test_episode_validity_is_a_closed_set_of_infrastructure_reasons():
    from flowrl_ray.envs.forms.reward import GATE_REASONS, INVALID_REASONS, EpisodeResult
    assert set(INVALID_REASONS) <= set(GATE_REASONS)
    assert {"browser_crash", "timeout"} <= set(INVALID_REASONS)
    for reason in ("", *GATE_REASONS):
        r = EpisodeResult(task_id="t", form_id="f", reason=reason)
        assert r.valid == (reason not in INVALID_REASONS)
    assert EpisodeResult("t", "f", reason="no_actions").valid         # the policy wrote nothing: its fault


def test_dropout_off_sets_every_dropout_to_eval_and_restores_the_modes():
    from flowrl_ray.optim import dropout_off
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5), torch.nn.Dropout1d(0.5))
    net.train()
    net[2].eval()                                      # a mixed state comes back as it was
    with dropout_off(net):
        assert not net[1].training and not net[2].training and net[0].training and net.training
        x = torch.ones(4, 3)
        assert torch.equal(net(x), net(x))             # deterministic
    assert net[1].training and not net[2].training and net[0].training


def _lora_algorithm(sft_dir, **algo) -> FlowGRPO:
    lora = {"r": 4, "alpha": 8, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
    a = _algorithm(sft_dir, model={**TINY_MODEL, "lora": lora}, **algo)
    with torch.no_grad():                              # B = 0 at init would hide the dropout
        g = torch.Generator().manual_seed(1)
        for n, p in a.lm.model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return a


def test_ratios_are_one_at_the_start_of_an_update_with_lora_dropout(sft_dir):
    from flowrl_ray.models.masked_diffusion import trajectory_log_probs
    algo = _lora_algorithm(sft_dir, epochs=2, timestep_fraction=0.5, minibatch_groups=1)   # 2 minibatches
    drops = [m for m in algo.lm.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == 0.05 for m in drops)
    chunks = algo.generate(1, "train")
    traj = algo.pending["trajectory"]
    # the failure this guards against: recomputing in train mode, LoRA dropout on
    algo.lm.model.train()
    torch.manual_seed(0)
    noisy = torch.exp(trajectory_log_probs(algo.lm.model, traj, algo.c.generation_temperature) - traj["logp"])
    assert (noisy - 1).abs().max() > 1e-3
    # lr 0: the weights never move, so every ratio of the whole update is a start-of-update ratio
    for g in algo.opt.param_groups:
        g["lr"] = 0.0
    metrics = algo.update(algo.prepare(_scored(algo, chunks, [1.0, 0.0, 0.3, 0.0])))
    assert abs(metrics["flow_grpo/ratio_min"] - 1) < 1e-6 and abs(metrics["flow_grpo/ratio_max"] - 1) < 1e-6
    assert metrics["flow_grpo/clipfrac"] == 0.0 and abs(metrics["approx_kl"]) < 1e-12
    assert all(m.training for m in drops)              # the modes are back after the update
    assert metrics["flow_grpo/sampler_logp_gap"] < 1e-3    # the sampler's own log-probs agree (eval mode)


def test_update_plan_uses_whole_groups_and_k_of_s_steps_and_resumes_the_same_picks(sft_dir):
    algo = _algorithm(sft_dir, prompts_per_iteration=4, minibatch_groups=2, epochs=3, timestep_fraction=0.5)
    minibatches, epochs = algo._update_plan(groups=4, steps=7)
    assert len(minibatches) == 2 and len(epochs) == 3
    rows = torch.cat(minibatches).sort().values
    assert torch.equal(rows, torch.arange(8))                          # a partition of the 4 x G=2 rows
    for mb in minibatches:                                             # whole groups: pairs (2g, 2g+1)
        assert torch.equal(mb.view(-1, 2)[:, 1] - mb.view(-1, 2)[:, 0], torch.ones(2, dtype=torch.long))
        assert (mb.view(-1, 2)[:, 0] % 2 == 0).all()
    for plan in epochs:
        assert sorted(m for m, _ in plan) == [0, 1]
        assert all(len(steps) == 4 and len(set(steps)) == 4 and max(steps) < 7 for _, steps in plan)   # ceil(0.5 * 7)
        # a minibatch keeps its steps across epochs (old and reference log-probs once per step)
        assert dict(plan) == dict(epochs[0])
    assert [m for m, _ in epochs[0]] != [m for m, _ in epochs[1]] or [m for m, _ in epochs[1]] != \
        [m for m, _ in epochs[2]]                                      # the order is reshuffled
    # resume: the update generator's state is in the state_dict
    state = algo.state_dict()
    nxt = algo._update_plan(4, 7)
    resumed = _algorithm(sft_dir, prompts_per_iteration=4, minibatch_groups=2, epochs=3, timestep_fraction=0.5)
    fresh = resumed._update_plan(4, 7)
    resumed.load_state_dict(state)
    again = resumed._update_plan(4, 7)
    assert again[1] == nxt[1] and all(torch.equal(a, b) for a, b in zip(again[0], nxt[0]))
    assert fresh[1] != nxt[1]                                          # without the state: other picks
    full = _algorithm(sft_dir, timestep_fraction=1.0)._update_plan(2, 7)[1]
    assert all(steps == list(range(7)) for plan in full for _, steps in plan)


def test_update_takes_one_step_per_minibatch_per_epoch_and_reports_the_metrics(sft_dir):
    algo = _algorithm(sft_dir, prompts_per_iteration=2, minibatch_groups=1, epochs=2, timestep_fraction=0.5,
                      learning_rate=1e-3)
    chunks = algo.generate(1, "train")
    metrics = algo.update(algo.prepare(_scored_with(algo, chunks, [1.0, 0.0, 0.0, 1.0], ["", "", "", ""])))
    assert metrics["flow_grpo/optimizer_steps"] == 4 and metrics["flow_grpo/steps"] == 6
    assert metrics["flow_grpo/steps_per_minibatch"] == 3                # ceil(0.5 * 6)
    for k in ("flow_grpo/ratio_mean", "flow_grpo/ratio_min", "flow_grpo/ratio_max", "approx_kl", "kl",
              "clipfrac", "task_completion", "field_accuracy", "execution_completeness", "invalid_episodes"):
        assert math.isfinite(metrics[k]), k
    assert metrics["flow_grpo/ratio_min"] <= metrics["flow_grpo/ratio_mean"] <= metrics["flow_grpo/ratio_max"]
    assert metrics["flow_grpo/ratio_max"] > 1.0 or metrics["flow_grpo/ratio_min"] < 1.0    # the 2nd epoch moved
    assert metrics["kl"] > 0 and metrics["invalid_episodes"] == 0


def test_invalid_episodes_are_counted_and_left_out_of_the_loss(sft_dir):
    algo = _algorithm(sft_dir, learning_rate=1e-2)
    before = {k: v.clone() for k, v in algo.lm.model.state_dict().items()}
    chunks = algo.generate(1, "train")
    # each group has one valid member: no advantage; the invalid ones would have +-1 if counted as 0
    p = algo.prepare(_scored_with(algo, chunks, [1.0, 0.0, 0.0, 1.0], ["", "timeout", "browser_crash", ""]))
    assert torch.equal(p["advantages"], torch.zeros(4))
    metrics = algo.update(p)
    assert metrics["invalid_episodes"] == 2 and metrics["invalid/timeout"] == 1
    assert metrics["invalid/browser_crash"] == 1 and metrics["invalid/page_error"] == 0
    after = algo.lm.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)       # A = 0 and k3 = 0 at theta = ref


def test_minibatch_and_fraction_mistakes_name_the_key(sft_dir):
    for algo, key in (({"prompts_per_iteration": 4, "minibatch_groups": 3}, "algo.minibatch_groups"),
                      ({"prompts_per_iteration": 2, "minibatch_groups": 4}, "algo.minibatch_groups"),
                      ({"timestep_fraction": 0.0}, "timestep_fraction"),
                      ({"timestep_fraction": 1.5}, "timestep_fraction"),
                      ({"epochs": 0}, "epochs")):
        with pytest.raises(ConfigError, match=key):
            config_from_dict(_config(None, sft_dir, **algo))


def test_a_non_finite_loss_skips_and_counts_the_minibatch_step(sft_dir):
    algo = _algorithm(sft_dir, learning_rate=1e-2, epochs=2)
    before = {k: v.clone() for k, v in algo.lm.model.state_dict().items()}
    chunks = algo.generate(1, "train")
    p = algo.prepare(_scored(algo, chunks, [1.0, 0.0, 0.0, 1.0]))
    p["advantages"][0] = float("nan")
    metrics = algo.update(p)
    assert metrics["flow_grpo/skipped_updates"] == 2 == metrics["flow_grpo/optimizer_steps"]   # 1 minibatch x 2 epochs
    after = algo.lm.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_kl_estimator_setting_reaches_the_update(sft_dir):
    """Same seed, same batch, same rewards: the first optimiser step is the same (both penalties
    and their gradients are 0 at the reference); the second epoch's penalty, once the policy has
    moved, is the chosen estimator's, so the logged KL and the weights differ."""
    logged, weights = {}, {}
    for estimator in ("step", "token"):
        algo = _algorithm(sft_dir, learning_rate=1e-2, kl_coeff=1.0, kl_estimator=estimator)
        chunks = algo.generate(1, "train")
        logged[estimator] = algo.update(algo.prepare(_scored(algo, chunks, [1.0, 0.0, 1.0, 0.0])))["flow_grpo/kl"]
        weights[estimator] = {k: v.clone() for k, v in algo.lm.model.state_dict().items()}
    assert logged["step"] > 0 and logged["token"] > 0 and logged["step"] != pytest.approx(logged["token"])
    assert any(not torch.equal(weights["step"][k], weights["token"][k]) for k in weights["step"])
