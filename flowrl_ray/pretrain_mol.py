"""`flowrl-ray pretrain` for FED-GRPO configs: train the EDM of ``algo.model`` on QM9.

QM9 comes from the qm9pack package (parsed once, cached as .npz); the train split is EDM's
(100,000 molecules, permutation seed 0 whatever the run's seed, so that every model of a
project shares one split). Training is EDM's l2
noise-prediction loss with an EMA of the weights (:func:`flowrl_ray.models.edm.fit_edm`); the
checkpoint holds the EMA weights, the model config and the train split's atom-count histogram (what
FED-GRPO samples prompts from). With ``eval_samples`` the new model samples molecules and reports
EDM's metrics beside EDM's published QM9 figures. Written atomically to ``algo.base_model``
(or ``out``), with ``<stem>.metrics.jsonl`` and ``<stem>.loss.png`` beside it.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from flowrl_ray.config import Config
from flowrl_ray.pretrain import _torch_threads
from flowrl_ray.utils import atomic_write_bytes, atomic_write_text, format_duration


def sample_molecules(model, histogram: np.ndarray, count: int, seed: int = 0,
                     batch_size: int = 64) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` molecules from ``model`` (atom counts from ``histogram``), as (positions [n, 3] Å,
    atom types [n]) pairs."""
    from flowrl_ray.algorithms.fed_grpo import to_numpy_molecules
    from flowrl_ray.models.edm import NodeDistribution
    generator = torch.Generator().manual_seed(seed)
    nodes = NodeDistribution(histogram)
    out: list = []
    model.eval()
    while len(out) < count:
        n_atoms = nodes.sample(min(batch_size, count - len(out)), generator)
        result = model.sample(n_atoms.to(model.device), generator)
        out += to_numpy_molecules(result.positions, result.atom_types, result.node_mask)
    return out


def evaluate_model(model, histogram: np.ndarray, count: int, seed: int = 0) -> dict:
    """EDM's metrics (stability, RDKit validity and uniqueness) of ``count`` samples, with
    EDM's published QM9 figures beside them."""
    from flowrl_ray.envs.molecules.chemistry import EDM_PUBLISHED_QM9, molecule_metrics
    start = time.perf_counter()
    metrics = molecule_metrics(sample_molecules(model, histogram, count, seed))
    metrics["sample_s"] = round(time.perf_counter() - start, 1)
    metrics["edm_published"] = dict(EDM_PUBLISHED_QM9)
    return metrics


def pretrain_edm(cfg: Config, out: str | Path | None = None, steps: int = 2000, batch_size: int = 64,
                 lr: float = 1e-4, seed: int = 0, eval_samples: int = 0, progress: bool = True) -> dict:
    from flowrl_ray.envs.molecules.qm9 import atom_count_histogram, load_qm9, qm9_splits
    from flowrl_ray.models.edm import EDM, fit_edm
    from flowrl_ray.plotting import plot_curves
    out = Path(out or cfg.algo.base_model or "pretrained/edm_qm9.pt")
    out.parent.mkdir(parents=True, exist_ok=True)
    data = load_qm9()
    train = data.subset(qm9_splits(len(data), seed=0)["train"])
    histogram = atom_count_histogram(train.n_atoms, cfg.algo.model.max_atoms)
    torch.manual_seed(seed)
    model = EDM(cfg.algo.model)
    log = print if progress else (lambda *a, **k: None)
    log(f"[pretrain] EDM on QM9: {len(train):,} training molecules, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {steps} steps of {batch_size}", flush=True)
    rows: list[dict] = []
    start = time.perf_counter()

    def report(step: int, total: int, loss: float) -> None:
        elapsed = time.perf_counter() - start
        rows.append({"step": step, "loss": loss, "time_s": round(elapsed, 1)})
        log(f"[pretrain] step {step}/{total} loss {loss:.4f} ({format_duration(elapsed)}, "
            f"eta {format_duration(elapsed / step * (total - step))})", flush=True)

    with _torch_threads(cfg.runtime.torch_threads):
        fit = fit_edm(model, train.positions, train.atom_types, steps=steps, batch_size=batch_size, lr=lr,
                      generator=torch.Generator().manual_seed(seed), log_every=max(1, min(100, steps // 20)),
                      progress=report)
        train_s = time.perf_counter() - start
        if fit["ema_state_dict"] is not None:
            model.load_state_dict(fit["ema_state_dict"])
        metrics = evaluate_model(model, histogram, eval_samples, seed) if eval_samples > 0 else None

    metrics_path, png_path = (out.parent / f"{out.stem}.{s}" for s in ("metrics.jsonl", "loss.png"))
    atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
    plot_curves({"l2 loss": [(np.array([r["step"] for r in rows]), np.array([r["loss"] for r in rows]))]},
                png_path, "step", "EDM l2 loss", "EDM pretraining on QM9")
    ckpt = {"state_dict": model.state_dict(), "model_config": asdict(cfg.algo.model),
            "node_histogram": histogram, "steps": steps, "batch_size": batch_size, "lr": lr,
            "final_loss": rows[-1]["loss"] if rows else None, "eval": metrics, "config": cfg.to_dict()}
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    atomic_write_bytes(out, buf.getvalue())
    summary = {"out": str(out), "molecules": len(train), "steps": steps,
               "first_loss": rows[0]["loss"] if rows else None, "final_loss": ckpt["final_loss"],
               "skipped_steps": fit["skipped_steps"], "train_s": round(train_s, 1),
               "metrics": str(metrics_path), "loss_plot": str(png_path)}
    if metrics is not None:
        summary["eval"] = metrics
    return summary
