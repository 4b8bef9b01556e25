"""FED-GRPO: the disentangled group advantages and the PBRS returns against hand values, the
update's ratios, directions and KL on a tiny EDM, config errors, the committed base EDM and the
resumable pretraining. A tiny pretrain -> FED-GRPO -> eval run through the CLI:
tests/e2e/test_fed_grpo.py."""

import math

import numpy as np
import pytest
import torch

from flowrl_ray.algorithms.advantages import group_center, group_normalize
from flowrl_ray.algorithms.fed_grpo import (FEDGRPO, delta_traces, fed_advantages, fed_advantages_delta,
                                            fed_advantages_pbrs, pbrs_returns, schedule_steps,
                                            summed_advantages)
from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.config import ConfigError, config_from_dict
from flowrl_ray.envs import EnvSpec

TINY_MODEL = {"num_layers": 1, "hidden_size": 16, "diffusion_steps": 6}


def _config(**algo) -> dict:
    return {"name": "fed-test", "algorithm": "fed_grpo", "seed": 0,
            "env": {"family": "molecules", "id": "qm9", "kwargs": {"timeout_s": 5}},
            "train": {"iterations": 2},
            "runtime": {"num_workers": 2, "envs_per_worker": 1, "rollout_length": 1, "checkpoint_interval": 0},
            "eval": {"interval": 2, "episodes": 4, "at_start": True},
            "algo": {"model": dict(TINY_MODEL), "sample_group_size": 2, "each_prompt_sample": 3,
                     "train_micro_batch_size": 6, **algo}}


# ---------------------------------------------------------------------- advantages

def test_fed_advantages_normalise_each_signal_within_its_group_then_mix():
    force = torch.tensor([1.0, 3.0, 2.0, 2.0])
    energy = torch.tensor([0.0, 2.0, 5.0, 1.0])
    groups = torch.tensor([7, 7, 3, 3])                 # any labels, in any order
    adv = fed_advantages(force, energy, groups, force_weight=1.0, energy_weight=0.1, adv_clip_max=5.0)
    # group 7: a_F = (-1, 1) (mean 2, population std 1), a_E = (-1, 1) -> -1.1, 1.1
    # group 3: a_F = (0, 0) (tied), a_E = (1, -1) (mean 3, std 2) -> 0.1, -0.1
    assert torch.allclose(adv, torch.tensor([-1.1, 1.1, 0.1, -0.1]), atol=1e-6)


def test_fed_advantages_are_invariant_to_each_signals_scale_and_zero_for_tied_groups():
    gen = torch.Generator().manual_seed(0)
    force, energy = torch.randn(12, generator=gen), torch.randn(12, generator=gen)
    groups = torch.arange(3).repeat_interleave(4)
    base = fed_advantages(force, energy, groups, 1.0, 0.1, 5.0)
    # disentangled: scaling one signal (eV vs meV) changes nothing, unlike a mixed raw reward
    assert torch.allclose(fed_advantages(force, 1000.0 * energy + 7.0, groups, 1.0, 0.1, 5.0), base, atol=1e-5)
    tied = fed_advantages(torch.ones(4), torch.full((4,), 3.0), torch.zeros(4, dtype=torch.long), 1.0, 0.1, 5.0)
    assert torch.equal(tied, torch.zeros(4))


