"""The molecules family's force fields: GFN2-xTB / MMFF94 single points in a child process (units,
references, timeouts, failures) and the scorer on real molecules (the reward rules alone:
tests/unit/envs/test_molecule_rewards.py)."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tblite")
pytest.importorskip("rdkit")

from flowrl_ray.envs import env_family  # noqa: E402
from flowrl_ray.envs.molecules import forcefield as ffmod  # noqa: E402
from flowrl_ray.envs.molecules.forcefield import BOHR_ANGSTROM, HARTREE_EV, KCAL_MOL_EV, ForceField  # noqa: E402
from flowrl_ray.envs.molecules.rewards import REASONS, RewardSettings, molecule_rewards  # noqa: E402
from flowrl_ray.envs.molecules.scorer import MoleculeScorer  # noqa: E402
from unit.envs.test_molecule_rewards import PART, env_cfg  # noqa: E402

# ASE's g2 water (Å; types O H H) and GFN2-xTB's answer for it as published in the xtb-python
# docs (ASE calculator example, https://xtb-python.readthedocs.io/en/latest/ase-calculator.html):
# E = -137.9677758730299 eV (= -5.0702 Eh), forces in eV/Å.
WATER = (np.array([[0.0, 0.0, 0.119262], [0.0, 0.763239, -0.477047], [0.0, -0.763239, -0.477047]]),
         np.array([3, 0, 0]))
WATER_PUBLISHED_EV = -137.9677758730299
WATER_PUBLISHED_FORCES = np.array([[0.0, 0.0, -0.749514699], [0.0, -0.153501989, 0.374757349],
                                   [0.0, 0.153501989, 0.374757349]])
METHANE = (np.array([[0.0, 0.0, 0.0], [0.629, 0.629, 0.629], [-0.629, -0.629, 0.629],
                     [-0.629, 0.629, -0.629], [0.70, -0.60, -0.62]]), np.array([1, 0, 0, 0, 0]))


def qm9_head(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first n QM9 molecules (positions Å, atom types) straight from qm9pack's first CSV."""
    spec = importlib.util.find_spec("qm9pack")
    if spec is None:
        pytest.skip("qm9pack not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "qm9_part1.csv"
    lookup = {"H": 0, "C": 1, "N": 2, "O": 3, "F": 4}
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if len(out) == n:
                break
            symbols = row["Elements"].strip("[]").replace("'", "").split(",")
            xyz = np.array(row["XYZ_Ang"].replace("[", "").replace("]", "").split(","), dtype=float)
            out.append((xyz.reshape(-1, 3), np.array([lookup[s.strip()] for s in symbols])))
    return out


@pytest.fixture(scope="module")
def gfn2():
    ff = ForceField("gfn2")
    yield ff
    ff.close()


def tblite_by_hand(positions, numbers, **kw):
    from tblite.interface import Calculator
    calc = Calculator("GFN2-xTB", np.asarray(numbers), np.asarray(positions) / BOHR_ANGSTROM, **kw)
    calc.set("verbosity", 0)
    res = calc.singlepoint()
    return res.get("energy"), res.get("gradient")


def test_gfn2_water_matches_a_direct_tblite_call_and_the_published_value(gfn2):
    r = gfn2.evaluate(*WATER)
    assert r.ok and r.reason == "ok" and r.n_atoms == 3 and r.forces.shape == (3, 3)
    e_h, grad = tblite_by_hand(WATER[0], [8, 1, 1])
    assert r.energy_eV == pytest.approx(e_h * 27.211386245988, abs=1e-6)
    np.testing.assert_allclose(r.forces, -grad * 27.211386245988 / 0.529177210903, atol=1e-8)
    assert r.energy_eV / HARTREE_EV == pytest.approx(-5.0702, abs=1e-3)
    # the published number used ASE's older Hartree constant: 1e-5 relative slack covers it
    assert r.energy_eV == pytest.approx(WATER_PUBLISHED_EV, abs=1e-3)
    np.testing.assert_allclose(r.forces, WATER_PUBLISHED_FORCES, atol=1e-4)
    assert r.formation_energy_eV == pytest.approx(r.energy_eV - gfn2.atomic_energies_eV[[3, 0, 0]].sum())


def test_gfn2_forces_are_minus_the_energy_gradient(gfn2):
    pos, types = METHANE
    r = gfn2.evaluate(pos, types)
    h = 2e-3
    for atom, axis in ((4, 0), (0, 2)):
        plus, minus = pos.copy(), pos.copy()
        plus[atom, axis] += h
        minus[atom, axis] -= h
        fd = -(gfn2.evaluate(plus, types).energy_eV - gfn2.evaluate(minus, types).energy_eV) / (2 * h)
        assert abs(r.forces[atom, axis]) > 0.05          # a displaced H: a real force to compare
        assert r.forces[atom, axis] == pytest.approx(fd, abs=2e-4)     # agrees to ~1e-5 eV/Å


def test_atomic_reference_energies(gfn2):
    refs = gfn2.atomic_energies_eV                       # eV, per type H C N O F
    assert refs.shape == (5,) and np.all(refs < 0)
    assert np.all(np.diff(refs) < 0)                     # heavier atom, more negative
    assert refs[0] / HARTREE_EV == pytest.approx(-0.3935, abs=1e-3)
    e_h, _ = tblite_by_hand(np.zeros((1, 3)), [7], uhf=3)
    assert refs[2] == pytest.approx(e_h * HARTREE_EV, abs=1e-8)


def test_bad_molecules_get_a_reason_without_a_call_and_quickly(gfn2):
    rng = np.random.default_rng(0)
    box = (rng.uniform(0, 1, (20, 3)), rng.integers(0, 5, 20))     # 20 atoms in a 1 Å box
    nan = (np.full((4, 3), np.nan), np.array([1, 0, 0, 0]))
    inf = (np.array([[0, 0, 0], [np.inf, 0, 0]]), np.array([0, 0]))
    unknown = (np.eye(3) * 1.5, np.array([1, 0, 7]))
    misshapen = (np.eye(3)[:2], np.array([1, 0, 0]))
    t0 = time.perf_counter()
    results = gfn2.evaluate_many([box, nan, inf, unknown, misshapen, WATER])
    assert time.perf_counter() - t0 < 2.0
    assert [r.reason for r in results] == ["overlap", "nan_coordinates", "nan_coordinates", "invalid_atom_type",
                                           "invalid_atom_type", "ok"]
    s = RewardSettings(force_clip=10.0, energy_clip=8.0, invalid_penalty_scale=0.5)
    for r in results[:-1]:
        assert not r.ok and math.isnan(r.energy_eV) and r.forces is None and r.seconds == 0.0
        out = molecule_rewards(r, PART, s)
        assert (out["force_reward"], out["energy_reward"]) == (-10.5, -8.5)
        assert out["force_gated"] and out["energy_gated"] and out["reason"] == r.reason


def test_scf_failure_and_a_computed_random_box():
    with ForceField("gfn2", max_iter=1) as ff:
        assert ff.evaluate(*WATER).reason == "scf_failed"
    with ForceField("gfn2", min_distance=0.0) as ff:     # let the garbage through: still an answer
        rng = np.random.default_rng(1)
        t0 = time.perf_counter()
        r = ff.evaluate(rng.uniform(0, 1, (20, 3)), rng.integers(0, 5, 20))
        assert time.perf_counter() - t0 < ff.timeout_s
        assert r.reason in ("ok", "scf_failed", "nonfinite_output")
        if r.ok:
            assert r.energy_eV / r.n_atoms > 0            # far above any real molecule


def test_timeout_kills_and_restarts_the_child():
    rng = np.random.default_rng(1)
    slow = (rng.uniform(0, 1.2, (20, 3)), rng.integers(0, 5, 20))     # tens of ms of SCF
    with ForceField("gfn2", timeout_s=1e-4, min_distance=0.0) as ff:
        first = ff.pid
        results = ff.evaluate_many([slow, slow, slow])
        assert [r.reason for r in results] == ["timeout"] * 3
        assert ff.restarts == 3 and ff.pid != first
        ff.timeout_s = 10.0
        r = ff.evaluate(*WATER)
        assert r.ok and r.energy_eV == pytest.approx(WATER_PUBLISHED_EV, abs=1e-3)


def test_a_hung_child_is_killed_after_timeout_s():
    with ForceField("gfn2", timeout_s=1.0) as ff:
        hung = ff.pid
        os.kill(hung, signal.SIGSTOP)                     # as if stuck inside a C call
        t0 = time.perf_counter()
        results = ff.evaluate_many([METHANE, WATER])
        assert 0.9 < time.perf_counter() - t0 < 5.0
        assert [r.reason for r in results] == ["timeout", "ok"] and ff.restarts == 1
        with pytest.raises(ProcessLookupError):           # killed and reaped
            os.kill(hung, 0)
        os.kill(ff.pid, signal.SIGKILL)                   # a child that died while idle ...
        time.sleep(0.2)
        assert ff.evaluate(*WATER).ok and ff.restarts == 2   # ... is replaced on the next submit


def test_mmff_backend_on_qm9_molecules():
    from rdkit.Chem import rdForceFieldHelpers

    from flowrl_ray.envs.molecules.chemistry import rdkit_molecule
    mols = qm9_head(30)
    with ForceField("mmff") as ff:
        assert np.all(ff.atomic_energies_eV == 0)
        results = ff.evaluate_many(mols)
        ok = [(m, r) for m, r in zip(mols, results) if r.ok]
        assert len(ok) >= 25
        (pos, types), r = ok[-1]
        mol = rdkit_molecule(pos, types)
        field = rdForceFieldHelpers.MMFFGetMoleculeForceField(mol, rdForceFieldHelpers.MMFFGetMoleculeProperties(mol))
        assert r.energy_eV == pytest.approx(field.CalcEnergy() * KCAL_MOL_EV, rel=1e-9)
        assert r.formation_energy_eV == r.energy_eV       # no atomic references for MMFF
        np.testing.assert_allclose(r.forces, -np.reshape(field.CalcGrad(), (-1, 3)) * KCAL_MOL_EV, atol=1e-9)
        assert KCAL_MOL_EV == pytest.approx(0.0433641, rel=1e-6)
        # a methyl radical: fine for the overlap check, no closed-shell bond orders for RDKit
        r = ff.evaluate(np.array([[0, 0, 0], [1.09, 0, 0], [-0.5, 0.94, 0], [-0.5, -0.94, 0]]),
                        np.array([1, 0, 0, 0]))
        assert r.reason == "bond_perception_failed"


def test_scorer_on_good_and_bad_molecules():
    good = qm9_head(6)
    rng = np.random.default_rng(2)
    box = (rng.uniform(0, 1, (20, 3)), rng.integers(0, 5, 20))
    nan = (np.full((3, 3), np.nan), np.array([3, 0, 0]))
    unknown = (WATER[0], np.array([3, 0, 9]))
    mols = good + [box, nan, unknown]
    k, steps = len(mols), 3
    shaping = [[(p + rng.normal(0, 0.05 * j, p.shape), t) for j in range(steps)] for p, t in mols]
    settings = RewardSettings(energy_only_if_stable=True, energy_clip=10.0, force_clip=10.0)
    scorer = env_family("molecules").make_scorer(env_cfg(energy_only_if_stable=True), seed=0, worker_id=3)
    assert isinstance(scorer, MoleculeScorer) and scorer.settings == settings
    try:
        batch = scorer.score({"ids": np.arange(10, 10 + k), "positions": [p for p, _ in mols],
                              "atom_types": [t for _, t in mols], "shaping": shaping})
        plain = scorer.score({"ids": np.arange(2), "positions": [p for p, _ in good[:2]],
                              "atom_types": [t for _, t in good[:2]]})
    finally:
        scorer.close()
        scorer.close()                                   # idempotent
    d = batch.data
    keys = {"ids", "force_reward", "energy_reward", "reward", "energy_eV", "formation_energy_per_atom_eV", "rms_force",
            "stable", "stable_atom_fraction", "valid", "smiles", "reason", "ff_seconds", "shaping_energy_reward",
            "stability_reward", "force_gated", "energy_gated", "under_bonded", "over_bonded", "overlap",
            "shaping_force_reward"}
    shaped = {"shaping_energy_reward", "shaping_force_reward"}
    assert set(d) == keys and set(plain.data) == keys - shaped
    assert all(v.shape == (k,) for name, v in d.items() if name not in shaped)
    assert d["shaping_force_reward"].shape == (k, steps)
    np.testing.assert_allclose(d["shaping_force_reward"][:6, 0], d["force_reward"][:6], atol=1e-5)
    assert d["shaping_energy_reward"].shape == (k, steps) and d["shaping_energy_reward"].dtype == np.float32
    np.testing.assert_array_equal(d["ids"], np.arange(10, 10 + k))
    assert list(d["reason"][-3:]) == ["overlap", "nan_coordinates", "invalid_atom_type"]
    assert batch.meta.extra["reasons"] == {"ok": 6, "overlap": 1, "nan_coordinates": 1, "invalid_atom_type": 1}
    assert batch.meta.env_steps == k and batch.meta.worker_id == 3
    assert batch.meta.episode_lengths == [len(t) for _, t in mols]
    assert batch.meta.extra["successes"] == [True] * 6 + [False] * 3
    assert np.all(d["stable"][:6] == 1) and np.all(d["valid"][:6] == 1) and np.all(d["valid"][6:] == 0)
    assert all(isinstance(sm, str) and sm for sm in d["smiles"][:6]) and list(d["smiles"][6:]) == ["", "", ""]
    assert d["smiles"][0] == "C" and d["smiles"][2] == "O"                       # methane, ammonia, water
    assert np.all(np.isfinite(d["energy_eV"][:6])) and np.all(np.isnan(d["energy_eV"][6:]))
    assert np.all(np.isnan(d["rms_force"][6:])) and np.all(d["rms_force"][:6] > 0)
    assert np.all((d["force_reward"][:6] < 0) & (d["force_reward"][:6] > -10))
    np.testing.assert_allclose(d["energy_reward"][:6], -d["formation_energy_per_atom_eV"][:6], rtol=1e-6)
    assert np.all(d["force_reward"][6:] == -12) and np.all(d["energy_reward"][6:] == -12)   # clip + penalty 2
    assert np.all(d["force_gated"][6:] == 1) and np.all(d["energy_gated"][:6] == 0)
    # QM9's own molecules: every atom stable, stability reward 1 - (tiny soft missing valence)
    assert np.all(d["under_bonded"][:6] == 0) and np.all(d["over_bonded"][:6] == 0)
    assert np.all((d["stability_reward"][:6] > 0.9) & (d["stability_reward"][:6] <= 1.0))
    assert list(d["overlap"]) == [0] * 6 + [1, 0, 0] and d["stability_reward"][6] < 0.5
    assert np.all(d["ff_seconds"][:6] > 0) and np.all(d["ff_seconds"][6:] == 0)
    assert np.all(d["stable_atom_fraction"][:6] == 1)
    # shaping step 0 is the final molecule itself (zero noise): the same energy reward
    np.testing.assert_allclose(d["shaping_energy_reward"][:6, 0], d["energy_reward"][:6], atol=1e-5)
    assert np.all(d["shaping_energy_reward"][6:] == 0)      # invalid final molecules: traces zeroed
    assert sum(batch.meta.extra["shaping_reasons"].values()) == k * steps
    assert batch.meta.episode_returns == pytest.approx(d["reward"].tolist())


def test_shaping_potentials_are_gated_by_the_final_molecule():
    """Elign gates a potential trace by the final molecule's flag: an intermediate prediction that
    is unstable on its own keeps its physics when the final molecule is stable."""
    stretched = (WATER[0] * 1.6, WATER[1])                     # O-H far beyond a bond: unstable
    scorer = MoleculeScorer(RewardSettings(energy_only_if_stable=True))
    try:
        b = scorer.score({"ids": np.arange(1), "positions": [WATER[0]], "atom_types": [WATER[1]],
                          "shaping": [[WATER, stretched]]})
        alone = scorer.score({"ids": np.arange(1), "positions": [stretched[0]], "atom_types": [stretched[1]]})
    finally:
        scorer.close()
    assert b["stable"][0] == 1 and alone["stable"][0] == 0 and alone["energy_gated"][0] == 1   # floored alone
    assert b["shaping_energy_reward"][0, 1] != -12 and b.meta.extra["shaping_reasons"] == {"ok": 2}
    assert b["shaping_energy_reward"][0, 1] != alone["energy_reward"][0]
    # an RDKit-invalid final molecule (penalty on): its trace is zeroed, its own reward the penalty
    scorer = MoleculeScorer(RewardSettings(invalid_penalty_scale=2.0))
    try:
        inv = scorer.score({"ids": np.arange(1), "positions": [stretched[0]], "atom_types": [stretched[1]],
                            "shaping": [[WATER, stretched]]})
    finally:
        scorer.close()
    assert inv["valid"][0] == 0 and inv["energy_reward"][0] == -12 and inv["force_reward"][0] == -12
    assert np.all(inv["shaping_energy_reward"] == 0) and np.all(inv["shaping_force_reward"] == 0)


def test_scorer_rejects_mismatched_samples():
    scorer = MoleculeScorer(RewardSettings())
    try:
        with pytest.raises(ValueError, match="differ in length"):
            scorer.score({"ids": np.arange(2), "positions": [WATER[0]], "atom_types": [WATER[1]]})
        with pytest.raises(ValueError, match="'shaping'"):
            scorer.score({"ids": np.arange(2), "positions": [WATER[0]] * 2, "atom_types": [WATER[1]] * 2,
                          "shaping": [[WATER], [WATER, WATER]]})
        one = scorer.score({"ids": np.arange(1), "positions": [WATER[0]], "atom_types": [WATER[1]]})
        assert one["reason"][0] == "ok" and one["smiles"][0] == "O"
    finally:
        scorer.close()
    assert set(ffmod.FAILURES) < set(REASONS)
