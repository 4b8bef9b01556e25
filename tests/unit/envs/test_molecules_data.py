"""QM9 parsing and splits and the chemistry checks on hand-made input: bond orders, EDM stability,
the coordinate and CSV parsers, the cache location, the split sizes. The checks on the real QM9
(parsed once per module, a few seconds): tests/integration/test_molecules_data.py.
"""

from __future__ import annotations

import csv
import importlib.util
import sys

import numpy as np
import pytest

pytest.importorskip("rdkit")
pytest.importorskip("pandas")

from flowrl_ray.envs.molecules import chemistry as chem  # noqa: E402
from flowrl_ray.envs.molecules import qm9  # noqa: E402

H, C, N, O, F = range(5)

# --------------------------------------------------------------------------- bond orders

@pytest.mark.parametrize("a,b,d,order", [
    ("C", "C", 1.54, 1), ("C", "C", 1.34, 2), ("C", "C", 1.20, 3), ("C", "H", 1.09, 1),
    ("H", "C", 1.09, 1), ("C", "O", 1.20, 2), ("C", "N", 1.16, 3), ("O", "H", 0.96, 1),
    ("H", "H", 0.74, 1), ("C", "F", 1.35, 1), ("N", "O", 1.00, 2),   # N-O has no triple
    ("O", "F", 1.00, 1),                                           # O-F has no double
    ("C", "C", 3.00, 0), ("C", "H", 1.50, 0),
    ("C", "C", 1.64, 0), ("C", "C", 1.6399, 1),                    # 154 + 10 pm, strict
])
def test_bond_order_on_hand_distances(a, b, d, order):
    assert chem.bond_order(a, b, d) == order


def test_bond_order_is_symmetric():
    for a in chem.ATOM_TYPES:
        for b in chem.ATOM_TYPES:
            for d in (0.9, 1.1, 1.25, 1.4, 1.6):
                assert chem.bond_order(a, b, d) == chem.bond_order(b, a, d)


def test_stability_on_hand_molecules():
    h2 = np.array([[0, 0, 0], [0, 0, 0.74]])
    assert chem.check_stability(h2, np.array([H, H])) == (True, 2, 2)
    far = np.array([[0, 0, 0], [0, 0, 5.0]])
    assert chem.check_stability(far, np.array([H, H])) == (False, 0, 2)


@pytest.mark.parametrize("pos,types", [
    (np.array([[0, 0, 0], [0, 0, np.nan]]), np.array([H, H])),
    (np.array([[0, 0, 0], [0, 0, np.inf]]), np.array([H, H])),
    (np.array([[0, 0, 0], [0, 0, 0.74]]), np.array([H, 7])),         # type out of range
    (np.array([[0, 0, 0], [0, 0, 0.74]]), np.array([H, -1])),
    (np.array([[0, 0, 0]]), np.array([H, H])),                       # shape mismatch
    (np.zeros((2, 2)), np.array([H, H])),
])
def test_stability_of_bad_input_is_false_not_an_error(pos, types):
    assert chem.check_stability(pos, types) == (False, 0, len(types))
    assert chem.rdkit_molecule(pos, types) is None
    assert chem.canonical_smiles(pos, types) is None


# --------------------------------------------------------------------------- QM9 parsing

def test_parse_xyz_on_a_hand_string():
    out = qm9.parse_xyz("[[1.0,2.0,3.0],[-4.5,5e-1,0]]")
    np.testing.assert_array_equal(out, [[1.0, 2.0, 3.0], [-4.5, 0.5, 0.0]])
    assert qm9.parse_xyz("[]").shape == (0, 3)
    with pytest.raises(ValueError):
        qm9.parse_xyz("[[1.0,2.0]]")


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_NONNUMERIC)
        w.writerow(["XYZ_file", "Index", "SMILES", "N_atoms", "Elements", "XYZ_Ang", "HOMO_au"])
        for r in rows:
            w.writerow(["x.xyz", *r, -0.3])


def test_parse_hand_written_csv(tmp_path):
    _write_csv(tmp_path / "a.csv", [
        (7, "[HH]", 2, "['H','H']", "[[0.0,0.0,1.0],[0.0,0.0,1.74]]"),
        (9, "O", 3, "['O','H','H']", "[[0.0,0.0,0.0],[0.0,0.75,0.6],[0.0,-0.75,0.6]]")])
    _write_csv(tmp_path / "b.csv", [(12, "FC", 5, "['F','C','H','H','H']",
                                     "[[0,0,1.35],[0,0,0],[1,0,-0.3],[-0.5,0.86,-0.3],"
                                     "[-0.5,-0.86,-0.3]]")])
    d = qm9.parse_qm9_csvs([tmp_path / "a.csv", tmp_path / "b.csv"], verbose=False)
    assert len(d) == 3
    np.testing.assert_array_equal(d.index, [7, 9, 12])
    np.testing.assert_array_equal(d.n_atoms, [2, 3, 5])
    assert list(d.smiles) == ["[HH]", "O", "FC"]
    assert d.positions.shape == (3, 29, 3) and d.atom_types.shape == (3, 29)
    np.testing.assert_allclose(d.positions[0, :2], [[0, 0, -0.37], [0, 0, 0.37]], atol=1e-6)
    np.testing.assert_allclose(d.positions[1, :3, 2], [-0.4, 0.2, 0.2], atol=1e-6)
    assert np.all(d.positions[0, 2:] == 0) and np.all(d.atom_types[0, 2:] == -1)
    np.testing.assert_array_equal(d.atom_types[2, :5], [F, C, H, H, H])
    pos, types = d.molecule(1)
    assert pos.shape == (3, 3) and list(types) == [O, H, H]
    sub = d.subset([2, 0])
    np.testing.assert_array_equal(sub.index, [12, 7])