def test_the_stability_channel_is_a_third_group_normalised_signal():
    force = torch.tensor([1.0, 3.0, 2.0, 2.0])
    energy = torch.tensor([0.0, 2.0, 5.0, 1.0])
    stab = torch.tensor([0.5, 0.5, 0.9, 0.1])             # group 7 tied; group 3: (1, -1) after normalising
    groups = torch.tensor([7, 7, 3, 3])
    adv = fed_advantages(force, energy, groups, 1.0, 0.1, 5.0, stab, stability_weight=2.0)
    # the two-channel values (-1.1, 1.1, 0.1, -0.1) plus 2 * a_S = (0, 0, 2, -2)
    assert torch.allclose(adv, torch.tensor([-1.1, 1.1, 2.1, -2.1]), atol=1e-6)
    assert torch.equal(fed_advantages(force, energy, groups, 1.0, 0.1, 5.0, stab, 0.0),
                       fed_advantages(force, energy, groups, 1.0, 0.1, 5.0))
    # scale-free: the stability reward's units (weights of its terms) do not change A
    assert torch.allclose(fed_advantages(force, energy, groups, 1.0, 0.1, 5.0, 10 * stab - 3, 2.0), adv, atol=1e-5)
    pbrs = fed_advantages_pbrs(torch.tensor([1.0, 3.0]), torch.tensor([[1.0, 0.0], [3.0, 0.0]]), torch.tensor([0, 0]),
                               1.0, 0.5, 5.0, torch.tensor([2.0, 0.0]), stability_weight=1.0)
    # a_S = (1, -1) on every step, added to [[-1.5, -1], [1.5, 1]]
    assert torch.allclose(pbrs, torch.tensor([[-0.5, 0.0], [0.5, 0.0]]), atol=1e-6)


def test_fed_advantages_clip_at_adv_clip_max():
    force = torch.zeros(30)
    force[0] = 10.0                       # one outlier in a group of 30: z = sqrt(29) = 5.385
    adv = fed_advantages(force, torch.zeros(30), torch.zeros(30, dtype=torch.long), 1.0, 0.1, 5.0)
    assert adv[0].item() == pytest.approx(5.0)
    assert adv[1].item() == pytest.approx(-1.0 / np.sqrt(29.0), rel=1e-5)


def test_group_normalize_per_column_matches_a_loop():
    gen = torch.Generator().manual_seed(1)
    values, groups = torch.randn(9, 4, generator=gen), torch.tensor([2, 0, 2, 1, 0, 2, 1, 1, 0])
    out = group_normalize(values, groups)
    for g in range(3):
        rows = values[groups == g]
        expected = (rows - rows.mean(0)) / (rows.std(0, unbiased=False) + 1e-8)
        assert torch.allclose(out[groups == g], expected, atol=1e-6)


