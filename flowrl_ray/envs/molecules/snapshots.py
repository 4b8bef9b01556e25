"""Pictures of sampled molecules: a grid of 2-D depictions, each cell's legend saying whether the
molecule is stable and valid, and its formation energy per atom.

The bonds drawn are the ones the scorer's checks saw (:mod:`~flowrl_ray.envs.molecules.chemistry`):

* a *valid* molecule is drawn from RDKit's own perception of the 3-D coordinates
  (``rdkit_molecule``: ``rdDetermineBonds``, bond orders and charges, sanitised), hydrogens
  implicit;
* a molecule RDKit rejects is drawn from EDM's distance table (the stability check's bond
  orders, ``bond_orders``), unsanitised and with every atom shown, so the picture shows the
  over- or under-bonded atoms that made it unstable.

The scorer turns the molecules it is asked for into :func:`snapshot_item` dicts (the molecule in
RDKit's binary form and a legend: small, picklable); the driver draws them into one grid with :func:`save_snapshots`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from flowrl_ray.envs.molecules.chemistry import ATOM_TYPES, ATOMIC_NUMBERS, bond_orders, rdkit_molecule

CELL_PX = 260            # one grid cell is CELL_PX x CELL_PX pixels
PER_ROW = 4              # molecules per grid row


def table_molecule(positions: np.ndarray, atom_types: np.ndarray):
    """An unsanitised RDKit ``Mol`` whose bonds are EDM's table bond orders (the stability
    check's). positions [n, 3] in Å, atom_types [n] indices into ATOM_TYPES; None for unusable
    input (the stability check's rule)."""
    from rdkit import Chem
    orders = bond_orders(positions, atom_types)                       # [n, n] int, or None
    if orders is None:
        return None
    kinds = {1: Chem.BondType.SINGLE, 2: Chem.BondType.DOUBLE, 3: Chem.BondType.TRIPLE}
    rw = Chem.RWMol()
    for t in np.asarray(atom_types, dtype=np.int64):
        atom = Chem.Atom(ATOMIC_NUMBERS[int(t)])
        atom.SetNoImplicit(True)          # show exactly the bonds the table found, no invented H
        rw.AddAtom(atom)
    n = len(orders)
    for i in range(n):
        for j in range(i + 1, n):
            if orders[i, j]:
                rw.AddBond(i, j, kinds[int(orders[i, j])])
    mol = rw.GetMol()
    mol.UpdatePropertyCache(strict=False)
    return mol


def depiction(positions: np.ndarray, atom_types: np.ndarray):
    """The molecule to draw, with 2-D coordinates: RDKit's perceived molecule (sampled
    hydrogens folded into their atoms' labels, none invented) when it is valid, else the
    table-bond graph (every atom); None if the input is unusable."""
    from rdkit import Chem, rdBase
    from rdkit.Chem import rdDepictor
    _blocker = rdBase.BlockLogs()  # noqa: F841 - RDKit's warnings about odd molecules
    mol = rdkit_molecule(positions, atom_types)
    if mol is not None:
        # only the sampled atoms: no hydrogens that sanitising would invent (a lone C is not CH4);
        # the sampled hydrogens are folded into their heavy atoms' labels
        mol = Chem.Mol(mol)
        for atom in mol.GetAtoms():
            atom.SetNoImplicit(True)
        mol.UpdatePropertyCache(strict=False)
        try:
            mol = Chem.RemoveHs(mol, sanitize=False)
        except Exception:  # noqa: BLE001 - keep the hydrogens
            pass
    else:
        mol = table_molecule(positions, atom_types)
        if mol is None:
            return None
    mol = Chem.Mol(mol)
    mol.RemoveAllConformers()
    rdDepictor.Compute2DCoords(mol)
    return mol


def formula(atom_types: np.ndarray) -> str:
    """Hill-order formula of the sampled atoms, e.g. C2H6O ([n] indices into ATOM_TYPES)."""
    counts = {s: int(np.sum(np.asarray(atom_types) == i)) for i, s in enumerate(ATOM_TYPES)}
    order = ["C", "H"] + sorted(s for s in ATOM_TYPES if s not in ("C", "H"))
    return "".join(f"{s}{counts[s] if counts[s] > 1 else ''}" for s in order if counts.get(s))


def legend(index: int, atom_types: np.ndarray, stable: bool, valid: bool,
           energy_per_atom_eV: float | None = None) -> str:
    """'#<index> <formula>: stable|unstable, valid|invalid[, <E> eV/atom]' (one line: RDKit
    draws a legend's lines over each other)."""
    text = f"#{index} {formula(atom_types)}: {'stable' if stable else 'unstable'}, {'valid' if valid else 'invalid'}"
    if energy_per_atom_eV is not None and math.isfinite(energy_per_atom_eV):
        text += f", {energy_per_atom_eV:+.2f} eV/atom"
    return text


def snapshot_item(index: int, positions: np.ndarray, atom_types: np.ndarray, stable: bool, valid: bool,
                  energy_per_atom_eV: float | None = None) -> dict:
    """{"index", "mol" (the depiction as RDKit's binary form: radicals and unsanitised
    valences survive it, unlike a MOL block; b'' if nothing can be drawn), "stable", "valid",
    "legend"} for one molecule; what a scorer returns to the driver."""
    mol = depiction(positions, atom_types)
    return {"index": int(index), "mol": mol.ToBinary() if mol is not None else b"",
            "stable": bool(stable), "valid": bool(valid),
            "legend": legend(index, atom_types, stable, valid, energy_per_atom_eV)}


def grid_png(items: list[dict]) -> bytes:
    """One PNG: a grid of the items' molecules (in index order) with their legends, PER_ROW per
    row, CELL_PX square cells; an item with no drawable molecule is an empty cell."""
    from rdkit import Chem, rdBase
    from rdkit.Chem import Draw
    _blocker = rdBase.BlockLogs()  # noqa: F841
    items = sorted(items, key=lambda it: it["index"])
    mols = [Chem.Mol(it["mol"]) if it["mol"] else Chem.Mol() for it in items]
    return Draw.MolsToGridImage(mols, molsPerRow=min(PER_ROW, max(1, len(mols))), subImgSize=(CELL_PX, CELL_PX),
                                legends=[it["legend"] for it in items], returnPNG=True)


def save_snapshots(items: list[dict], media_dir: str | Path, label: str) -> list[tuple[Path, str]]:
    """Draw the molecules the scorers returned into ``media_dir/molecules/<label>.png``.
    -> [(path, caption)] (none when there are no items)."""
    if not items:
        return []
    out = Path(media_dir) / "molecules"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{label}.png"
    tmp = path.with_suffix(".png.tmp")
    tmp.write_bytes(grid_png(items))
    tmp.replace(path)
    stable, valid = sum(it["stable"] for it in items), sum(it["valid"] for it in items)
    return [(path, f"{len(items)} sampled molecules: {stable} stable, {valid} valid")]
