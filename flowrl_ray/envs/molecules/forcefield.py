"""Energies and forces of generated molecules, with a wall-clock cap that works on a hung C call.

Backends (single points at the given geometry, no relaxation):

* ``gfn2`` (default): GFN2-xTB via ``tblite.interface.Calculator`` (``max-iter`` SCF cycles,
  charge 0, spin from the electron count). tblite speaks atomic units (positions in bohr, energy
  in Hartree, gradient in Hartree/bohr); results here are eV and eV/Å (CODATA 2018), forces =
  -gradient.
* ``mmff``: RDKit MMFF94 on the bonds ``chemistry.rdkit_molecule`` perceives (hydrogens are
  explicit: no AddHs); kcal/mol -> eV, kcal/mol/Å -> eV/Å. About ten times cheaper.

Formation energy = E - sum of isolated-atom energies (eV). For ``gfn2`` the references are GFN2
energies of single H, C, N, O, F atoms with their ground-state unpaired electrons (``uhf`` H 1,
C 2, N 3, O 2, F 1), computed once per child process. MMFF energies have no atomisation zero
(strain + non-bonded terms only), so ``mmff`` has no references: its "formation energy" is E.

Why a child process: a C call cannot be interrupted from Python, and a diffusion model makes
geometries on which an SCF can run very long. Calculations run in a persistent child (one
thread: ``OMP_NUM_THREADS=1`` and friends are set before tblite loads; two threads give erratic
timings on small molecules) that takes a list of molecules and answers each as it finishes. An
answer later than ``timeout_s`` gets the child killed and restarted; that molecule gets
``timeout`` and the rest are sent again. Checks that need no call come first: malformed input or
types outside ``ATOM_TYPES`` (``invalid_atom_type``), NaN/inf coordinates (``nan_coordinates``)
and atoms closer than ``min_distance`` Å (``overlap``; GFN2 gives absurd energies there, e.g.
+243 Eh). Nothing raises on a bad molecule: each gets an :class:`FFResult`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from flowrl_ray.envs.molecules.chemistry import ATOM_TYPES, ATOMIC_NUMBERS

HARTREE_EV = 27.211386245988            # CODATA 2018: Hartree energy in eV
BOHR_ANGSTROM = 0.529177210903          # CODATA 2018: Bohr radius in Å
KCAL_MOL_EV = 4184.0 / (6.02214076e23 * 1.602176634e-19)   # 1 kcal/mol in eV (exact SI constants)
#: unpaired electrons of the isolated atoms' ground states, per atom type (H C N O F)
ATOM_UHF = (1, 2, 3, 2, 1)
BACKENDS = ("gfn2", "mmff")
#: failure reasons an FFResult can carry (besides "ok")
FAILURES = ("invalid_atom_type", "nan_coordinates", "overlap", "timeout", "scf_failed",
            "bond_perception_failed", "mmff_setup_failed", "nonfinite_output")
_THREAD_ENV = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")}
_Z = np.asarray(ATOMIC_NUMBERS)


@dataclass(slots=True)
class FFResult:
    """One molecule's single point. ``forces`` [n, 3] eV/Å (None unless ok); energies in eV (NaN
    unless ok); ``seconds``: the calculation's wall time (the wait, for a timeout)."""
    ok: bool
    reason: str                         # "ok" or one of FAILURES
    n_atoms: int
    energy_eV: float = math.nan
    formation_energy_eV: float = math.nan
    forces: np.ndarray | None = None
    seconds: float = 0.0


def precheck(positions, atom_types, min_distance: float) -> tuple[str | None, np.ndarray, np.ndarray]:
    """(failure reason or None, positions [n, 3] float64 Å, atom_types [n] int64): the checks
    that need no calculation."""
    try:
        pos = np.asarray(positions, dtype=np.float64)
        types = np.asarray(atom_types)
    except (TypeError, ValueError):
        return "invalid_atom_type", np.zeros((0, 3)), np.zeros(0, np.int64)
    n = types.shape[0] if types.ndim == 1 else 0
    integral = np.issubdtype(types.dtype, np.integer) or (
        np.issubdtype(types.dtype, np.floating) and bool(np.all(types == np.round(types))))
    if n == 0 or pos.shape != (n, 3) or not integral:
        return "invalid_atom_type", pos, np.zeros(0, np.int64)
    types = types.astype(np.int64)
    if types.min() < 0 or types.max() >= len(ATOM_TYPES):
        return "invalid_atom_type", pos, types
    if not np.isfinite(pos).all():
        return "nan_coordinates", pos, types
    if n > 1:
        d2 = ((pos[:, None, :] - pos[None, :, :]) ** 2).sum(-1)
        d2[np.diag_indices(n)] = np.inf
        if d2.min() < min_distance * min_distance:
            return "overlap", pos, types
    return None, pos, types


