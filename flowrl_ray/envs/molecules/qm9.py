"""QM9 (130,831 small organic molecules, DFT geometries) as padded numpy arrays, with EDM's splits.

The data come from the registry package ``qm9pack``, which ships QM9 as three CSVs. ``import
qm9pack`` itself fails on current setuptools (it imports pkg_resources), so the package is
located with ``importlib.util.find_spec`` (which does not execute it) and its CSVs are read
directly. Of their columns we keep ``Index`` (QM9's molecule number), ``SMILES``, ``N_atoms``,
``Elements`` (e.g. ``['C','H','H','H','H']``) and ``XYZ_Ang`` (e.g. ``[[x,y,z],[x,y,z],...]``
in Å). The coordinate strings are parsed by stripping brackets and splitting on commas (all of
a file's molecules at once), which is much faster than json/ast per row.

Parsing takes seconds (about 6 s on 2 shared cores); :func:`load_qm9` therefore caches the
arrays as one plain ``.npz`` (default ``~/.cache/flowrl_ray``, or ``$FLOWRL_RAY_CACHE``; 65 MB,
loads in about 0.05 s, where a compressed one is 28 MB but takes 0.3 s) and loads that afterwards.

Layout (M molecules, padded to MAX_ATOMS = 29 atoms as in EDM):
    positions  [M, 29, 3] float32  Å, each molecule centred at the plain mean of its atoms
                                   (EDM's zero centre of mass, not mass-weighted); 0 padding
    atom_types [M, 29]    int8     index into chemistry.ATOM_TYPES (H C N O F); -1 padding
    n_atoms    [M]        int16
    smiles     [M]        str      the CSV's SMILES
    index      [M]        int32    QM9's molecule number (1-based, gaps where QM9 excluded some)

A machine without qm9pack (a bare GPU machine) trains from a **pack** of one split instead
(:func:`save_pack`, ``flowrl-ray qm9-pack``; ``flowrl-ray pretrain --qm9 FILE``): only the real
atoms, positions as int16 in mÅ (rounding moves an atom by at most 0.0005 Å), types as uint8,
compressed: EDM's train split is about 11 MB.
"""

from __future__ import annotations

import importlib.util
import io
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from flowrl_ray.envs.molecules.chemistry import ATOM_TYPES
from flowrl_ray.utils import atomic_write_bytes

MAX_ATOMS = 29
CSV_NAMES = ("qm9_part1.csv", "qm9_part2.csv", "qm9_part3.csv")
NUM_MOLECULES = 130_831          # QM9 without the 3,054 "uncharacterized" molecules
# EDM's split (qm9/data/prepare/qm9.py): 100k train, int(10 %) test, the rest valid
EDM_TRAIN = 100_000
CACHE_NAME = "qm9_v1.npz"        # bump the version when the layout changes
_COLUMNS = ["Index", "SMILES", "N_atoms", "Elements", "XYZ_Ang"]
_FIELDS = ("positions", "atom_types", "n_atoms", "smiles", "index")


def qm9_csv_dir() -> Path:
    """The directory holding qm9pack's CSVs (found without importing the package)."""
    spec = importlib.util.find_spec("qm9pack")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        data = Path(loc) / "data"
        if all((data / name).is_file() for name in CSV_NAMES):
            return data
    raise FileNotFoundError("QM9 CSVs not found: the qm9pack package is missing or incomplete "
                            "(pip install qm9pack==1.0.3, or pip install -e '.[mol]')")