def test_group_normalize_over_members_scores_the_others_against_them():
    values = torch.tensor([1.0, 3.0, -10.0, 4.0, 6.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    members = torch.tensor([True, True, False, False, False, False])
    out = group_normalize(values, groups, members=members)
    # group 0: mean 2, std 1 over rows 0 and 1; row 2 scored against them: (-10 - 2) / 1
    assert torch.allclose(out[:3], torch.tensor([-1.0, 1.0, -12.0]), atol=1e-5)
    # group 1 has no member: its own statistics (mean 10/3, population std 2.494)
    assert torch.allclose(out[3:], group_normalize(values[3:], groups[3:]), atol=1e-6)
    with pytest.raises(ValueError, match="members"):
        group_normalize(values, groups, members=members[:4])


def test_fed_advantages_over_valid_members_keep_the_invalid_penalty():
    # one group of 4: two valid molecules (force -1, -3; energy -0.5, -1.5) and two RDKit-invalid
    # ones at the penalty floor (-clip - 2 = -7 in both channels)
    force = torch.tensor([-1.0, -3.0, -7.0, -7.0])
    energy = torch.tensor([-0.5, -1.5, -7.0, -7.0])
    groups, valid = torch.zeros(4, dtype=torch.long), torch.tensor([True, True, False, False])
    adv = fed_advantages(force, energy, groups, 1.0, 0.1, 5.0, valid=valid)
    # valid: a_F = (1, -1) (mean -2, std 1), a_E = (1, -1) (mean -1, std 0.5) -> 1.1, -1.1;
    # invalid: a_F = (-7 + 2) / 1 = -5, a_E = (-7 + 1) / 0.5 = -12 -> clip -5; -5 - 0.5 -> clip -5
    assert torch.allclose(adv, torch.tensor([1.1, -1.1, -5.0, -5.0]), atol=1e-5)
    # over the whole group instead, the penalty dominates both statistics: the valid pair's
    # difference in force shrinks from 2 to 0.65 standard units of A
    plain = fed_advantages(force, energy, groups, 1.0, 0.1, 5.0)
    assert (plain[0] - plain[1]).item() == pytest.approx(2 / force.std(unbiased=False).item()
                                                         + 0.1 / energy.std(unbiased=False).item(), rel=1e-4)
    assert (adv[0] - adv[1]).item() > (plain[0] - plain[1]).item()
    # one valid member: it gets 0, the invalid ones the floor
    one = fed_advantages(force, energy, groups, 1.0, 0.1, 5.0, valid=torch.tensor([True, False, False, False]))
    assert torch.allclose(one, torch.tensor([0.0, -5.0, -5.0, -5.0]), atol=1e-5)
    # pbrs and delta read the same valid set
    pbrs = fed_advantages_pbrs(force, energy[:, None].repeat(1, 2), groups, 1.0, 0.1, 5.0, valid=valid)
    assert torch.allclose(pbrs, adv[:, None].expand(-1, 2), atol=1e-5)
    delta = fed_advantages_delta(force[:, None], energy[:, None], groups, 1.0, 0.1, 5.0, 1.0, valid=valid)
    assert torch.allclose(delta[:, 0], adv, atol=1e-5)


def test_summed_reward_baseline_is_one_group_normalised_reward():
    force = torch.tensor([-1.0, -3.0, -2.0, -2.0])
    energy = torch.tensor([-10.0, 10.0, 0.0, -40.0])
    groups = torch.tensor([0, 0, 1, 1])
    adv = summed_advantages(force, energy, groups, 1.0, 0.1, 5.0)
    # r = F + 0.1 E: group 0 (-2, -2) tied -> 0, 0; group 1 (-2, -6) -> (1, -1)
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, 1.0, -1.0]), atol=1e-5)
    # the separate channels disagree here: group 0's force prefers row 0, its energy row 1
    assert torch.allclose(fed_advantages(force, energy, groups, 1.0, 0.1, 5.0)[:2], torch.tensor([0.9, -0.9]))
    stab = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert torch.allclose(summed_advantages(force, energy, groups, 1.0, 0.1, 5.0, stab, 2.0)[:2],
                          torch.tensor([-1.0, 1.0]), atol=1e-5)
    valid = torch.tensor([True, True, True, False])
    # group 1 with one valid member (r = -2): it gets 0, the invalid one (-6) is scored against it -> clip
    assert torch.allclose(summed_advantages(force, energy, groups, 1.0, 0.1, 5.0, valid=valid)[2:],
                          torch.tensor([0.0, -5.0]), atol=1e-5)


def test_group_center_subtracts_the_members_mean():
    values = torch.tensor([[1.0, 0.0], [3.0, 0.0], [8.0, 6.0], [-1.0, 2.0]])
    groups = torch.tensor([0, 0, 0, 1])
    assert torch.allclose(group_center(values, groups), torch.tensor([[-3.0, -2.0], [-1.0, -2.0], [4.0, 4.0],
                                                                      [0.0, 0.0]]))
    members = torch.tensor([True, True, False, True])        # group 0's mean over rows 0 and 1: (2, 0)
    assert torch.allclose(group_center(values, groups, members)[:3], torch.tensor([[-1.0, 0.0], [1.0, 0.0],
                                                                                   [6.0, 6.0]]))


def test_pbrs_returns_by_hand():
    potentials = torch.tensor([[1.0, 2.0, 3.0]])           # Psi_t at the K = 3 recorded steps
    returns = pbrs_returns(potentials, torch.tensor([5.0]), steps=torch.tensor([3, 2, 1]),
                           scheduled=torch.tensor([True, False, True]), gamma=0.5)
    # t = 3: 0.5^3 * 5 - 1 = -0.375; t = 2 not scheduled: 0; t = 1: 0.5 * 5 - 3 = -0.5
    assert torch.allclose(returns, torch.tensor([[-0.375, 0.0, -0.5]]))


