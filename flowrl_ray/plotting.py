"""PNG learning curves: several runs overlaid, runs of one config (several seeds) as mean +- std."""

from __future__ import annotations

import itertools
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from flowrl_ray.metrics import read_metrics


def save_figure(fig, out: str | os.PathLike, **savefig_kwargs) -> Path:
    """Write a matplotlib figure as a PNG with a palette of 256 colours: a plot holds few colours,
    so it looks the same at a third of the size (committed results figures add up, and what a
    GPU machine takes in is bounded). Written whole through a temporary file and a rename."""
    import io

    from PIL import Image
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig_kwargs)
    buf.seek(0)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with Image.open(buf) as im:
            palette(im).save(tmp, format="PNG", optimize=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def palette(im):
    """``im`` (a PIL image) with 256 colours, no dithering (flat plot colours stay exact)."""
    from PIL import Image
    return im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)

def _label(run_dir: Path) -> str:
    """Runs are grouped by their config name; seeds of one config share a label."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        try:
            return json.loads(summary.read_text())["name"]
        except (KeyError, json.JSONDecodeError):
            pass
    config = run_dir / "config.yaml"
    if config.is_file():
        import yaml
        name = (yaml.safe_load(config.read_text()) or {}).get("name")
        if name:
            return name
    return run_dir.name


def curves(run_dirs: list[str | os.PathLike], x: str = "env_steps",
           y: str = "episode_return_mean") -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """label -> [(x values, y values) per run], skipping rows where y is missing."""
    out: dict[str, list] = defaultdict(list)
    for d in run_dirs:
        rows = [r for r in read_metrics(d) if r.get(y) is not None and r.get(x) is not None]
        if rows:
            out[_label(Path(d))].append((np.array([r[x] for r in rows], float),
                                         np.array([r[y] for r in rows], float)))
    return dict(out)


def mean_std_band(runs: list[tuple[np.ndarray, np.ndarray]], points: int = 200):
    """Interpolate every run onto a shared x grid (the range all runs cover); mean and std."""
    lo = max(r[0][0] for r in runs)
    hi = min(r[0][-1] for r in runs)
    grid = np.linspace(lo, hi, points) if hi > lo else np.array([lo])
    ys = np.stack([np.interp(grid, xs, ys) for xs, ys in runs])
    return grid, ys.mean(0), ys.std(0)


def plot_runs(run_dirs: list[str | os.PathLike], out_png: str | os.PathLike,
              x: str = "env_steps", y: str = "episode_return_mean", title: str | None = None) -> Path:
    data = curves(run_dirs, x, y)
    if not data:
        raise ValueError(f"no '{y}' values in {', '.join(str(d) for d in run_dirs)}")
    return plot_curves(data, out_png, x.replace("_", " "), y.replace("_", " "), title)


def plot_curves(data: dict[str, list[tuple[np.ndarray, np.ndarray]]], out_png: str | os.PathLike,
                xlabel: str = "env steps", ylabel: str = "episode return mean", title: str | None = None,
                xscale: str = "linear", markers: Sequence[tuple[str, float, float]] = ()) -> Path:
    """label -> runs [(x, y), ...]: one line per label, a mean +- std band where it has several;
    ``markers``: single points ``(label, x, y)`` drawn apart from the curves (figures quoted from
    elsewhere, e.g. a paper's final success at its budget); ``xscale``: matplotlib's ("log" for
    budgets that differ by orders of magnitude)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    # matplotlib's cycle has 10 colours: past 10 lines, 20 colours and a second line style, so
    # that no two lines look alike
    many = len(data) > 10
    for i, (label, runs) in enumerate(sorted(data.items())):
        style = dict(color=plt.get_cmap("tab20")(i % 20), ls=("-", "--")[i // 20 % 2]) if many else {}
        if len(runs) == 1:
            ax.plot(runs[0][0], runs[0][1], label=label, lw=1.6, **style)
        else:
            grid, mean, std = mean_std_band(runs)
            line, = ax.plot(grid, mean, label=f"{label} (n={len(runs)})", lw=1.6, **style)
            ax.fill_between(grid, mean - std, mean + std, color=line.get_color(), alpha=0.2 if not many else 0.1)
    for (label, x, y), style in zip(markers, itertools.cycle(("*", "D", "P", "X"))):
        ax.plot([x], [y], style, ms=10, color="black", label=label, ls="none")
    ax.set_xscale(xscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title or "learning curves")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8, ncol=2 if many else 1)
    fig.tight_layout()
    out = save_figure(fig, out_png)
    plt.close(fig)
    return out


def plot_credit_analysis(data: dict, out_dir: str | os.PathLike, iteration: int,
                         per_outcome: int = 4) -> list[Path]:
    """FlowSAR's analysis pictures from ``errors``, ``weights``, ``mask`` [E, H] and
    ``success`` [E]: per-step reconstruction-error bars (weights overlaid) for a few success
    and failure episodes, and the weight heatmap over episode steps. With ``grasped`` [E, H]
    (robot tasks) the key steps are marked: the first step that ends with the object in the
    gripper (grasp) and a successful episode's last step (success)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    errors, weights = np.asarray(data["errors"]), np.asarray(data["weights"])
    mask, success = np.asarray(data["mask"], bool), np.asarray(data["success"], bool)
    rows = [("success", np.flatnonzero(success)[:per_outcome]), ("failure", np.flatnonzero(~success)[:per_outcome])]
    cols = max(1, max(len(idx) for _, idx in rows))
    fig, axes = plt.subplots(2, cols, figsize=(3.2 * cols, 5.4), dpi=100, squeeze=False)
    for r, (name, idx) in enumerate(rows):
        for k in range(cols):
            ax = axes[r, k]
            if k >= len(idx):
                ax.axis("off")
                if k == 0:
                    ax.text(0.5, 0.5, f"no {name} episode in this batch", ha="center", va="center", fontsize=8)
                continue
            i = idx[k]
            steps = np.flatnonzero(mask[i])
            ax.bar(steps, errors[i, steps], color="tab:green" if name == "success" else "tab:red", alpha=0.7)
            ax.set_title(f"{name} episode {i}", fontsize=8)
            ax.set_xlabel("chunk step", fontsize=7)
            ax.set_ylabel("e", fontsize=7)
            if "grasped" in data:
                held = np.flatnonzero(np.asarray(data["grasped"], bool)[i] & mask[i])
                if held.size:
                    ax.axvline(held[0], color="tab:blue", ls="--", lw=1.0, label="grasp")
                if name == "success":
                    ax.axvline(steps[-1], color="tab:purple", ls=":", lw=1.2, label="success")
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=6, loc="upper left")
            twin = ax.twinx()
            twin.plot(steps, weights[i, steps], color="black", lw=1.0)
            twin.set_ylabel("w", fontsize=7)
            ax.tick_params(labelsize=6)
            twin.tick_params(labelsize=6)
    fig.suptitle(f"reconstruction error per step (bars) and credit weight (line), iteration {iteration}", fontsize=9)
    fig.tight_layout()
    bars = out_dir / "flowsar_errors.png"
    save_figure(fig, bars)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 0.35 * len(success) + 1.5), dpi=100)
    shown = np.where(mask, weights, np.nan)
    im = ax.imshow(shown, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(success)))
    ax.set_yticklabels(["S" if s else "F" for s in success], fontsize=7)
    ax.set_xlabel("chunk step of the episode")
    ax.set_ylabel("episode (S success, F failure)")
    ax.set_title(f"credit weights w, iteration {iteration}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    heat = out_dir / "flowsar_weights.png"
    save_figure(fig, heat)
    plt.close(fig)
    return [bars, heat]
