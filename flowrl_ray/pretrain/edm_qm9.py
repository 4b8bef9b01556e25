"""`flowrl-ray pretrain` for FED-GRPO configs: train the EDM of ``algo.model`` on QM9.

QM9 comes from the qm9pack package (parsed once, cached as .npz), or from a pack of the train split
(``qm9``, written by ``flowrl-ray qm9-pack``) where the package is missing; the train split is EDM's
(100,000 molecules, permutation seed 0 whatever the run's seed, so that every model of a
project shares one split). Training is EDM's l2
noise-prediction loss with an EMA of the weights (:func:`flowrl_ray.models.edm.fit_edm`); the
checkpoint holds the EMA weights, the model config and the train split's atom-count histogram (what
FED-GRPO samples prompts from). With ``eval_samples`` the new model samples molecules and reports
EDM's metrics beside EDM's published QM9 figures. Written atomically to ``algo.base_model``
(or ``out``), with ``<stem>.metrics.jsonl`` and ``<stem>.loss.png`` beside it.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from flowrl_ray.config import Config, ConfigError, EDMPretrainConfig
from flowrl_ray.utils import atomic_write_bytes, atomic_write_text, format_duration, load_torch_file, torch_threads


def sample_molecules(model, histogram: np.ndarray, count: int, seed: int = 0,
                     batch_size: int = 64) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` molecules from ``model`` (atom counts from ``histogram``), as (positions [n, 3] Å,
    atom types [n]) pairs, in the order their atom counts were drawn. All counts are drawn first
    and the molecules are sampled in batches of similar size (sorted by count; a batch is padded
    to its largest molecule, and the network's cost grows with its square); the same ``seed``
    gives every model the same counts and noise, so the samples of two models pair up."""
    from flowrl_ray.models.edm import NodeDistribution, to_numpy_molecules
    generator = torch.Generator().manual_seed(seed)
    n_atoms = NodeDistribution(histogram).sample(count, generator)                  # [count]
    order = torch.argsort(n_atoms, stable=True)
    out: list = [None] * count
    model.eval()
    for i in range(0, count, batch_size):
        rows = order[i:i + batch_size]
        result = model.sample(n_atoms[rows].to(model.device), generator)
        for r, mol in zip(rows.tolist(), to_numpy_molecules(result.positions, result.atom_types, result.node_mask)):
            out[r] = mol
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


def _on_cpu(obj):
    """``obj`` with every tensor in its dicts, lists and tuples moved to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


@contextlib.contextmanager
def _tf32(enabled: bool):
    """TF32 matrix products on CUDA while training (the EGNN's dense layers; distances and
    coordinate updates stay elementwise in float32), restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if enabled:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def run(cfg: Config, p: EDMPretrainConfig, seed: int, progress: bool = True) -> dict:
    """``flowrl-ray pretrain`` for FED-GRPO: the ``pretrain:`` section ``p``."""
    return pretrain_edm(cfg, out=p.out, steps=p.steps, batch_size=p.batch_size, lr=p.lr, seed=seed,
                        eval_samples=p.eval_samples, curve_every=p.curve_every, curve_samples=p.curve_samples,
                        checkpoint_every=p.checkpoint_every, max_minutes=p.max_minutes, resume=p.resume,
                        init_from=p.init_from, qm9=p.qm9, device=p.device, progress=progress)


