"""QM9 parsing/caching/splits and the chemistry checks (EDM stability, RDKit validity).

QM9 is parsed once per module (a few seconds) into a temporary cache; expected values are either
physical facts (bond lengths, valences, QM9's published size) or computed independently here
(RDKit canonicalisation of the CSV's SMILES, the single-string coordinate parser).
"""

from __future__ import annotations

import csv
import importlib.util

import numpy as np
import pytest

pytest.importorskip("rdkit")
pytest.importorskip("pandas")

from flowrl_ray.envs.molecules import chemistry as chem  # noqa: E402
from flowrl_ray.envs.molecules import qm9  # noqa: E402
from unit.envs.test_molecules_data import C, F, H, O  # noqa: E402


@pytest.fixture(scope="module")
def qm9_cache(tmp_path_factory):
    if importlib.util.find_spec("qm9pack") is None:
        pytest.skip("qm9pack is not installed (pip install -e '.[mol]')")
    cache = tmp_path_factory.mktemp("qm9_cache")
    return cache, qm9.load_qm9(cache)           # parses (the only full parse of the module)


@pytest.fixture(scope="module")
def data(qm9_cache):
    return qm9_cache[1]


def _canonical(smiles: str) -> str:
    from rdkit import Chem
    return Chem.MolToSmiles(Chem.MolFromSmiles(smiles), isomericSmiles=False)


def _rotation(seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    return q


# --------------------------------------------------------------------------- stability

def test_stability_of_real_qm9_geometries(data):
    for i, smiles, n in ((0, "C", 5), (2, "O", 3), (13, "CCO", 9)):     # methane, water, ethanol
        assert data.smiles[i] == smiles
        assert chem.check_stability(*data.molecule(i)) == (True, n, n)


def test_removing_a_hydrogen_leaves_carbon_unstable(data):
    pos, types = data.molecule(0)                        # methane: C then 4 H
    assert list(types) == [C, H, H, H, H]
    # C keeps 3 bonds (needs 4); each remaining H still has its single bond to C
    assert chem.check_stability(pos[:4], types[:4]) == (False, 3, 4)


def test_stability_is_rigid_motion_invariant(data):
    pos, types = data.molecule(13)
    moved = pos @ _rotation(0).T + np.array([5.0, -3.0, 2.0])
    assert chem.check_stability(moved, types) == chem.check_stability(pos, types)


def test_qm9_itself_is_mostly_stable(data):
    # EDM reports 99.0 % atom / 95.2 % molecule stability for QM9's own geometries; a wrong
    # table or margin falls far below these bounds
    rng = np.random.default_rng(0)
    mols = [data.molecule(i) for i in rng.choice(len(data), 1500, replace=False)]
    results = [chem.check_stability(p, t) for p, t in mols]
    atoms = sum(r[1] for r in results) / sum(r[2] for r in results)
    molecules = np.mean([r[0] for r in results])
    assert atoms > 0.98 and molecules > 0.9


# --------------------------------------------------------------------------- RDKit

def test_rdkit_molecule_of_methane(data):
    mol = chem.rdkit_molecule(*data.molecule(0))
    assert mol is not None
    assert mol.GetNumAtoms() == 5 and mol.GetNumBonds() == 4
    assert mol.GetNumConformers() == 1
    assert sorted(a.GetSymbol() for a in mol.GetAtoms()) == ["C", "H", "H", "H", "H"]


def test_rdkit_molecule_rejects_overlapping_atoms(data):
    pos, types = data.molecule(0)
    pos = pos.copy()
    pos[2] = pos[1] + np.array([0.2, 0.0, 0.0])          # two H 0.2 Å apart: below the guard
    assert chem.rdkit_molecule(pos, types) is None


@pytest.mark.parametrize("i", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 53, 387, 55967,
                               100000, 120000, 129000, 129001, 129002, 129003, 129004])
def test_canonical_smiles_matches_the_csv(data, i):
    assert chem.canonical_smiles(*data.molecule(i)) == _canonical(str(data.smiles[i]))


def test_canonical_smiles_is_rigid_motion_invariant(data):
    pos, types = data.molecule(129001)
    moved = pos @ _rotation(1).T - 7.0
    assert chem.canonical_smiles(moved, types) == chem.canonical_smiles(pos, types)


def test_canonical_smiles_keeps_the_largest_fragment(data):
    ethanol, methane = data.molecule(13), data.molecule(0)
    pos = np.concatenate([ethanol[0], methane[0] + 10.0])
    types = np.concatenate([ethanol[1], methane[1]])
    assert chem.canonical_smiles(pos, types) == "CCO"


def test_molecule_metrics_on_a_hand_list(data):
    methane = data.molecule(0)
    moved = (methane[0] @ _rotation(2).T + 3.0, methane[1])
    garbage = (np.full((3, 3), np.nan), np.array([C, O, H]))
    m = chem.molecule_metrics([methane, moved, garbage])
    assert m["num_molecules"] == 3
    assert m["atom_stability"] == pytest.approx(10 / 13)
    assert m["molecule_stability"] == pytest.approx(2 / 3)
    assert m["validity"] == pytest.approx(2 / 3)
    assert m["uniqueness"] == pytest.approx(1 / 2)
    assert m["valid_and_unique"] == pytest.approx(1 / 3)
    m = chem.molecule_metrics([methane, data.molecule(2), moved])
    assert m["validity"] == 1.0 and m["uniqueness"] == pytest.approx(2 / 3)
    m = chem.molecule_metrics([garbage])
    assert m["validity"] == 0.0 and m["uniqueness"] == 0.0 and m["valid_and_unique"] == 0.0
    assert chem.molecule_metrics([])["num_molecules"] == 0