def test_pbrs_advantages_broadcast_the_force_term_and_normalise_energy_per_step():
    adv = fed_advantages_pbrs(torch.tensor([1.0, 3.0]), torch.tensor([[1.0, 0.0], [3.0, 0.0]]),
                              torch.tensor([0, 0]), force_weight=1.0, energy_weight=0.5, adv_clip_max=5.0)
    # a_F = (-1, 1) on every step; step 0's returns (1, 3) -> (-1, 1); step 1 tied -> 0
    assert torch.allclose(adv, torch.tensor([[-1.5, -1.0], [1.5, 1.0]]), atol=1e-6)


def test_shaping_scheduler_selects_steps_by_hand():
    recorded = list(range(10, 0, -1))                              # t = 10 .. 1
    assert schedule_steps(recorded, 10, "uniform", stride=3) == [10, 7, 4, 1]
    assert schedule_steps(recorded, 10, "uniform", stride=4) == [10, 6, 2, 1]          # + the terminal step
    assert schedule_steps(recorded, 10, "uniform", stride=4, include_terminal=False) == [10, 6, 2]
    # adaptive: coarse (3) while t > 0.5 * 10, then fine (2): 10, 7, 4 | 2, and the terminal 1
    assert schedule_steps(recorded, 10, "adaptive", coarse_stride=3, fine_stride=2,
                          threshold_fraction=0.5) == [10, 7, 4, 2, 1]
    assert schedule_steps(recorded[4:], 10, "uniform", stride=1) == recorded[4:]     # after a shared prefix


def test_delta_traces_and_advantages_by_hand():
    traces = delta_traces(torch.tensor([[1.0, 2.0, 4.0]]), torch.tensor([5.0]), torch.tensor([5, 3, 1]), gamma=0.5)
    # D_1 = 0.5^2 * 2 - 1, D_2 = 0.5^2 * 4 - 2, D_3 = R_final
    assert torch.allclose(traces, torch.tensor([[-0.5, -1.0, 5.0]]))
    f = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    e = torch.tensor([[4.0, 0.0], [0.0, 0.0]])
    adv = fed_advantages_delta(f, e, torch.tensor([0, 0]), 1.0, 0.5, 5.0, terminal_weight=2.0)
    # columns normalised separately: a^F = (-1, 1) in both; a^E col 0 = (1, -1), col 1 tied (0)
    # A = a^F + 0.5 a^E, the terminal column x 2
    assert torch.allclose(adv, torch.tensor([[-0.5, -2.0], [0.5, 2.0]]), atol=1e-6)
    with_s = fed_advantages_delta(f, e, torch.tensor([0, 0]), 1.0, 0.5, 5.0, 2.0, torch.tensor([1.0, 0.0]), 1.0)
    assert torch.allclose(with_s, torch.tensor([[0.5, 0.0], [-0.5, 0.0]]), atol=1e-6)


def test_delta_mode_gives_advantages_only_at_scheduled_transitions():
    algo = _algo(shaping={"mode": "delta", "stride": 2, "terminal_weight": 2.0})
    chunks = algo.generate(2)
    scheduled = algo.pending["x0_steps"]
    assert scheduled == [6, 4, 2, 1]
    adv = algo.prepare(_scored(chunks, force=[1, 2, 3, 3, 2, 1], energy=[0] * 6))["advantages"]
    steps = algo.pending["trajectory"]["t"].tolist()
    for i, t in enumerate(steps):
        assert (adv[:, i] != 0).any() == (t == 1)                  # zero shaping traces: only the terminal column
    # terminal column: force normalised in each group of 3, times terminal_weight
    a_f = torch.tensor([-1.0, 0.0, 1.0]) * math.sqrt(1.5)
    assert torch.allclose(adv[:, steps.index(1)], 2.0 * torch.cat([a_f, -a_f]), atol=1e-5)