def pretrain_edm(cfg: Config, out: str | Path | None = None, steps: int = 2000,
                 batch_size: int | None = None, lr: float | None = None, seed: int = 0,
                 eval_samples: int = 0, curve_every: int = 0, curve_samples: int = 200, checkpoint_every: int = 0, max_minutes: float = 0.0,
                 resume: bool = False, init_from: str | Path | None = None, qm9: str | Path | None = None,
                 device: str = "auto", progress: bool = True) -> dict:
    """Train the EDM of ``cfg.algo.model`` on QM9's train split for ``steps`` optimiser steps in all.

    ``curve_every`` > 0: every ``curve_every`` steps the EMA weights sample ``curve_samples``
    molecules (the same atom counts and noise each time) and EDM's metrics go to
    ``<stem>.metrics.jsonl`` (rows with ``"atom_stability"``) and ``<stem>.stability.png``, and the
    checkpoint is written, so a stopped run loses at most ``curve_every`` steps;
    ``checkpoint_every`` > 0 writes the checkpoint every that many steps without sampling.
    ``max_minutes`` > 0 ends this invocation at the first checkpoint or curve point after that many
    minutes (the final evaluation still runs; ``resume`` continues it later). ``resume``: when
    ``out`` holds a checkpoint of this verb, its run continues (raw and EMA weights, optimiser,
    clipping window, data sampler, loss and stability curves) up to ``steps``; the model config
    must match (ConfigError naming the key); ``batch_size`` and ``lr`` not given (None) are the
    checkpoint's (a new run: 64 and 1e-4, EDM's). ``init_from``: a base checkpoint (``algo.base_model``'s
    format, e.g. an imported EDM) whose weights start a new run, raw and EMA alike (a resumed run
    continues its own weights instead); its architecture must be the config's. ``qm9``: a pack of
    the train split (``flowrl-ray qm9-pack``) instead of qm9pack. ``eval_samples`` > 0: the final EMA model's metrics on
    that many samples, beside EDM's published figures. ``device``: ``"auto"`` trains on CUDA when
    there is one (with TF32 matrix products).
    """
    from flowrl_ray.envs.molecules.qm9 import atom_count_histogram, load_pack, load_qm9, qm9_splits
    from flowrl_ray.models.edm import EDM, check_base_model, fit_edm, load_base_model
    from flowrl_ray.plotting import plot_curves
    out = Path(out or cfg.algo.base_model or "pretrained/edm_qm9.pt")
    out.parent.mkdir(parents=True, exist_ok=True)
    if init_from is not None and not Path(init_from).is_file():
        raise ConfigError(f"config key 'pretrain.init_from': no such file {str(init_from)!r}")
    if qm9 is not None:
        try:
            train = load_pack(qm9, split="train")
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"config key 'pretrain.qm9': {e}") from None
    else:
        data = load_qm9()
        train = data.subset(qm9_splits(len(data), seed=0)["train"])
    histogram = atom_count_histogram(train.n_atoms, cfg.algo.model.max_atoms)
    torch.manual_seed(seed)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    model = EDM(cfg.algo.model).to(device)
    generator = torch.Generator().manual_seed(seed)                  # the data sampler's, on the CPU
    log = print if progress else (lambda *a, **k: None)
    rows: list[dict] = []                 # loss rows {"step", "loss", "time_s"} and curve rows
    state, done, before_s, prior_eval = None, 0, 0.0, None
    if resume and out.is_file():
        check_base_model(cfg, out)
        saved = load_torch_file(out)
        if "train_state" not in saved:
            raise ConfigError(f"--resume: {out} holds no training state (written before resumable "
                              f"pretraining); start a new run with another --out")
        ts = saved["train_state"]
        model.load_state_dict(ts["raw_state_dict"])
        generator.set_state(ts["generator"])
        state, done, before_s, rows = ts["fit"], int(ts["fit"]["step"]), float(ts["train_s"]), list(ts["rows"])
        prior_eval = saved.get("eval")
        batch_size = int(saved.get("batch_size", 64)) if batch_size is None else batch_size
        lr = float(saved.get("lr", 1e-4)) if lr is None else lr
        log(f"[pretrain] resuming {out} at step {done}", flush=True)
        init_from = saved.get("init_from")
    elif init_from is not None:                      # a new run from a base's weights
        check_base_model(cfg, init_from)
        model.load_state_dict(load_base_model(init_from)["state_dict"])
        log(f"[pretrain] starting from the weights of {init_from}", flush=True)
    batch_size = 64 if batch_size is None else batch_size
    lr = 1e-4 if lr is None else lr
    log(f"[pretrain] EDM on QM9: {len(train):,} training molecules, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters on {device}, steps {done + 1}-{steps} of "
        f"{batch_size}",
        flush=True)
    start, first = time.perf_counter(), done
    ema_model = EDM(cfg.algo.model).to(device)
    metrics_path, png_path, curve_png = (out.parent / f"{out.stem}.{s}"
                                         for s in ("metrics.jsonl", "loss.png", "stability.png"))

    def elapsed() -> float:
        return before_s + time.perf_counter() - start

    def report(step: int, total: int, loss: float) -> None:
        rows.append({"step": step, "loss": loss, "time_s": round(elapsed(), 1)})
        run_s = time.perf_counter() - start
        log(f"[pretrain] step {step}/{steps} loss {loss:.4f} ({format_duration(elapsed())}, "
            f"eta {format_duration(run_s / max(1, step - first) * (steps - step))})", flush=True)

    plots = [True]                     # False once matplotlib is found missing (a bare GPU machine)

    def save(fit: dict, final_metrics: dict | None) -> None:
        losses = [r for r in rows if "loss" in r]
        curve = [r for r in rows if "atom_stability" in r]
        atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
        try:
            if plots[0]:
                plot_curves({"l2 loss": [(np.array([r["step"] for r in losses]),
                                          np.array([r["loss"] for r in losses]))]},
                            png_path, "step", "EDM l2 loss", "EDM pretraining on QM9")
            if plots[0] and curve:
                x = np.array([r["step"] for r in curve])
                plot_curves({k.replace("_", " "): [(x, 100 * np.array([r[k] for r in curve]))]
                             for k in ("atom_stability", "molecule_stability", "validity")},
                            curve_png, "step", f"% of {curve_samples} samples", "EDM samples during pretraining")
        except ImportError as e:
            plots[0] = False
            log(f"[pretrain] no PNG curves ({e}); {metrics_path.name} has the numbers", flush=True)
        ckpt = {"state_dict": fit["ema_state_dict"] if fit["ema_state_dict"] is not None
                else model.state_dict(),
                "model_config": asdict(cfg.algo.model), "node_histogram": histogram,
                "steps": fit["state"]["step"], "batch_size": batch_size, "lr": lr,
                "init_from": None if init_from is None else str(init_from),
                "final_loss": losses[-1]["loss"] if losses else None, "eval": final_metrics,
                "curve": curve, "config": cfg.to_dict(),
                "train_state": {"raw_state_dict": model.state_dict(), "fit": fit["state"],
                                "generator": generator.get_state(), "rows": rows, "train_s": elapsed()}}
        buf = io.BytesIO()
        torch.save(_on_cpu(ckpt), buf)                  # loads on a machine without the GPU too
        atomic_write_bytes(out, buf.getvalue())

    skipped, fit = 0, None
    with torch_threads(cfg.runtime.torch_threads), _tf32(device == "cuda"):
        every = [k for k in (curve_every, checkpoint_every) if k > 0]
        chunk = min(every) if every else max(1, steps - done)
        while done < steps or fit is None:
            n = min(chunk - done % chunk if every else chunk, steps - done)   # to the next multiple
            fit = fit_edm(model, train.positions, train.atom_types, steps=n, batch_size=batch_size, lr=lr,
                          generator=generator, log_every=max(1, min(100, n // 20, steps // 20)),
                          progress=report, state=state)
            state, done, skipped = fit["state"], fit["state"]["step"], skipped + fit["skipped_steps"]
            if n > 0 and checkpoint_every > 0 and (done % checkpoint_every == 0 or done == steps) and not (
                    curve_every > 0 and (done % curve_every == 0 or done == steps)):
                save(fit, None)
            if curve_every > 0 and n > 0 and (done % curve_every == 0 or done == steps):
                ema_model.load_state_dict(fit["ema_state_dict"] or model.state_dict())
                point = evaluate_model(ema_model, histogram, curve_samples, seed)
                rows.append({"step": done, "time_s": round(elapsed(), 1),
                             **{k: point[k] for k in ("atom_stability", "molecule_stability", "validity",
                                                      "uniqueness")}})
                log(f"[pretrain] step {done}: atom stability {100 * point['atom_stability']:.1f} %, "
                    f"molecule stability {100 * point['molecule_stability']:.1f} %, validity "
                    f"{100 * point['validity']:.1f} % ({curve_samples} samples, {point['sample_s']} s)", flush=True)
                save(fit, None)
            if n == 0 or (max_minutes > 0 and time.perf_counter() - start >= 60 * max_minutes):
                break
        train_s = elapsed()
        metrics = None
        if done == first and prior_eval and prior_eval.get("num_molecules") == eval_samples:
            metrics = prior_eval                    # a finished run resumed: its evaluation stands
        elif eval_samples > 0:
            ema_model.load_state_dict(fit["ema_state_dict"] or model.state_dict())
            metrics = evaluate_model(ema_model, histogram, eval_samples, seed)
    save(fit, metrics)
    losses = [r for r in rows if "loss" in r]
    summary = {"out": str(out), "molecules": len(train), "steps": done,
               "first_loss": losses[0]["loss"] if losses else None,
               "final_loss": losses[-1]["loss"] if losses else None,
               "skipped_steps": skipped, "train_s": round(train_s, 1),
               "init_from": None if init_from is None else str(init_from),
               "metrics": str(metrics_path), "loss_plot": str(png_path) if plots[0] else None}
    curve = [r for r in rows if "atom_stability" in r]
    if curve:
        summary["stability_plot"] = str(curve_png) if plots[0] else None
        summary["curve"] = curve
    if metrics is not None:
        summary["eval"] = metrics
    return summary
