"""Flow-GRPO for the masked-diffusion language model: the math against hand values, the
behaviour log-probs recorded at generation time, the update's directions, the pretrain verb's
checks. A tiny SFT -> Flow-GRPO -> eval run through the CLI: tests/e2e/test_flow_grpo.py."""

import json
import math

import pytest
import torch
import yaml

from flowrl_ray.algorithms.flow_grpo import FlowGRPO, group_advantages, k3_kl, kl_penalty
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
    from flowrl_ray.pretrain.text_sft import sft_pairs
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
    from flowrl_ray.pretrain.text_sft import sft_pairs
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
    from flowrl_ray.envs.forms import prompt_text
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


# --------------------------------------------------------------------------- epochs, minibatches,
# step subsampling, dropout, invalid episodes

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


def test_minibatch_and_fraction_mistakes_name_the_key(sft_dir):
    for algo, key in (({"prompts_per_iteration": 4, "minibatch_groups": 3}, "algo.minibatch_groups"),
                      ({"prompts_per_iteration": 2, "minibatch_groups": 4}, "algo.minibatch_groups"),
                      ({"timestep_fraction": 0.0}, "timestep_fraction"),
                      ({"timestep_fraction": 1.5}, "timestep_fraction"),
                      ({"epochs": 0}, "epochs")):
        with pytest.raises(ConfigError, match=key):
            config_from_dict(_config(None, sft_dir, **algo))


# --------------------------------------------------------------------------- line-level credit

def test_line_advantages_by_hand_on_a_toy():
    from flowrl_ray.algorithms.flow_grpo import line_advantages
    # one group of 4, two slots: slot 0 written right by rollout 0 only, slot 1 by all four
    slot_right = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    seq_adv = torch.tensor([0.9, -0.3, -0.3, -0.3])
    token_slot = torch.tensor([[0, 0, -1, 1, -1], [1, -1, 0, 0, -1], [-1] * 5, [0] * 5])
    adv = line_advantages(seq_adv, slot_right, token_slot, group_size=4, adv_clip_max=5.0)
    up, down = 0.75 / math.sqrt(0.1875), -0.25 / math.sqrt(0.1875)          # (y - 1/4) / std, 1.732 / -0.577
    expected = torch.tensor([[up, up, 0.9, 0.0, 0.9],                         # slot 1: no contrast, no credit
                             [0.0, -0.3, down, down, -0.3],
                             [-0.3] * 5,                                      # no line addresses a slot
                             [down] * 5])
    assert torch.allclose(adv, expected, atol=1e-6)
    # rollout 3 crashed: left out of the slot statistics, and its tokens get A = 0
    valid = torch.tensor([True, True, True, False])
    adv = line_advantages(seq_adv, slot_right, token_slot, 4, 5.0, valid=valid)
    up, down = (2 / 3) / math.sqrt(2 / 9), -(1 / 3) / math.sqrt(2 / 9)       # 1.414 / -0.707
    assert adv[0, 0] == pytest.approx(up, abs=1e-6) and adv[1, 2] == pytest.approx(down, abs=1e-6)
    assert torch.equal(adv[3], torch.zeros(5))
    # the advantage clip applies per slot
    assert line_advantages(seq_adv, slot_right, token_slot, 4, 1.0)[0, 0] == pytest.approx(1.0)


def test_token_lines_count_the_newlines_before_each_token_and_stop_at_eos():
    from flowrl_ray.algorithms.flow_grpo import token_lines
    newlines = torch.tensor([0, 0, 1, 0, 0, 0])             # id 2 is "\n"
    stop = torch.tensor([True, False, False, True, False, False])     # [PAD] = 0, [EOS] = 3
    completion = torch.tensor([[5, 2, 5, 5, 2, 5, 3, 5],
                               [2, 2, 4, 0, 4, 4, 4, 4]])
    assert token_lines(completion, newlines, stop).tolist() == [[0, 0, 1, 1, 1, 2, -1, -1],
                                                               [0, 1, 2, -1, -1, -1, -1, -1]]