@dataclass
class QM9Data:
    """Padded QM9 arrays (see the module docstring for shapes and padding)."""

    positions: np.ndarray
    atom_types: np.ndarray
    n_atoms: np.ndarray
    smiles: np.ndarray
    index: np.ndarray

    def __len__(self) -> int:
        return int(self.n_atoms.shape[0])

    def subset(self, indices) -> "QM9Data":
        """The molecules at these positions (e.g. a split from :func:`qm9_splits`)."""
        idx = np.asarray(indices)
        return QM9Data(**{f: getattr(self, f)[idx] for f in _FIELDS})

    def molecule(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Molecule i without padding: (positions [n, 3] float32, atom_types [n] int64)."""
        n = int(self.n_atoms[i])
        return self.positions[i, :n].copy(), self.atom_types[i, :n].astype(np.int64)


def parse_xyz(text: str) -> np.ndarray:
    """One ``XYZ_Ang`` cell, ``"[[x,y,z],[x,y,z]]"``, as [n, 3] float64."""
    body = text.replace("[", "").replace("]", "").strip()
    if not body:
        return np.zeros((0, 3))
    values = np.array(body.split(","), dtype=np.float64)
    if values.size % 3:
        raise ValueError(f"coordinate count {values.size} is not a multiple of 3: {text[:80]!r}")
    return values.reshape(-1, 3)


def _strip_join(cells: Sequence[str], drop: str) -> list[str]:
    """All cells joined by commas, the characters in ``drop`` removed, split on commas."""
    return ",".join(cells).translate(str.maketrans("", "", drop)).split(",")


def _parse_csv(path: Path) -> dict[str, np.ndarray]:
    """One qm9pack CSV as flat arrays: coords [sum n, 3] float64, types [sum n] int8, plus the
    per-molecule n_atoms, smiles and index."""
    import pandas as pd

    df = pd.read_csv(path, usecols=_COLUMNS, dtype={"SMILES": str, "Elements": str,
                                                     "XYZ_Ang": str})
    n_atoms = df["N_atoms"].to_numpy(np.int16)
    total = int(n_atoms.sum(dtype=np.int64))
    coords = np.array(_strip_join(df["XYZ_Ang"].tolist(), "[] "), dtype=np.float64)
    symbols = _strip_join(df["Elements"].tolist(), "[]' \"")
    if coords.size != 3 * total or len(symbols) != total:
        raise ValueError(f"{path}: {total} atoms by N_atoms, but {coords.size} coordinates and "
                         f"{len(symbols)} elements")
    lookup = {s: i for i, s in enumerate(ATOM_TYPES)}
    try:
        types = np.array([lookup[s] for s in symbols], dtype=np.int8)
    except KeyError as e:
        raise ValueError(f"{path}: element {e} is not one of {ATOM_TYPES}") from None
    return {"coords": coords.reshape(-1, 3), "types": types, "n_atoms": n_atoms,
            "smiles": np.array(df["SMILES"].tolist(), dtype=str),
            "index": df["Index"].to_numpy(np.int32)}


def _pad(coords: np.ndarray, types: np.ndarray, n_atoms: np.ndarray
         ) -> tuple[np.ndarray, np.ndarray]:
    """Flat per-atom arrays -> ([M, 29, 3] centred float32, [M, 29] int8 with -1 padding)."""
    if n_atoms.min() < 1 or n_atoms.max() > MAX_ATOMS:
        raise ValueError(f"molecule sizes must lie in 1..{MAX_ATOMS}, got {n_atoms.min()}.."
                         f"{n_atoms.max()}")
    n = n_atoms.astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(n)[:-1]])
    means = np.add.reduceat(coords, starts, axis=0) / n[:, None]          # [M, 3]
    row = np.repeat(np.arange(len(n)), n)                                 # molecule of each atom
    col = np.arange(len(types)) - np.repeat(starts, n)                    # slot within it
    positions = np.zeros((len(n), MAX_ATOMS, 3), np.float32)
    positions[row, col] = coords - means[row]
    atom_types = np.full((len(n), MAX_ATOMS), -1, np.int8)
    atom_types[row, col] = types
    return positions, atom_types


def parse_qm9_csvs(paths: Sequence[str | Path], verbose: bool = True) -> QM9Data:
    """Parse qm9pack-format CSVs (in order) into one :class:`QM9Data`."""
    parts = []
    for path in paths:
        t0 = time.perf_counter()
        parts.append(_parse_csv(Path(path)))
        if verbose:
            print(f"[qm9] parsed {Path(path).name}: {len(parts[-1]['n_atoms']):,} molecules in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    flat = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    positions, atom_types = _pad(flat["coords"], flat["types"], flat["n_atoms"])
    return QM9Data(positions=positions, atom_types=atom_types, n_atoms=flat["n_atoms"],
                   smiles=flat["smiles"], index=flat["index"])


def default_cache_dir() -> Path:
    """``$FLOWRL_RAY_CACHE`` if set, else ``~/.cache/flowrl_ray``."""
    env = os.environ.get("FLOWRL_RAY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flowrl_ray"


def _source_sizes(csv_dir: Path) -> np.ndarray:
    """Byte sizes of the CSVs: a cheap fingerprint so that a changed qm9pack reparses."""
    return np.array([(csv_dir / name).stat().st_size for name in CSV_NAMES], dtype=np.int64)


def _save_atomic(data: QM9Data, path: Path, sizes: np.ndarray) -> None:
    """Write the cache to a temporary file in the same directory, then os.replace it, so a
    reader (or a concurrent writer) never sees a half-written cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, source_sizes=sizes, **{k: getattr(data, k) for k in _FIELDS})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load_cache(path: Path, sizes: np.ndarray) -> QM9Data | None:
    """The cached arrays, or None when the file is missing, unreadable or from other CSVs."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if not np.array_equal(z["source_sizes"], sizes):
                return None
            return QM9Data(**{k: z[k] for k in _FIELDS})
    except (OSError, KeyError, ValueError):
        return None


def load_qm9(cache_dir: str | Path | None = None, refresh: bool = False) -> QM9Data:
    """All of QM9 (130,831 molecules): from the cache, or parsed from qm9pack and cached.

    cache_dir defaults to :func:`default_cache_dir`; refresh=True reparses and rewrites it.
    """
    csv_dir = qm9_csv_dir()
    sizes = _source_sizes(csv_dir)
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = path / CACHE_NAME
    if not refresh:
        data = _load_cache(path, sizes)
        if data is not None:
            return data
    print(f"[qm9] parsing QM9 from {csv_dir} (once; cached at {path})", flush=True)
    data = parse_qm9_csvs([csv_dir / name for name in CSV_NAMES])
    _save_atomic(data, path, sizes)
    return data


PACK_FORMAT = "flowrl_ray.qm9_pack/1"
PACK_SCALE = 1000.0            # pack positions in mÅ


def save_pack(data: QM9Data, path: str | Path, split: str) -> dict:
    """Write ``data`` (one split of :func:`load_qm9`'s QM9, named ``split``) as a compact pack
    that :func:`load_pack` reads without qm9pack; atomic. Returns ``{"molecules", "atoms",
    "bytes", "max_rounding_A"}``."""
    n = np.asarray(data.n_atoms).astype(np.int64)
    real = np.arange(data.positions.shape[1])[None, :] < n[:, None]             # [M, 29]
    coords = data.positions[real]                                                # [sum n, 3] Å
    if np.abs(coords).max() * PACK_SCALE > np.iinfo(np.int16).max:
        raise ValueError(f"a coordinate of {np.abs(coords).max():.1f} Å does not fit the pack's int16 mÅ")
    packed = np.round(coords * PACK_SCALE).astype(np.int16)
    arrays = {"format": np.array(PACK_FORMAT), "split": np.array(split), "n_atoms": n.astype(np.uint8),
              "atom_types": data.atom_types[real].astype(np.uint8), "positions_mA": packed,
              "smiles": np.asarray(data.smiles), "index": np.asarray(data.index, np.int32)}
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return {"molecules": len(n), "atoms": int(n.sum()), "bytes": path.stat().st_size,
            "max_rounding_A": float(np.abs(packed / PACK_SCALE - coords).max())}


def load_pack(path: str | Path, split: str | None = None) -> QM9Data:
    """A pack written by :func:`save_pack` as padded :class:`QM9Data` (each molecule centred
    again after rounding). ``split``: the split the pack must hold (ValueError naming both)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{path}: not a readable QM9 pack ({e})") from None
    fmt = str(arrays["format"]) if "format" in arrays else None
    if fmt != PACK_FORMAT:
        raise ValueError(f"{path} is not a QM9 pack ({PACK_FORMAT}; got {fmt!r}): make one with "
                         f"`flowrl-ray qm9-pack --out FILE`")
    if split is not None and str(arrays["split"]) != split:
        raise ValueError(f"{path} holds QM9's {str(arrays['split'])!r} split, not {split!r}")
    n = arrays["n_atoms"].astype(np.int16)
    positions, atom_types = _pad(arrays["positions_mA"].astype(np.float64) / PACK_SCALE,
                                 arrays["atom_types"].astype(np.int8), n)
    return QM9Data(positions=positions, atom_types=atom_types, n_atoms=n, smiles=arrays["smiles"],
                   index=arrays["index"])


def qm9_splits(num_molecules: int, seed: int = 0) -> dict[str, np.ndarray]:
    """EDM's train/valid/test split of ``num_molecules`` positions (sorted int64 arrays).

    Sizes for the full 130,831: train 100,000, test int(0.1 * M) = 13,083, valid the remaining
    17,748; for other M the train share is scaled (round(M * 100,000 / 130,831)). The sets come
    from ``np.random.RandomState(seed).permutation(M)`` cut as train | valid | test, which for
    seed 0 is the permutation EDM draws with ``np.random.seed(0)``.
    """
    m = int(num_molecules)
    if m < 1:
        raise ValueError(f"num_molecules must be >= 1, got {num_molecules}")
    n_train = EDM_TRAIN if m == NUM_MOLECULES else int(round(m * EDM_TRAIN / NUM_MOLECULES))
    n_test = int(0.1 * m)
    n_valid = m - n_train - n_test
    perm = np.random.RandomState(seed).permutation(m)
    train, valid, test = np.split(perm, [n_train, n_train + n_valid])
    return {"train": np.sort(train), "valid": np.sort(valid), "test": np.sort(test)}


def atom_count_histogram(n_atoms: np.ndarray, max_atoms: int = MAX_ATOMS) -> np.ndarray:
    """P(number of atoms) as [max_atoms + 1] float64, index = atom count (EDM samples molecule
    sizes from this)."""
    n = np.asarray(n_atoms).astype(np.int64).ravel()
    if n.size == 0:
        raise ValueError("no molecules to count")
    if n.min() < 0 or n.max() > max_atoms:
        raise ValueError(f"atom counts must lie in 0..{max_atoms}, got {n.min()}..{n.max()}")
    counts = np.bincount(n, minlength=max_atoms + 1).astype(np.float64)
    return counts / counts.sum()
