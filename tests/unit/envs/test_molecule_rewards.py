"""The molecules family's reward rules without a force field: the reward and gating rules by hand,
the settings, the stability channel. GFN2-xTB / MMFF94 single points and the scorer:
tests/integration/test_molecule_rewards.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("tblite")
pytest.importorskip("rdkit")

from flowrl_ray.config import ConfigError  # noqa: E402
from flowrl_ray.envs import env_family  # noqa: E402
from flowrl_ray.envs.molecules.forcefield import FFResult  # noqa: E402
from flowrl_ray.envs.molecules.rewards import REASONS, RewardSettings, molecule_rewards  # noqa: E402

#: valence reports (chemistry.valence_report) of a stable molecule and of one with 3 of 4 atoms stable
STABLE = {"n": 4, "under_bonded": 0, "over_bonded": 0, "stable_atom_fraction": 1.0, "soft_missing": 0.0,
          "soft_excess": 0.0}
PART = {"n": 4, "under_bonded": 1, "over_bonded": 0, "stable_atom_fraction": 0.75, "soft_missing": 0.25,
        "soft_excess": 0.0}


def test_molecule_rewards_by_hand():
    forces = np.zeros((4, 3))
    forces[0] = [3.0, 4.0, 0.0]                          # |F| = 5
    forces[1] = [0.0, 0.0, 100.0]                        # capped to 10
    r = FFResult(True, "ok", 4, energy_eV=-500.0, formation_energy_eV=-24.0, forces=forces, seconds=0.01)
    s = RewardSettings(force_clip=10.0, energy_clip=5.0, invalid_penalty_scale=0.0)
    out = molecule_rewards(r, STABLE, s)
    assert out["force_reward"] == pytest.approx(-math.sqrt((25 + 100) / 4))
    assert out["rms_force"] == pytest.approx(math.sqrt((25 + 100 ** 2) / 4))
    assert out["formation_energy_per_atom_eV"] == -6.0
    assert out["energy_reward"] == 5.0                   # +6 eV/atom clipped to 5
    assert out["reward"] == pytest.approx(out["force_reward"] + 5.0)
    assert out["reason"] == "ok" and not out["force_gated"] and not out["energy_gated"]
    assert molecule_rewards(r, PART, s)["reason"] == "ok"          # no gate set: stability ignored

    e_gate = molecule_rewards(r, PART, RewardSettings(force_clip=10.0, energy_clip=5.0, energy_only_if_stable=True))
    assert e_gate["energy_reward"] == -5.0 and e_gate["force_reward"] == out["force_reward"]
    assert e_gate["energy_gated"] and not e_gate["force_gated"] and e_gate["reason"] == "unstable_gated"
    f_gate = molecule_rewards(r, PART, RewardSettings(force_clip=10.0, energy_clip=5.0, force_only_if_stable=True))
    assert f_gate["force_reward"] == -10.0 and f_gate["energy_reward"] == 5.0 and f_gate["reason"] == "unstable_gated"
    assert molecule_rewards(r, STABLE, RewardSettings(force_only_if_stable=True))["reason"] == "ok"

    weighted = RewardSettings(force_clip=10.0, energy_clip=5.0, force_weight=2.0, energy_weight=0.5)
    assert molecule_rewards(r, STABLE, weighted)["reward"] == pytest.approx(2 * out["force_reward"] + 2.5)
    # RDKit-invalid: ignored unless invalid_penalty_scale > 0, then below every scored molecule
    assert molecule_rewards(r, STABLE, s, valid=False)["reason"] == "ok"
    inv = molecule_rewards(r, STABLE, RewardSettings(force_clip=10.0, energy_clip=5.0, invalid_penalty_scale=1.0),
                           valid=False)
    assert (inv["force_reward"], inv["energy_reward"], inv["reason"]) == (-11.0, -6.0, "rdkit_invalid")
    high = FFResult(True, "ok", 2, 10.0, 60.0, np.zeros((2, 3)))
    assert molecule_rewards(high, STABLE, s)["energy_reward"] == -5.0
    for reason in ("timeout", "scf_failed", "nonfinite_output", "mmff_setup_failed"):
        failed = molecule_rewards(FFResult(False, reason, 3), STABLE, s)
        assert (failed["force_reward"], failed["energy_reward"], failed["reason"]) == (-10.0, -5.0, reason)
        assert math.isnan(failed["rms_force"]) and reason in REASONS


def env_cfg(id="qm9", **kwargs):
    return SimpleNamespace(family="molecules", id=id, kwargs=kwargs)


def test_settings_validation_names_the_key():
    assert RewardSettings.from_env_cfg(env_cfg()) == RewardSettings()
    s = RewardSettings.from_env_cfg(env_cfg(backend="mmff", timeout_s=3, force_clip=5, energy_only_if_stable=True))
    assert (s.backend, s.timeout_s, s.force_clip, s.energy_only_if_stable) == ("mmff", 3.0, 5.0, True)
    bad = [({"force_clp": 3}, r"unknown config key 'env.kwargs.force_clp'; did you mean 'env.kwargs.force_clip'"),
           ({"backend": "uma"}, r"'env.kwargs.backend': must be one of \['gfn2', 'mmff'\]"),
           ({"max_iter": 0}, r"'env.kwargs.max_iter'"), ({"max_iter": 2.5}, r"'env.kwargs.max_iter'"),
           ({"timeout_s": 0}, r"'env.kwargs.timeout_s'"), ({"energy_clip": float("inf")}, r"'env.kwargs.energy_clip'"),
           ({"force_clip": -1}, r"'env.kwargs.force_clip'"), ({"min_distance": "0.5"}, r"'env.kwargs.min_distance'"),
           ({"force_only_if_stable": 1}, r"'env.kwargs.force_only_if_stable': expected bool"),
           ({"invalid_penalty_scale": -0.1}, r"'env.kwargs.invalid_penalty_scale'"),
           ({"energy_weight": True}, r"'env.kwargs.energy_weight'"),
           ({"gate_stable_atom_fraction": 1.5}, r"'env.kwargs.gate_stable_atom_fraction': must be <= 1")]
    for kwargs, message in bad:
        with pytest.raises(ConfigError, match=message):
            RewardSettings.from_env_cfg(env_cfg(**kwargs))
    family = env_family("molecules")
    with pytest.raises(ConfigError, match=r"config key 'env.id': the molecules family takes a dataset name \(qm9\)"):
        family.spec(env_cfg(id="Pendulum-v1"))
    assert family.spec(env_cfg()).obs_shape == (1,) and family.spec(env_cfg()).action_dim == 1


# --------------------------------------------------------------------------- the stability channel

def _sig(z):
    return 1.0 / (1.0 + math.exp(-z))


def test_valence_report_counts_under_and_over_bonded_atoms_by_hand():
    from flowrl_ray.envs.molecules.chemistry import check_stability, valence_report
    h2 = valence_report(np.array([[0, 0, 0], [0.74, 0, 0]]), np.array([0, 0]))     # H-H single below 0.84 Å
    assert (h2["under_bonded"], h2["over_bonded"], h2["stable_atom_fraction"]) == (0, 0, 1.0)
    assert h2["soft_missing"] == pytest.approx(1 - _sig((0.84 - 0.74) / 0.02)) and h2["soft_excess"] == 0.0
    apart = valence_report(np.array([[0, 0, 0], [1.0, 0, 0]]), np.array([0, 0]))   # no bond: both short of 1
    assert (apart["under_bonded"], apart["stable_atom_fraction"]) == (2, 0.0)
    assert apart["soft_missing"] == pytest.approx(1 - _sig((0.84 - 1.0) / 0.02))
    chain = np.array([[0, 0, 0], [0.74, 0, 0], [1.48, 0, 0]])                      # H-H-H: the middle H has 2
    h3 = valence_report(chain, np.array([0, 0, 0]))
    assert (h3["under_bonded"], h3["over_bonded"]) == (0, 1)
    assert h3["stable_atom_fraction"] == pytest.approx(2 / 3) == check_stability(chain, [0, 0, 0])[1] / 3
    one = _sig((0.84 - 0.74) / 0.02)
    assert h3["soft_excess"] == pytest.approx((2 * one - 1) / 3)
    assert h3["soft_missing"] == pytest.approx(2 * (1 - one) / 3, abs=1e-9)
    # C=O at 1.20 Å: single (1.53) and double (1.25) thresholds passed, triple (1.16) not: order 2
    co = valence_report(np.array([[0, 0, 0], [1.20, 0, 0]]), np.array([1, 3]))
    assert (co["under_bonded"], co["over_bonded"]) == (1, 0)                        # C has 2 of 4, O has 2
    v = _sig((1.53 - 1.20) / 0.02) + _sig((1.25 - 1.20) / 0.02) + _sig((1.16 - 1.20) / 0.02)
    assert co["soft_missing"] == pytest.approx((max(4 - v, 0) + max(2 - v, 0)) / 2)
    assert co["soft_excess"] == pytest.approx(max(v - 2, 0) / 2)
    bad = valence_report(np.array([[0, 0, 0], [np.nan, 0, 0]]), np.array([1, 0]))  # unusable: all missing
    assert (bad["under_bonded"], bad["stable_atom_fraction"], bad["soft_missing"]) == (2, 0.0, 2.5)


def test_stability_reward_and_the_gate_on_the_stable_atom_fraction():
    from flowrl_ray.envs.molecules.rewards import stability_reward
    r = FFResult(True, "ok", 4, energy_eV=-500.0, formation_energy_eV=-24.0, forces=np.zeros((4, 3)), seconds=0.01)
    s = RewardSettings()
    assert s.invalid_penalty_scale == 2.0                                           # Elign's scripts
    assert stability_reward(PART, s) == pytest.approx(0.75 - 0.25)
    w = RewardSettings(atom_stability_weight=2.0, valence_under_weight=4.0, valence_over_weight=3.0)
    assert stability_reward({**PART, "soft_excess": 0.1}, w) == pytest.approx(1.5 - 1.0 - 0.3)
    assert molecule_rewards(r, PART, s)["stability_reward"] == pytest.approx(0.5)
    # never gated, never floored: an invalid or unscorable molecule keeps its stability reward
    assert molecule_rewards(r, PART, s, valid=False)["stability_reward"] == pytest.approx(0.5)
    assert molecule_rewards(FFResult(False, "timeout", 4), PART, s)["stability_reward"] == pytest.approx(0.5)
    gate = dict(energy_only_if_stable=True, force_only_if_stable=True)
    assert molecule_rewards(r, PART, RewardSettings(**gate))["reason"] == "unstable_gated"   # 1.0: every atom
    loose = molecule_rewards(r, PART, RewardSettings(gate_stable_atom_fraction=0.7, **gate))
    assert loose["reason"] == "ok" and not loose["force_gated"] and not loose["energy_gated"]
    assert molecule_rewards(r, PART, RewardSettings(gate_stable_atom_fraction=0.8, **gate))["energy_gated"]
    with pytest.raises(ConfigError, match=r"env.kwargs.gate_stable_atom_fraction"):
        RewardSettings.from_env_cfg(env_cfg(gate_stable_atom_fraction=1.5))
    with pytest.raises(ConfigError, match=r"env.kwargs.valence_soft_temperature"):
        RewardSettings.from_env_cfg(env_cfg(valence_soft_temperature=0))