# ---------------------------------------------------------------------- the update on a tiny EDM

def _algo(**algo) -> FEDGRPO:
    torch.manual_seed(0)
    return FEDGRPO(config_from_dict(_config(**algo)), EnvSpec((1,), 1), torch.device("cpu"))


def _scored(chunks: list[dict], force: list[float], energy: list[float],
            stability: list[float] | None = None, valid: list[int] | None = None) -> list[Batch]:
    batches = []
    for chunk in chunks:
        ids = np.asarray(chunk["ids"])
        k = len(ids)
        data = {"ids": ids, "force_reward": np.asarray(force, np.float32)[ids],
                "energy_reward": np.asarray(energy, np.float32)[ids],
                "energy_eV": np.zeros(k), "formation_energy_per_atom_eV": np.zeros(k), "rms_force": np.ones(k),
                "stable": np.zeros(k), "stable_atom_fraction": np.zeros(k),
                "valid": np.asarray(valid if valid is not None else np.zeros(len(force)), np.float32)[ids],
                "stability_reward": np.asarray(stability if stability is not None else np.zeros(len(force)),
                                               np.float32)[ids],
                "force_gated": np.zeros(k), "energy_gated": np.zeros(k), "under_bonded": np.zeros(k),
                "over_bonded": np.zeros(k), "overlap": np.zeros(k),
                "smiles": np.array([""] * k, dtype=object), "reason": np.array(["ok"] * k, dtype=object)}
        if "shaping" in chunk:
            data["shaping_energy_reward"] = np.zeros((k, len(chunk["shaping"][0])), np.float32)
            data["shaping_force_reward"] = np.zeros((k, len(chunk["shaping"][0])), np.float32)
        batches.append(Batch(data, BatchMeta(0, 0, k)))
    return batches


def test_prepare_normalises_over_valid_members_and_offers_the_summed_baseline():
    force, energy = [-1.0, -3.0, -7.0, -2.0, -2.0, -4.0], [-0.5, -1.5, -7.0, 0.0, 0.0, -20.0]
    valid = [1, 1, 0, 1, 1, 1]
    algo = _algo()
    adv = algo.prepare(_scored(algo.generate(2), force, energy, valid=valid))["advantages"]
    # group 0 as in test_fed_advantages_over_valid_members_keep_the_invalid_penalty
    assert torch.allclose(adv[:3, 0], torch.tensor([1.1, -1.1, -5.0]), atol=1e-5)
    assert torch.equal(adv, adv[:, :1].expand_as(adv))                  # one A for every transition
    algo = _algo(normalize_over="group")
    plain = algo.prepare(_scored(algo.generate(2), force, energy, valid=valid))["advantages"]
    assert torch.allclose(plain[:, 0], fed_advantages(torch.tensor(force), torch.tensor(energy),
                                                      torch.arange(2).repeat_interleave(3), 1.0, 0.1, 5.0))
    algo = _algo(advantage_mode="summed")
    summed = algo.prepare(_scored(algo.generate(2), force, energy, valid=valid))["advantages"]
    # group 1: r = F + 0.1 E = (-2, -2, -6): the tied pair sits above the third
    expected = summed_advantages(torch.tensor(force), torch.tensor(energy), torch.arange(2).repeat_interleave(3),
                                 1.0, 0.1, 5.0, valid=torch.tensor(valid).bool())
    assert torch.allclose(summed[:, 0], expected, atol=1e-6)
    assert summed[3, 0] == summed[4, 0] and summed[3, 0] > 0 > summed[5, 0]
    algo = _algo(zero_mean_groups=True)
    centred = algo.prepare(_scored(algo.generate(2), force, energy, valid=valid))["advantages"]
    # group 0: (1.1, -1.1, -5) minus its mean -5/3; group 1 already sums to 0 up to the clip
    assert torch.allclose(centred[:3, 0], torch.tensor([1.1, -1.1, -5.0]) + 5 / 3, atol=1e-5)
    assert torch.allclose(centred[:, 0].view(2, 3).sum(1), torch.zeros(2), atol=1e-5)


