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
    """``flowrl-ray pretrain`` for FED-GRPO: train the EDM of ``cfg.algo.model`` on QM9's train split
    with the ``pretrain:`` section ``p`` (its keys and defaults: :class:`EDMPretrainConfig`).

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
    the train split (``flowrl-ray qm9-pack``) instead of qm9pack. ``eval_samples`` > 0: the final
    EMA model's metrics on that many samples, beside EDM's published figures. ``device``:
    ``"auto"`` trains on CUDA when there is one (with TF32 matrix products).
    """
    return EDMPretraining(cfg, p, seed, progress).run()


def pretrain_edm(cfg: Config, seed: int = 0, progress: bool = True, **settings) -> dict:
    """:func:`run` with the section's keys as keyword arguments (the others at the section's defaults)."""
    return run(cfg, EDMPretrainConfig(**settings), seed, progress)


class EDMPretraining:
    """One invocation of EDM pretraining (see :func:`run`): the train split, the model, where the
    run starts (a new run, a base's weights or the checkpoint's training state), the loop in
    chunks between checkpoints and curve points, and the checkpoint it writes."""

    def __init__(self, cfg: Config, p: EDMPretrainConfig, seed: int, progress: bool):
        from flowrl_ray.envs.molecules.qm9 import atom_count_histogram
        from flowrl_ray.models.edm import EDM
        self.cfg, self.p, self.seed = cfg, p, seed
        self.out = Path(p.out or cfg.algo.base_model or "pretrained/edm_qm9.pt")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if p.init_from is not None and not Path(p.init_from).is_file():
            raise ConfigError(f"config key 'pretrain.init_from': no such file {str(p.init_from)!r}")
        self.train = self._train_split()
        self.histogram = atom_count_histogram(self.train.n_atoms, cfg.algo.model.max_atoms)
        torch.manual_seed(seed)
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if p.device == "auto" else p.device
        self.model = EDM(cfg.algo.model).to(self.device)
        self.generator = torch.Generator().manual_seed(seed)            # the data sampler's, on the CPU
        self.log = print if progress else (lambda *a, **k: None)
        self.rows: list[dict] = []        # loss rows {"step", "loss", "time_s"} and curve rows
        self.metrics_path, self.png_path, self.curve_png = (
            self.out.parent / f"{self.out.stem}.{s}" for s in ("metrics.jsonl", "loss.png", "stability.png"))
        self.plots = True                 # False once matplotlib is found missing (a bare GPU machine)

    def _train_split(self):
        from flowrl_ray.envs.molecules.qm9 import load_pack, load_qm9, qm9_splits
        if self.p.qm9 is not None:
            try:
                return load_pack(self.p.qm9, split="train")
            except (ValueError, FileNotFoundError) as e:
                raise ConfigError(f"config key 'pretrain.qm9': {e}") from None
        data = load_qm9()
        return data.subset(qm9_splits(len(data), seed=0)["train"])

    def _start(self) -> None:
        """Where this invocation starts: the checkpoint's training state (``resume``), a base's
        weights (``init_from``) or new weights; the batch size and lr (the checkpoint's when
        resumed and not given)."""
        from flowrl_ray.models.edm import check_base_model, load_base_model
        p, out = self.p, self.out
        self.state, self.done, self.before_s, self.prior_eval = None, 0, 0.0, None
        self.batch_size, self.lr, self.init_from = p.batch_size, p.lr, p.init_from
        if p.resume and out.is_file():
            check_base_model(self.cfg, out)
            saved = load_torch_file(out)
            if "train_state" not in saved:
                raise ConfigError(f"--resume: {out} holds no training state (written before resumable "
                                  f"pretraining); start a new run with another --out")
            ts = saved["train_state"]
            self.model.load_state_dict(ts["raw_state_dict"])
            self.generator.set_state(ts["generator"])
            self.state, self.done, self.before_s = ts["fit"], int(ts["fit"]["step"]), float(ts["train_s"])
            self.rows, self.prior_eval = list(ts["rows"]), saved.get("eval")
            self.batch_size = int(saved.get("batch_size", 64)) if p.batch_size is None else p.batch_size
            self.lr = float(saved.get("lr", 1e-4)) if p.lr is None else p.lr
            self.log(f"[pretrain] resuming {out} at step {self.done}", flush=True)
            self.init_from = saved.get("init_from")
        elif p.init_from is not None:                    # a new run from a base's weights
            check_base_model(self.cfg, p.init_from)
            self.model.load_state_dict(load_base_model(p.init_from)["state_dict"])
            self.log(f"[pretrain] starting from the weights of {p.init_from}", flush=True)
        self.batch_size = 64 if self.batch_size is None else self.batch_size
        self.lr = 1e-4 if self.lr is None else self.lr

    def elapsed(self) -> float:
        return self.before_s + time.perf_counter() - self.start

    def report(self, step: int, total: int, loss: float) -> None:
        self.rows.append({"step": step, "loss": loss, "time_s": round(self.elapsed(), 1)})
        run_s = time.perf_counter() - self.start
        self.log(f"[pretrain] step {step}/{self.p.steps} loss {loss:.4f} ({format_duration(self.elapsed())}, "
                 f"eta {format_duration(run_s / max(1, step - self.first) * (self.p.steps - step))})", flush=True)

    def _plot(self) -> None:
        from flowrl_ray.plotting import plot_curves
        losses = [r for r in self.rows if "loss" in r]
        curve = [r for r in self.rows if "atom_stability" in r]
        try:
            if self.plots:
                plot_curves({"l2 loss": [(np.array([r["step"] for r in losses]), np.array([r["loss"] for r in losses]))]},
                            self.png_path, "step", "EDM l2 loss", "EDM pretraining on QM9")
            if self.plots and curve:
                x = np.array([r["step"] for r in curve])
                plot_curves({k.replace("_", " "): [(x, 100 * np.array([r[k] for r in curve]))]
                             for k in ("atom_stability", "molecule_stability", "validity")},
                            self.curve_png, "step", f"% of {self.p.curve_samples} samples",
                            "EDM samples during pretraining")
        except ImportError as e:
            self.plots = False
            self.log(f"[pretrain] no PNG curves ({e}); {self.metrics_path.name} has the numbers", flush=True)

    def save(self, fit: dict, final_metrics: dict | None) -> None:
        """The metrics file, the curves and the checkpoint (EMA weights for FED-GRPO, the training
        state for --resume), each written atomically."""
        losses = [r for r in self.rows if "loss" in r]
        atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.rows))
        self._plot()
        ckpt = {"state_dict": fit["ema_state_dict"] if fit["ema_state_dict"] is not None
                else self.model.state_dict(),
                "model_config": asdict(self.cfg.algo.model), "node_histogram": self.histogram,
                "steps": fit["state"]["step"], "batch_size": self.batch_size, "lr": self.lr,
                "init_from": None if self.init_from is None else str(self.init_from),
                "final_loss": losses[-1]["loss"] if losses else None, "eval": final_metrics,
                "curve": [r for r in self.rows if "atom_stability" in r], "config": self.cfg.to_dict(),
                "train_state": {"raw_state_dict": self.model.state_dict(), "fit": fit["state"],
                                "generator": self.generator.get_state(), "rows": self.rows,
                                "train_s": self.elapsed()}}
        buf = io.BytesIO()
        torch.save(_on_cpu(ckpt), buf)                  # loads on a machine without the GPU too
        atomic_write_bytes(self.out, buf.getvalue())

    def _curve_point(self, fit: dict) -> None:
        """The EMA weights' stability, validity and uniqueness on curve_samples molecules."""
        self.ema_model.load_state_dict(fit["ema_state_dict"] or self.model.state_dict())
        point = evaluate_model(self.ema_model, self.histogram, self.p.curve_samples, self.seed)
        self.rows.append({"step": self.done, "time_s": round(self.elapsed(), 1),
                          **{k: point[k] for k in ("atom_stability", "molecule_stability", "validity", "uniqueness")}})
        self.log(f"[pretrain] step {self.done}: atom stability {100 * point['atom_stability']:.1f} %, "
                 f"molecule stability {100 * point['molecule_stability']:.1f} %, validity "
                 f"{100 * point['validity']:.1f} % ({self.p.curve_samples} samples, {point['sample_s']} s)",
                 flush=True)

    def _train(self) -> tuple[dict, int]:
        """fit_edm in chunks that end at every checkpoint and curve point, up to the step budget or
        max_minutes; -> (the last fit's result, the steps it skipped as non-finite)."""
        from flowrl_ray.models.edm import fit_edm
        p, skipped, fit = self.p, 0, None
        every = [k for k in (p.curve_every, p.checkpoint_every) if k > 0]
        chunk = min(every) if every else max(1, p.steps - self.done)
        while self.done < p.steps or fit is None:
            n = min(chunk - self.done % chunk if every else chunk, p.steps - self.done)   # to the next multiple
            fit = fit_edm(self.model, self.train.positions, self.train.atom_types, steps=n,
                          batch_size=self.batch_size, lr=self.lr, generator=self.generator,
                          log_every=max(1, min(100, n // 20, p.steps // 20)), progress=self.report, state=self.state)
            self.state, self.done, skipped = fit["state"], fit["state"]["step"], skipped + fit["skipped_steps"]
            due = lambda every: every > 0 and (self.done % every == 0 or self.done == p.steps)   # noqa: E731
            if n > 0 and due(p.checkpoint_every) and not due(p.curve_every):
                self.save(fit, None)
            if n > 0 and due(p.curve_every):
                self._curve_point(fit)
                self.save(fit, None)
            if n == 0 or (p.max_minutes > 0 and time.perf_counter() - self.start >= 60 * p.max_minutes):
                break
        return fit, skipped

    def run(self) -> dict:
        from flowrl_ray.models.edm import EDM
        p = self.p
        self._start()
        self.log(f"[pretrain] EDM on QM9: {len(self.train):,} training molecules, "
                 f"{sum(w.numel() for w in self.model.parameters()):,} parameters on {self.device}, steps "
                 f"{self.done + 1}-{p.steps} of {self.batch_size}", flush=True)
        self.start, self.first = time.perf_counter(), self.done
        self.ema_model = EDM(self.cfg.algo.model).to(self.device)
        with torch_threads(self.cfg.runtime.torch_threads), _tf32(self.device == "cuda"):
            fit, skipped = self._train()
            train_s, metrics = self.elapsed(), None
            if self.done == self.first and self.prior_eval and self.prior_eval.get("num_molecules") == p.eval_samples:
                metrics = self.prior_eval               # a finished run resumed: its evaluation stands
            elif p.eval_samples > 0:
                self.ema_model.load_state_dict(fit["ema_state_dict"] or self.model.state_dict())
                metrics = evaluate_model(self.ema_model, self.histogram, p.eval_samples, self.seed)
        self.save(fit, metrics)
        return self._summary(metrics, skipped, train_s)

    def _summary(self, metrics: dict | None, skipped: int, train_s: float) -> dict:
        losses = [r for r in self.rows if "loss" in r]
        summary = {"out": str(self.out), "molecules": len(self.train), "steps": self.done,
                   "first_loss": losses[0]["loss"] if losses else None,
                   "final_loss": losses[-1]["loss"] if losses else None,
                   "skipped_steps": skipped, "train_s": round(train_s, 1),
                   "init_from": None if self.init_from is None else str(self.init_from),
                   "metrics": str(self.metrics_path), "loss_plot": str(self.png_path) if self.plots else None}
        curve = [r for r in self.rows if "atom_stability" in r]
        if curve:
            summary["stability_plot"] = str(self.curve_png) if self.plots else None
            summary["curve"] = curve
        if metrics is not None:
            summary["eval"] = metrics
        return summary