# --------------------------------------------------------------------------- child side

@lru_cache(maxsize=1)
def gfn2_atomic_energies() -> tuple[float, ...]:
    """GFN2-xTB energies (eV) of isolated H, C, N, O, F atoms (``uhf`` = ATOM_UHF), in this
    process (imports tblite: set the thread variables first)."""
    from tblite.interface import Calculator
    out = []
    for z, uhf in zip(ATOMIC_NUMBERS, ATOM_UHF):
        calc = Calculator("GFN2-xTB", np.array([z]), np.zeros((1, 3)), uhf=uhf)
        calc.set("verbosity", 0)
        out.append(float(calc.singlepoint().get("energy")) * HARTREE_EV)
    return tuple(out)


def _gfn2(types: np.ndarray, pos: np.ndarray, max_iter: int) -> tuple[str, float, np.ndarray | None]:
    from tblite.exceptions import TBLiteRuntimeError, TBLiteValueError
    from tblite.interface import Calculator
    try:
        calc = Calculator("GFN2-xTB", _Z[types], pos / BOHR_ANGSTROM)
        calc.set("verbosity", 0)
        calc.set("max-iter", max_iter)
        res = calc.singlepoint()
        energy = float(res.get("energy")) * HARTREE_EV
        forces = res.get("gradient") * (-HARTREE_EV / BOHR_ANGSTROM)
    except (TBLiteRuntimeError, TBLiteValueError):     # "SCF not converged in N cycles", ...
        return "scf_failed", math.nan, None
    return "ok", energy, forces


def _mmff(types: np.ndarray, pos: np.ndarray) -> tuple[str, float, np.ndarray | None]:
    from rdkit.Chem import rdForceFieldHelpers as helpers

    from flowrl_ray.envs.molecules.chemistry import rdkit_molecule
    mol = rdkit_molecule(pos, types)
    if mol is None or mol.GetNumAtoms() != len(types):
        return "bond_perception_failed", math.nan, None
    try:
        props = helpers.MMFFGetMoleculeProperties(mol)   # None when an atom type has no parameters
        ff = None if props is None else helpers.MMFFGetMoleculeForceField(mol, props)
        if ff is None:
            return "mmff_setup_failed", math.nan, None
        energy = ff.CalcEnergy() * KCAL_MOL_EV
        forces = np.asarray(ff.CalcGrad(), dtype=np.float64).reshape(-1, 3) * -KCAL_MOL_EV
    except Exception:           # RDKit raises its own types
        return "mmff_setup_failed", math.nan, None
    return "ok", energy, forces


def _serve() -> None:
    """The child's loop: argv = read fd, write fd, backend, max_iter. Receives lists of
    (atom_types [n], positions [n, 3] Å) and answers (reason, energy eV, forces [n, 3] eV/Å or
    None, seconds) per molecule; None or a closed pipe ends it."""
    read_fd, write_fd, backend, max_iter = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    parent = os.getppid()

    def orphan_watch() -> None:        # a parent killed hard never closes the pipe while we compute
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)
    threading.Thread(target=orphan_watch, daemon=True).start()
    if backend == "mmff":
        from rdkit import rdBase
        from rdkit.Chem import rdForceFieldHelpers  # noqa: F401 - import now, not in the first timed call
        blocker = rdBase.BlockLogs()   # noqa: F841 - MMFF warns on stderr for every odd molecule
        refs = (0.0,) * len(ATOM_TYPES)
    else:
        refs = gfn2_atomic_energies()
    outbox.send(("ready", os.getpid(), refs))
    while True:
        try:
            batch = inbox.recv()
        except (EOFError, OSError):
            return
        if batch is None:
            return
        for types, pos in batch:
            t0 = time.perf_counter()
            reason, energy, forces = _mmff(types, pos) if backend == "mmff" else _gfn2(types, pos, max_iter)
            if reason == "ok" and not (math.isfinite(energy) and np.isfinite(forces).all()):
                reason, energy, forces = "nonfinite_output", math.nan, None
            outbox.send((reason, energy, forces, time.perf_counter() - t0))


# --------------------------------------------------------------------------- parent side