def test_generation_records_branched_transitions_in_groups():
    algo = _algo(shared_prefix_steps=2)
    chunks = algo.generate(2)
    traj = algo.pending["trajectory"]
    assert [len(c["ids"]) for c in chunks] == [3, 3]
    assert traj["t"].tolist() == [4, 3, 2, 1]                    # 6 steps, the first 2 shared
    assert traj["logp"].shape == (4, 6) and traj["z"].shape[:2] == (5, 6)
    n_atoms = algo.pending["n_atoms"]
    assert torch.equal(n_atoms[:3], n_atoms[:1].expand(3)) and torch.equal(n_atoms[3:], n_atoms[3:4].expand(3))
    for chunk in chunks:
        for pos, types in zip(chunk["positions"], chunk["atom_types"]):
            assert pos.shape == (len(types), 3)


def test_unscored_rows_get_zero_advantage_and_pbrs_gives_per_step_advantages():
    algo = _algo(shaping={"mode": "pbrs_return_to_go", "stride": 2})
    chunks = algo.generate(2)
    assert len(chunks[0]["shaping"][0]) == 4                      # steps 6, 4, 2 and the terminal 1
    prepared = algo.prepare(_scored(chunks[:1], force=[1, 2, 3, 0, 0, 0], energy=[0, 1, 0, 0, 0, 0]))
    adv = prepared["advantages"]
    assert adv.shape == (6, 6)
    assert torch.equal(adv[3:], torch.zeros(3, 6))                # the second chunk never came back
    assert not torch.allclose(adv[:3, 0], adv[:3, 1])             # scheduled vs unscheduled steps differ


def test_prepare_mixes_the_stability_channel_with_its_weight():
    algo = _algo(stability_adv_weight=0.5)
    chunks = algo.generate(2)                                     # 2 groups of 3
    scored = _scored(chunks, force=[1, 1, 1, 2, 2, 2], energy=[0] * 6, stability=[0.2, 0.5, 0.8, 1, 1, 1])
    adv = algo.prepare(scored)["advantages"]
    # force and energy tied in both groups: A = 0.5 * a_S; group 0's a_S = (-1, 0, 1) * sqrt(3/2)
    expected = 0.5 * torch.tensor([-1.0, 0.0, 1.0]) * math.sqrt(1.5)
    assert torch.allclose(adv[:3], expected[:, None].expand(3, adv.shape[1]), atol=1e-5)
    assert torch.equal(adv[3:], torch.zeros_like(adv[3:]))
    plain = _algo()                                               # default w_S = 0: no stability signal
    plain.generate(2)
    assert torch.equal(plain.prepare(scored)["advantages"], torch.zeros_like(adv))


# ---------------------------------------------------------------------- config errors

@pytest.mark.parametrize("change, key", [
    ({"env": {"family": "gym", "id": "Pendulum-v1"}}, "env.family"),
    ({"algo": {"model": dict(TINY_MODEL), "shared_prefix_steps": 6}}, "algo.shared_prefix_steps"),
    ({"algo": {"model": dict(TINY_MODEL), "each_prompt_sample": 1}}, "algo.each_prompt_sample"),
    ({"algo": {"model": dict(TINY_MODEL), "clip_rnage": 0.1}}, "algo.clip_rnage"),
    ({"env": {"family": "molecules", "id": "qm9", "kwargs": {"backend": "dft"}}}, "env.kwargs.backend"),
    ({"algo": {"model": dict(TINY_MODEL), "advantage_mode": "summed", "shaping": {"mode": "delta"}}},
     "algo.advantage_mode"),
    ({"algo": {"model": dict(TINY_MODEL), "advantage_mode": "sum"}}, "algo.advantage_mode"),
    ({"algo": {"model": dict(TINY_MODEL), "normalize_over": "valid_only"}}, "algo.normalize_over"),
])
def test_config_mistakes_name_the_key(change, key):
    data = {**_config(), **change}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        cfg = config_from_dict(data)
        from flowrl_ray.envs import env_family
        env_family(cfg.env.family).spec(cfg.env)


