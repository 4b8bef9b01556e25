"""Small shared helpers: atomic file writes, seeding, device choice, frozen copies, formatting."""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


#: the only globals a checkpoint may name: numpy's array reconstructor, array and dtype (histograms,
#: episode tails), by the names numpy 1 and numpy 2 pickle them under
_NUMPY_GLOBALS = [(np.core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
                  (np.core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
                  (np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype"),
                  *(getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType"))]
#: set to 1 to load with the full unpickler (it runs whatever code a file names: files you made only)
TRUST_FILES_ENV = "FLOWRL_RAY_TRUST_CHECKPOINTS"


def load_torch_file(path: str | os.PathLike) -> Any:
    """``torch.load`` that runs no code from the file: the weights-only unpickler, which admits
    tensors and plain containers, plus numpy arrays and dtypes (:data:`_NUMPY_GLOBALS`). A file
    that names any other global is refused with ``pickle.UnpicklingError`` naming it (one line).
    With ``$FLOWRL_RAY_TRUST_CHECKPOINTS=1`` the full unpickler loads it instead: the legacy
    format of files you made yourself, at the risk of running what they name."""
    if os.environ.get(TRUST_FILES_ENV) == "1":
        return torch.load(Path(path), map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            return torch.load(Path(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)|got <class '([\w.]+)'>", str(e))
        named = (found.group(1) or found.group(2)) if found else "something other than tensors, containers and arrays"
        raise pickle.UnpicklingError(
            f"{path} was refused: it names {named}, which loading would run (only tensors, plain containers "
            f"and numpy arrays load; {TRUST_FILES_ENV}=1 loads a file you made yourself)") from None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch global RNGs (components that own a Generator seed it too)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def worker_seed(seed: int, worker_id: int, restarts: int = 0) -> int:
    """The seed of rollout worker ``worker_id`` of a run seeded ``seed``, after ``restarts``
    replacements: a hash of all three (numpy's SeedSequence), below 2**30 so that the offsets
    added for a worker's envs stay in every library's range. A worker seeds its env i with its
    seed + i; with ``seed + worker_id`` as the worker's seed, neighbouring workers shared 7 of 8
    envs' scene streams, and run seed 1's worker 0 was run seed 0's worker 1 (same envs, same
    action noise): "independent" seeds shared half their first rollouts."""
    return int(np.random.SeedSequence([seed, worker_id, restarts]).generate_state(1)[0] >> 2)


def default_device() -> torch.device:
    """The one place that picks the device: CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def frozen_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy (eval mode, no gradients) of ``module``: the KL reference of GRPO-style
    algorithms, i.e. the model they started from."""
    import copy
    ref = copy.deepcopy(module).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to ``n`` inside the block, restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