@pytest.mark.parametrize("row", [
    (1, "C", 5, "['C','H','H','H']", "[[0,0,0],[1,0,0],[0,1,0],[0,0,1]]"),    # N_atoms wrong
    (1, "CCl", 2, "['C','Cl']", "[[0,0,0],[1.8,0,0]]"),                       # not H/C/N/O/F
    (1, "C", 1, "['C']", "[[0,0]]"),                                          # 2 coordinates
])
def test_parse_rejects_inconsistent_rows(tmp_path, row):
    _write_csv(tmp_path / "bad.csv", [row])
    with pytest.raises(ValueError):
        qm9.parse_qm9_csvs([tmp_path / "bad.csv"], verbose=False)


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWRL_RAY_CACHE", str(tmp_path))
    assert qm9.default_cache_dir() == tmp_path
    monkeypatch.delenv("FLOWRL_RAY_CACHE")
    assert qm9.default_cache_dir().parts[-2:] == (".cache", "flowrl_ray")


def test_missing_qm9pack_names_the_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install qm9pack"):
        qm9.qm9_csv_dir()
    assert "qm9pack" not in sys.modules          # located without executing the package


# --------------------------------------------------------------------------- splits, histogram

@pytest.mark.parametrize("m", [130_831, 1000, 100, 7, 1])
def test_splits_are_disjoint_covering_and_seeded(m):
    s = qm9.qm9_splits(m, seed=0)
    joined = np.concatenate([s["train"], s["valid"], s["test"]])
    np.testing.assert_array_equal(np.sort(joined), np.arange(m))
    assert len(s["test"]) == int(0.1 * m)
    again = qm9.qm9_splits(m, seed=0)
    assert all(np.array_equal(s[k], again[k]) for k in s)
    if m >= 100:
        other = qm9.qm9_splits(m, seed=1)
        assert not np.array_equal(s["train"], other["train"])


def test_split_sizes_follow_edm():
    s = qm9.qm9_splits(130_831)
    # EDM: 100k train, int(0.1 * 130,831) test, the rest valid
    assert (len(s["train"]), len(s["valid"]), len(s["test"])) == (100_000, 17_748, 13_083)
    s = qm9.qm9_splits(1000)
    assert (len(s["train"]), len(s["test"])) == (round(1000 * 100_000 / 130_831), 100)


# --------------------------------------------------------------------------- the pack (no qm9pack)

def _hand_data(sizes=(5, 3, 29, 1), seed=0) -> qm9.QM9Data:
    rng = np.random.default_rng(seed)
    n = np.array(sizes)
    flat = rng.uniform(-9.0, 9.0, size=(n.sum(), 3))
    positions, types = qm9._pad(flat, rng.integers(0, 5, size=n.sum()).astype(np.int8), n)
    return qm9.QM9Data(positions=positions, atom_types=types, n_atoms=n.astype(np.int16),
                       smiles=np.array(["C", "O", "CCO", "F"]), index=np.array([1, 4, 9, 16], np.int32))


def test_a_pack_round_trips_a_split_to_the_rounding_of_its_mA_integers(tmp_path):
    data = _hand_data()
    info = qm9.save_pack(data, tmp_path / "p.npz", "train")
    assert (info["molecules"], info["atoms"]) == (4, 38)
    assert 0 < info["max_rounding_A"] <= 0.0005 + 1e-6        # int16 mÅ: half a milli-ångström at most
    back = qm9.load_pack(tmp_path / "p.npz", split="train")
    np.testing.assert_array_equal(back.atom_types, data.atom_types)      # -1 padding included
    np.testing.assert_array_equal(back.n_atoms, data.n_atoms)
    np.testing.assert_array_equal(back.smiles, data.smiles)
    np.testing.assert_array_equal(back.index, data.index)
    assert back.positions.shape == data.positions.shape == (4, 29, 3)
    assert np.abs(back.positions - data.positions).max() <= 0.001       # rounding, then centred again
    real = data.atom_types >= 0
    assert np.abs(back.positions[~real]).max() == 0                     # padding stays 0
    np.testing.assert_allclose(back.positions[2].mean(0), 0, atol=1e-5)  # each molecule centred


def test_a_pack_of_another_split_or_another_file_is_refused_by_name(tmp_path):
    qm9.save_pack(_hand_data(), tmp_path / "p.npz", "valid")
    with pytest.raises(ValueError, match="holds QM9's 'valid' split, not 'train'"):
        qm9.load_pack(tmp_path / "p.npz", split="train")
    np.savez(tmp_path / "other.npz", positions=np.zeros(3))
    with pytest.raises(ValueError, match="is not a QM9 pack.*flowrl-ray qm9-pack"):
        qm9.load_pack(tmp_path / "other.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable QM9 pack"):
        qm9.load_pack(tmp_path / "junk.npz")
    far = _hand_data()
    far.positions[0, 0, 0] = 40.0                                          # beyond int16 mÅ
    with pytest.raises(ValueError, match="40.0 Å does not fit"):
        qm9.save_pack(far, tmp_path / "far.npz", "train")
    assert not (tmp_path / "far.npz").exists()
