"""Checkpoints: one file per saved iteration, written atomically, plus loading helpers.

A checkpoint is ``runs/<name>/checkpoints/iter_NNNNNN.pt`` (torch.save of a dict):
    trainer   counters (iteration, env_steps, elapsed time, restarts, dropped batches, ...)
    learner   the algorithm's full state (networks, optimisers, schedulers, RNGs) + version
    policy    the rollout policy's weights alone (what eval and serve load)
    workers   each rollout worker's state (envs, RNGs) for exact resume: plain data, pickled
``checkpoints/latest`` names the newest one; it is replaced atomically after the file is in place.
:func:`load_latest` takes the newest checkpoint that loads whole (a file cut by a full disk or a
broken copy, an empty or a foreign one is skipped with one line) and raises one line when none does.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from flowrl_ray.errors import ConfigError, UserError
from flowrl_ray.utils import atomic_write_bytes, atomic_write_text, load_torch_file


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | os.PathLike, iteration: int, payload: dict[str, Any],
                    keep: int = 3) -> Path:
    ckdir = checkpoint_dir(run_dir)
    path = ckdir / f"iter_{iteration:06d}.pt"
    buf = io.BytesIO()
    torch.save(payload, buf)
    atomic_write_bytes(path, buf.getvalue())
    atomic_write_text(ckdir / "latest", path.name + "\n")
    for old in sorted(ckdir.glob("iter_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    ckdir = checkpoint_dir(run_dir)
    pointer = ckdir / "latest"
    if pointer.is_file():
        path = ckdir / pointer.read_text().strip()
        if path.is_file():
            return path
    found = sorted(ckdir.glob("iter_*.pt"))
    return found[-1] if found else None


#: what loading a file that is not a whole checkpoint raises: torch's zip reader on a cut or empty
#: file (RuntimeError, EOFError), the unpickler on a foreign one, a payload without our parts
UNREADABLE = (RuntimeError, EOFError, OSError, ValueError, KeyError, AttributeError, ImportError, IndexError,
              pickle.UnpicklingError, zipfile.BadZipFile)
#: the parts every checkpoint of a run has (see the module docstring)
PARTS = ("trainer", "learner")


def checkpoint_candidates(run_dir: str | os.PathLike) -> list[Path]:
    """The run's checkpoint files, newest first: every ``iter_*.pt`` from the highest iteration
    down (a file written after a failed update of ``latest`` counts), and the file ``latest`` names
    first when it is not one of them."""
    found = sorted(checkpoint_dir(run_dir).glob("iter_*.pt"), reverse=True)
    named = latest_checkpoint(run_dir)
    return ([named] if named is not None and named not in found else []) + found


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_latest(run_dir: str | os.PathLike, log: Callable[[str], None] | None = _to_stderr
                ) -> tuple[Path, dict[str, Any]] | None:
    """(path, payload) of the newest checkpoint of ``run_dir`` that loads whole and holds a run's
    parts. Each newer file that does not is named with the reason in one line through ``log``
    (default: stderr, so a verb's JSON on stdout stays clean), and the next older one is tried.
    None when the run has no checkpoint file; UserError (one line) when it has some and none is
    whole."""
    skipped = []
    for path in checkpoint_candidates(run_dir):
        try:
            payload = load_checkpoint(path)
            if not isinstance(payload, dict) or not all(k in payload for k in PARTS):
                raise ValueError(f"not a checkpoint of a run (no {' / '.join(PARTS)})")
        except UNREADABLE as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            skipped.append(f"{path.name} ({type(e).__name__}: {reason})")
            if log is not None:
                log(f"checkpoint {path} skipped: it does not load whole ({type(e).__name__}: {reason})")
            continue
        return path, payload
    if skipped:
        raise UserError(f"{checkpoint_dir(run_dir)}: no checkpoint loads whole: {'; '.join(skipped)}")
    return None


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    # tensors, containers and numpy arrays only: a file naming anything else is refused (utils)
    return load_torch_file(path)


def load_base_checkpoint(path: str | os.PathLike, key: str, required: tuple[str, ...], kind: str,
                         make_hint: str) -> dict[str, Any]:
    """The base checkpoint that config key ``key`` names (a pretraining file an algorithm starts
    from), read without running code from it: ConfigError naming the key when the file is missing
    (``make_hint`` says how to make one), unreadable, or not a dict holding ``required``."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config key {key!r}: no such file {str(path)!r} ({make_hint})")
    try:
        ckpt = load_torch_file(p)                       # runs no code from the file
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user mistake
        raise ConfigError(f"config key {key!r}: cannot read {str(path)!r}: {e}") from None
    if not isinstance(ckpt, dict) or any(k not in ckpt for k in required):
        raise ConfigError(f"config key {key!r}: {str(path)!r} is not {kind}")
    return ckpt