def test_edm_table_validity_passes_radicals_and_refuses_over_bonded_atoms(data):
    pos, types = data.molecule(0)                                   # methane: C and 4 H
    assert chem.edm_table_smiles(pos, types) == "C" == chem.canonical_smiles(pos, types)
    h = np.flatnonzero(types == H)[-1]
    keep = np.arange(len(types)) != h                                # CH3: the carbon under-bonded
    assert chem.edm_table_smiles(pos[keep], types[keep]) == "C"      # EDM: an implicit H, valid
    assert chem.canonical_smiles(pos[keep], types[keep]) is None     # perceived bonds: a radical, invalid
    extra = pos[types == C][0] + np.array([0.0, 0.0, 1.05])          # a fifth H bonded to the carbon
    assert chem.edm_table_smiles(np.vstack([pos, extra]), np.r_[types, H]) is None
    assert chem.edm_table_smiles(np.full((3, 3), np.nan), np.array([C, O, H])) is None
    m = chem.molecule_metrics([(pos, types), (pos[keep], types[keep])])
    assert m["edm_validity"] == 1.0 and m["validity"] == 0.5
    rng = np.random.default_rng(1)                                   # EDM reports 97.7 % on QM9 itself
    idx = rng.choice(len(data), 300, replace=False)
    assert np.mean([chem.edm_table_smiles(*data.molecule(int(i))) is not None for i in idx]) > 0.95


def test_rdkit_validity_of_qm9_geometries(data):
    rng = np.random.default_rng(1)
    idx = rng.choice(len(data), 300, replace=False)
    valid = [chem.canonical_smiles(*data.molecule(i)) is not None for i in idx]
    assert np.mean(valid) > 0.9                     # measured ~0.95 on 5,000 random molecules


def test_full_qm9(data):
    assert len(data) == qm9.NUM_MOLECULES == 130_831
    assert data.positions.shape == (130_831, 29, 3) and data.positions.dtype == np.float32
    assert data.atom_types.dtype == np.int8 and data.n_atoms.dtype == np.int16
    assert data.index.dtype == np.int32 and np.all(np.diff(data.index) > 0)
    assert data.n_atoms.max() == 29 and data.n_atoms.min() >= 1
    real = np.arange(29)[None, :] < data.n_atoms[:, None]
    assert np.all((data.atom_types >= 0) == real) and data.atom_types.max() == F
    assert np.all(data.positions[~real] == 0)
    # centred at the plain mean of each molecule's atoms
    means = data.positions.sum(axis=1) / data.n_atoms[:, None]
    assert np.abs(means).max() < 1e-4
    # the first molecule is methane with C-H bonds of about 1.09 Å
    assert data.index[0] == 1 and data.smiles[0] == "C" and data.n_atoms[0] == 5
    pos, types = data.molecule(0)
    assert list(types) == [C, H, H, H, H]
    np.testing.assert_allclose(np.linalg.norm(pos[1:] - pos[0], axis=1), 1.09, atol=0.01)


def test_bulk_parser_agrees_with_the_single_string_parser(data):
    path = qm9.qm9_csv_dir() / qm9.CSV_NAMES[0]
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = [next(reader) for _ in range(25)]
    for i, row in enumerate(rows):
        xyz = qm9.parse_xyz(row["XYZ_Ang"])
        assert int(row["Index"]) == data.index[i] and len(xyz) == data.n_atoms[i]
        np.testing.assert_allclose(data.molecule(i)[0], xyz - xyz.mean(axis=0), atol=1e-5)


def test_cache_round_trip(qm9_cache, capsys):
    cache, first = qm9_cache
    assert (cache / qm9.CACHE_NAME).is_file()
    again = qm9.load_qm9(cache)
    assert "parsing" not in capsys.readouterr().out           # came from the cache
    for field in ("positions", "atom_types", "n_atoms", "smiles", "index"):
        a, b = getattr(first, field), getattr(again, field)
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_stale_or_broken_cache_is_ignored(tmp_path, data):
    small = data.subset(np.arange(10))
    path = tmp_path / "c.npz"
    qm9._save_atomic(small, path, np.array([1, 2, 3]))
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]   # no temporary left behind
    assert np.array_equal(qm9._load_cache(path, np.array([1, 2, 3])).positions, small.positions)
    assert qm9._load_cache(path, np.array([1, 2, 4])) is None     # CSVs changed
    path.write_bytes(b"not an npz")
    assert qm9._load_cache(path, np.array([1, 2, 3])) is None


def test_atom_count_histogram(data):
    hist = qm9.atom_count_histogram(np.array([1, 1, 2, 3]), max_atoms=5)
    np.testing.assert_allclose(hist, [0, 0.5, 0.25, 0.25, 0, 0])
    hist = qm9.atom_count_histogram(data.n_atoms)
    assert hist.shape == (30,) and hist.dtype == np.float64
    assert hist.sum() == pytest.approx(1.0) and hist[0] == 0 and hist[29] > 0
    assert hist[5] == pytest.approx(np.mean(data.n_atoms == 5))
    with pytest.raises(ValueError):
        qm9.atom_count_histogram(np.array([30]))