class ForceField:
    """Single points in a persistent child process, restarted after a timeout.

    ``evaluate_many(molecules)`` (or ``submit`` then ``collect``, to overlap other work with the
    child's) takes (positions [n, 3] Å, atom_types [n]) pairs and returns one FFResult each.
    ``atomic_energies_eV`` [5] (per atom type; zeros for mmff); ``restarts`` counts child restarts.
    """

    def __init__(self, backend: str = "gfn2", max_iter: int = 250, timeout_s: float = 10.0,
                 min_distance: float = 0.5, startup_timeout_s: float = 120.0):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend, self.max_iter, self.timeout_s = backend, int(max_iter), float(timeout_s)
        self.min_distance, self.startup_timeout_s = float(min_distance), float(startup_timeout_s)
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._pending: list | None = None
        self._start()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        c_read, p_write = os.pipe()          # parent -> child
        p_read, c_write = os.pipe()          # child -> parent
        env = {**os.environ, **_THREAD_ENV}
        root = str(Path(__file__).resolve().parents[3])     # the package's root, for any cwd
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from flowrl_ray.envs.molecules.forcefield import _serve; _serve()",
                 str(c_read), str(c_write), self.backend, str(self.max_iter)],
                pass_fds=(c_read, c_write), env=env, stdin=subprocess.DEVNULL)
        finally:
            os.close(c_read)
            os.close(c_write)
        self._send, self._recv = Connection(p_write, readable=False), Connection(p_read, writable=False)
        if not self._recv.poll(self.startup_timeout_s):
            self._kill()
            raise RuntimeError(f"force-field child ({self.backend}) did not start in {self.startup_timeout_s} s")
        try:
            _, _, refs = self._recv.recv()
        except EOFError:
            self._kill()
            raise RuntimeError(f"force-field child ({self.backend}) died at start (see its stderr)") from None
        self.atomic_energies_eV = np.asarray(refs, dtype=np.float64)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
        for conn in (getattr(self, "_send", None), getattr(self, "_recv", None)):
            if conn is not None and not conn.closed:
                conn.close()

    def _restart(self) -> None:
        self._kill()
        self.restarts += 1
        self._start()

    def submit(self, molecules) -> None:
        """Check the molecules and start the calculations of those that pass; returns at once."""
        if self._pending is not None:
            raise RuntimeError("collect() the previous submit() first")
        if self._proc is None:          # killed by an interrupted collect()
            self._start()
        results, todo = [], []
        for i, (positions, atom_types) in enumerate(molecules):
            reason, pos, types = precheck(positions, atom_types, self.min_distance)
            results.append(FFResult(False, reason, len(types)) if reason else None)
            if reason is None:
                todo.append((i, types, pos))
        self._pending = [results, todo]
        if todo:
            self._send_from(0)

    def _send_from(self, start: int) -> None:
        batch = [(types.astype(np.int8), pos) for _, types, pos in self._pending[1][start:]]
        try:
            self._send.send(batch)
        except OSError:                 # the child died while idle: a fresh one takes the batch
            self._restart()
            self._send.send(batch)

    def collect(self) -> list[FFResult]:
        """Wait for the submitted molecules: each must answer within timeout_s of the previous
        answer (or of the wait's start), else the child is restarted and it gets ``timeout``.

        Answers are drained in bursts between short naps (about two calculations long) rather
        than by blocking on the pipe: a reader woken by every answer tends to preempt the child
        on its core and costs a wake-up per molecule. A late answer is seen at most a nap late."""
        results, todo = self._pending
        j, last, nap = 0, time.perf_counter(), 1e-3
        try:
            while j < len(todo):
                i, types, _ = todo[j]
                now = time.perf_counter()
                if not self._recv.poll(0):
                    if now - last < self.timeout_s:
                        time.sleep(min(nap, last + self.timeout_s - now))
                        continue
                    results[i] = FFResult(False, "timeout", len(types), seconds=now - last)
                elif (answer := self._receive()) is None:        # the child died in the calculation
                    results[i] = FFResult(False, "scf_failed", len(types), seconds=now - last)
                else:
                    reason, energy, forces, seconds = answer
                    nap = min(max(2 * seconds, 5e-4), 0.02)
                    if reason == "ok":
                        formation = energy - float(self.atomic_energies_eV[types].sum())
                        results[i] = FFResult(True, "ok", len(types), energy, formation, forces, seconds)
                    else:
                        results[i] = FFResult(False, reason, len(types), seconds=seconds)
                    j, last = j + 1, now
                    continue
                self._restart()                 # timed out or died: a fresh child takes the rest
                j, last = j + 1, time.perf_counter()
                if j < len(todo):
                    self._send_from(j)
        finally:
            self._pending = None
            if j < len(todo):           # interrupted: answers may be left in the pipe
                self._kill()
        return results

    def _receive(self):
        try:
            return self._recv.recv()
        except (EOFError, OSError):
            return None

    def evaluate_many(self, molecules) -> list[FFResult]:
        self.submit(molecules)
        return self.collect()

    def evaluate(self, positions, atom_types) -> FFResult:
        return self.evaluate_many([(positions, atom_types)])[0]

    def close(self) -> None:
        """Stop the child (idempotent)."""
        proc = self._proc
        if proc is not None:
            try:
                self._send.send(None)
                proc.wait(timeout=2.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()

    def __enter__(self) -> "ForceField":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:       # interpreter shutdown
            pass