def test_base_model_must_exist_and_match_the_architecture(tmp_path):
    from dataclasses import asdict
    from flowrl_ray.models.edm import EDM, EDMModelConfig
    cfg = config_from_dict(_config(base_model=str(tmp_path / "missing.pt")))
    with pytest.raises(ConfigError, match=r"algo\.base_model"):
        FEDGRPO.preflight(cfg, EnvSpec((1,), 1))
    other = EDMModelConfig(**{**TINY_MODEL, "hidden_size": 32})
    torch.save({"state_dict": EDM(other).state_dict(), "model_config": asdict(other),
                "node_histogram": np.r_[0.0, np.ones(29) / 29]}, tmp_path / "base.pt")
    cfg = config_from_dict(_config(base_model=str(tmp_path / "base.pt")))
    with pytest.raises(ConfigError, match=r"algo\.model\.hidden_size"):
        FEDGRPO.preflight(cfg, EnvSpec((1,), 1))


# ---------------------------------------------------------------------- the pretraining lr, the molecule summary

def test_lr_multiplier_warms_up_then_follows_the_cosine_to_its_floor():
    from flowrl_ray.optim import lr_multiplier
    f = lr_multiplier("cosine", total_steps=12, warmup_steps=2, min_ratio=0.3)
    assert [f(0), f(1)] == [0.5, 1.0]                            # linear warm-up over 2 steps
    assert f(2) == pytest.approx(1.0)                            # cosine starts at 1 ...
    assert f(7) == pytest.approx(0.3 + 0.7 * 0.5)                # ... half-way: the mid point
    assert f(12) == pytest.approx(0.3) and f(50) == pytest.approx(0.3)   # floor, held after
    assert lr_multiplier("constant", 10)(7) == 1.0
    with pytest.raises(ValueError):
        lr_multiplier("exponential", 10)


def test_molecule_summary_by_hand():
    from flowrl_ray.algorithms.fed_grpo import molecule_summary
    s = {"force_reward": torch.tensor([-1.0, -3.0, float("nan"), -2.0]),
         "energy_reward": torch.tensor([1.0, 2.0, float("nan"), 3.0]),
         "formation_energy_per_atom_eV": torch.tensor([-4.0, -2.0, float("nan"), -3.0]),
         "rms_force": torch.tensor([1.0, 3.0, float("nan"), 2.0]),
         "stable": torch.tensor([1.0, 0.0, float("nan"), 0.0]),
         "stable_atom_fraction": torch.tensor([1.0, 0.5, float("nan"), 0.0]),
         "valid": torch.tensor([1.0, 1.0, float("nan"), 1.0]),
         "stability_reward": torch.tensor([1.0, 0.2, float("nan"), -0.6]),
         "force_gated": torch.tensor([0.0, 1.0, float("nan"), 1.0]),
         "energy_gated": torch.tensor([0.0, 0.0, float("nan"), 1.0]),
         "under_bonded": torch.tensor([0.0, 2.0, float("nan"), 4.0]),
         "over_bonded": torch.tensor([0.0, 1.0, float("nan"), 0.0]),
         "overlap": torch.tensor([0.0, 0.0, float("nan"), 1.0]),
         "smiles": ["CO", "CO", "", "CCO"], "reason": ["ok", "ok", "not_scored", "overlap"]}
    out = molecule_summary(s)
    # unscored rows (NaN) are left out of the means; uniqueness = unique SMILES among the valid
    assert out["force_reward_mean"] == pytest.approx(-2.0) and out["rms_force_eV_per_A"] == pytest.approx(2.0)
    assert out["molecule_stability"] == pytest.approx(1 / 3) and out["atom_stability"] == pytest.approx(0.5)
    assert out["validity"] == pytest.approx(1.0) and out["uniqueness"] == pytest.approx(2 / 3)
    assert out["valid_and_unique"] == pytest.approx(2 / 3)
    assert out["reason/ok"] == 0.5 and out["reason/overlap"] == 0.25 and out["reason/not_scored"] == 0.25
    assert out["stability_reward_mean"] == pytest.approx(0.2) and out["force_gated_fraction"] == pytest.approx(2 / 3)
    assert out["energy_gated_fraction"] == pytest.approx(1 / 3) and out["overlap_fraction"] == pytest.approx(1 / 3)
    assert out["under_bonded_atoms"] == pytest.approx(2.0) and out["over_bonded_atoms"] == pytest.approx(1 / 3)