def test_a_scored_batch_credits_each_tokens_line(sft_dir):
    """prepare() with advantage: line on a batch whose scripts are set by hand: the tokens of a
    line get its slot's group advantage, the rest (and the [EOS] padding) the rollout's."""
    from flowrl_ray.envs.forms import gold_actions
    from flowrl_ray.envs.forms.credit import gold_slots
    algo = _algorithm(sft_dir, advantage="line", ratio="token")
    algo.generate(1, "train")
    pending, lm = algo.pending, algo.lm
    task = pending["tasks"][0]                                       # group 0: rows 0, 1 (G = 2)
    gold = gold_actions(task, algo.catalog).split("\n")
    wrong_first = "\n".join(['fill "nothing" "x"'] + gold[1:])        # line 0 addresses no slot
    texts = [gold_actions(task, algo.catalog), wrong_first] + pending["texts"][2:]
    lp = pending["trajectory"]["prompt_len"]
    for k in (0, 1):                                                  # the final tokens spell the texts
        ids = lm.encode_answers([texts[k]], algo.c.gen_length)[0]
        pending["trajectory"]["tokens"][-1][k, lp:] = ids
    pending["texts"] = texts
    from flowrl_ray.batch import Batch, BatchMeta
    import numpy as np
    r = np.array([1.0, 0.5, 0.2, 0.2], np.float32)
    data = {"ids": np.arange(4), "rewards": r, "task_completion": r, "field_accuracy": r,
            "execution_completeness": r, "unparseable_lines": np.zeros(4)}
    p = algo.prepare([Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=4))])
    adv, tok = p["advantages"], p["token_advantages"]
    assert tok.shape == (4, algo.c.gen_length) and adv[0] == pytest.approx(1.0) and adv[1] == pytest.approx(-1.0)
    first_line = len(lm.tokenizer(gold[0] + "\n", add_special_tokens=False)["input_ids"])
    n0 = len(lm.tokenizer(texts[0], add_special_tokens=False)["input_ids"])
    # slot 0 ("fill" of the first field): right in row 0 only -> +1 / -1; every other slot: tied -> 0
    assert torch.equal(tok[0, :first_line], torch.ones(first_line))
    assert (tok[0, first_line:n0] == 0).all()
    assert (tok[0, n0:] == adv[0]).all()                              # [EOS] padding: the rollout's own
    other = len(lm.tokenizer('fill "nothing" "x"\n', add_special_tokens=False)["input_ids"])
    assert (tok[1, :other] == adv[1]).all() and (tok[1, other:other + 3] == 0).all()   # no slot, then tied slots
    assert len(gold_slots(task, algo.catalog)) == len(gold)


def test_the_no_signal_control_permutes_outcomes_within_groups(sft_dir):
    from flowrl_ray.batch import Batch, BatchMeta
    import numpy as np
    algo = _algorithm(sft_dir, prompts_per_iteration=2, group_size=4, advantage_shuffle=True)
    valid = torch.tensor([True, True, False, True, True, True, True, True])
    perm = algo._within_group_permutation(valid)
    assert sorted(perm.tolist()) == list(range(8)) and perm[2] == 2           # a permutation; invalid stays
    assert set(perm[:4].tolist()) == {0, 1, 2, 3} and set(perm[4:].tolist()) == {4, 5, 6, 7}
    seen = {tuple(algo._within_group_permutation(valid).tolist()) for _ in range(30)}
    assert len(seen) > 1                                                      # drawn, not fixed
    algo.generate(1, "train")
    r = np.array([1.0, 0.0, 0.0, 0.0, 0.2, 0.4, 0.6, 0.8], np.float32)
    data = {"ids": np.arange(8), "rewards": r, "task_completion": r, "field_accuracy": r,
            "execution_completeness": r, "unparseable_lines": np.zeros(8)}
    g = algo.update_generator.get_state()
    p = algo.prepare([Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=8))])
    algo.update_generator.set_state(g)
    perm = algo._within_group_permutation(torch.ones(8, dtype=torch.bool))
    assert torch.allclose(p["advantages"], group_advantages(torch.tensor(r)[perm], 4, 5.0))
    assert torch.equal(p["rewards"], torch.tensor(r))                       # the metrics keep the real ones


def test_sampled_evaluation_uses_the_same_noise_for_every_policy(sft_dir):
    from flowrl_ray.batch import Batch, BatchMeta
    import numpy as np
    algo = _algorithm(sft_dir, eval_sampled=True, generation_temperature=1.5)
    chunks = algo.generate(1, "eval")
    n = algo.cfg.eval.episodes
    ids, texts = chunks[0]["ids"], chunks[0]["texts"]
    assert len(ids) == 2 * n and algo.pending["sampled"] == [False] * n + [True] * n
    assert chunks[0]["task_ids"][:n] == chunks[0]["task_ids"][n:]                   # the same tasks
    torch.manual_seed(123)                                   # the global stream does not matter
    assert algo.generate(1, "eval")[0]["texts"] == texts                          # a fixed seed's noise
    fa = np.array([1.0, 0.0, 0.25, 0.25], np.float32)
    data = {"ids": ids, "rewards": fa, "task_completion": fa, "field_accuracy": fa,
            "execution_completeness": fa, "unparseable_lines": np.zeros(4)}
    m = algo.eval_metrics([Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=4))])
    assert m["eval/field_accuracy"] == 0.5 and m["eval/sampled/field_accuracy"] == 0.25
    assert m["eval/episodes"] == 2 and m["eval/sampled/return_mean"] == 0.25
    assert m["eval/return_mean"] == 0.5
