"""Small shared helpers: atomic file writes, seeding, device choice, frozen copies, formatting."""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pickle
import random
import tempfile
import types
from pathlib import Path
from typing import Any, Callable

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


#: set to 1 to load with the full unpickler (it runs whatever code a file names: files you made only)
TRUST_FILES_ENV = "FLOWRL_RAY_TRUST_CHECKPOINTS"


def _storage_from_bytes(data: bytes) -> Any:
    """How pickle rebuilds a torch storage (``torch.storage._load_from_bytes``), through the
    weights-only loader."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _by_name(objects: dict[str, Any]) -> dict[tuple[str, str], Any]:
    return {tuple(name.rsplit(".", 1)): obj for name, obj in objects.items()}


#: what every restricted read admits: numpy's arrays, dtypes, scalars and random generators (named
#: by numpy 1's and numpy 2's modules; a generator's bit generator is named, never taken from the
#: file), ordered dicts, and torch tensors as plain pickle writes them (worker states of older
#: versions: their generator states), the storage read through the weights-only loader
_PLAIN_GLOBALS = {
    **{(m, "_reconstruct"): np.core.multiarray._reconstruct for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    **{(m, "scalar"): np.core.multiarray.scalar for m in ("numpy.core.multiarray", "numpy._core.multiarray")},
    ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
    **{("numpy.dtypes", n): getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")},
    **{("numpy.random._pickle", n): getattr(np.random._pickle, n)
       for n in ("__bit_generator_ctor", "__generator_ctor", "__randomstate_ctor")},
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
}
#: what a torch file may name besides: the globals torch's own weights-only unpickler admits
#: (tensors, parameters, dtypes, devices, sizes and their rebuild functions)
_TORCH_GLOBALS = {**_by_name(torch._weights_only_unpickler._get_allowed_globals()), **_PLAIN_GLOBALS}


def _restricted_unpickler(what: str, admitted: dict, allowed: Callable[[str, str], Any] | None,
                          loads: str) -> type[pickle.Unpickler]:
    """pickle's C unpickler whose globals are ``admitted`` and what ``allowed(module, name)``
    returns; any other is refused (``pickle.UnpicklingError``, one line naming it and `what`)
    before anything is built, unless ``$FLOWRL_RAY_TRUST_CHECKPOINTS=1``."""
    trusted = os.environ.get(TRUST_FILES_ENV) == "1"

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found = admitted.get((module, name))
            if found is None and allowed is not None:
                found = allowed(module, name)
            if found is not None:
                return found
            if trusted:
                return super().find_class(module, name)
            raise pickle.UnpicklingError(
                f"{what} was refused: it names {module}.{name}, which loading would run (only {loads} load; "
                f"{TRUST_FILES_ENV}=1 loads a file you made yourself)")

    return Unpickler


def load_torch_file(path: str | os.PathLike) -> Any:
    """``torch.load`` that runs no code from the file: it admits the globals torch's weights-only
    unpickler admits (tensors and plain containers) plus numpy arrays and dtypes, read by pickle's
    C unpickler (torch's own weights-only one is pure Python: about 1.5 times as slow on a run's
    checkpoint). A file that names any other global is refused with ``pickle.UnpicklingError``
    naming it (one line). With ``$FLOWRL_RAY_TRUST_CHECKPOINTS=1`` everything loads: the legacy
    format of files you made yourself, at the risk of running what they name."""
    unpickler = _restricted_unpickler(str(path), _TORCH_GLOBALS, None, "tensors, plain containers and numpy arrays")
    module = types.SimpleNamespace(__name__=__name__, Unpickler=unpickler,
                                   load=lambda f, **kwargs: unpickler(f, **kwargs).load())
    return torch.load(Path(path), map_location="cpu", weights_only=False, pickle_module=module)


def restricted_loads(blob: bytes, what: str, allowed: Callable[[str, str], Any] | None = None) -> Any:
    """``pickle.loads`` that runs no code from `blob`: it admits plain containers, numpy
    (:data:`_PLAIN_GLOBALS`) and whatever ``allowed(module, name)`` returns (None: not admitted).
    A blob naming anything else is refused with ``pickle.UnpicklingError`` naming it and `what`
    (one line) before any of it is built. With ``$FLOWRL_RAY_TRUST_CHECKPOINTS=1`` the rest loads
    too (the legacy opt-in of :func:`load_torch_file`)."""
    unpickler = _restricted_unpickler(what, _PLAIN_GLOBALS, allowed, "plain data, numpy arrays and the env's own classes")
    return unpickler(io.BytesIO(blob)).load()


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


def randn(shape: tuple, generator: torch.Generator | list[torch.Generator] | None = None,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.randn(shape)``, where ``generator`` may also be a list of ``shape[0]`` generators,
    one per row: row i then draws from generator i alone (as diffusers' ``randn_tensor``), so a
    row's noise does not depend on which other rows share the batch. Evaluation gives each env its
    own generator: an env's episodes are the same whichever process, and beside which envs, runs it."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"{len(generator)} generators for {shape[0]} rows")
        return torch.stack([torch.randn(tuple(shape[1:]), generator=g, dtype=dtype) for g in generator])
    return torch.randn(shape, generator=generator, dtype=dtype)


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