def test_a_non_finite_loss_skips_the_epochs_step_and_counts_it(monkeypatch):
    """One micro-batch whose log-prob is NaN: that epoch's accumulated gradients are dropped,
    the weights stay, the skip is counted; a finite update then steps."""
    import flowrl_ray.algorithms.fed_grpo as fed
    algo = _algo(epochs=1)
    chunks = algo.generate(2)
    prepared = algo.prepare(_scored(chunks, force=[1, 2, 3, 0, 1, 2], energy=[0, 1, 0, 2, 0, 1]))
    before = {k: v.clone() for k, v in algo.model.state_dict().items()}
    real = fed.step_log_prob

    def poisoned(model, *args):
        logp, mu = real(model, *args)
        return logp * float("nan"), mu

    monkeypatch.setattr(fed, "step_log_prob", poisoned)
    out = algo.update(prepared)
    assert out["fed_grpo/skipped_updates"] == 1.0 and algo.skipped_updates == 1
    for k, v in algo.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in algo.model.parameters())
    monkeypatch.setattr(fed, "step_log_prob", real)
    algo.update(prepared)
    assert algo.skipped_updates == 1
    assert any(not torch.equal(v, before[k]) for k, v in algo.model.state_dict().items())


def test_policy_gradients_are_the_direction_of_the_updates_first_step():
    """At the weights that generated, one plain SGD step of the update (one micro-batch, no KL,
    no clipping of the norm) moves the weights by lr x the policy gradient of its advantages;
    gradients are linear in the advantages and average over the chosen transitions."""
    algo = _algo(kl_coeff=0.0, epochs=1, max_grad_norm=1e9)
    prepared = algo.prepare(_scored(algo.generate(2), force=[1, 2, 3, 0, 1, 2], energy=[0, 1, 0, 2, 0, 1]))
    adv = prepared["advantages"]                                              # [6, K]
    other = torch.linspace(-1, 1, adv.numel()).reshape(adv.shape)
    g, g_other, g_sum = algo.policy_gradients(prepared, [adv, other, adv + other])
    k = adv.shape[1]
    g_first, g_rest = algo.policy_gradients(prepared, [adv], steps=[0])[0], algo.policy_gradients(
        prepared, [adv], steps=range(1, k))[0]
    close = lambda a, b: float((a - b).norm() / b.norm()) < 1e-5      # noqa: E731  (float32 gradients)
    assert g.norm() > 0 and close(g_sum, g + g_other)
    assert close((g_first + (k - 1) * g_rest) / k, g)
    before = torch.cat([q.detach().flatten() for q in algo.model.parameters()]).double()
    lr = 1e-3
    algo.opt = torch.optim.SGD(algo.model.parameters(), lr=lr)
    algo.scheduler = torch.optim.lr_scheduler.LambdaLR(algo.opt, lambda _: 1.0)
    algo.update(prepared)
    moved = torch.cat([q.detach().flatten() for q in algo.model.parameters()]).double() - before
    assert torch.nn.functional.cosine_similarity(moved, g, dim=0) > 0.9999
    assert close(moved, lr * g)
