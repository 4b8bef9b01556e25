"""Seed-controlled comparison of configs: every config runs with the same N seeds on one Ray, then
one table (final return mean +- std, area under the learning curve, env steps, wall-clock) and
one overlaid plot with mean +- std bands."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from flowrl_ray.config import Config, load_config
from flowrl_ray.metrics import read_metrics


def learning_curve_area(rows: list[dict], key: str = "episode_return_mean") -> float | None:
    """Mean return over the run: trapezoid area under (env_steps, return) / env-step span."""
    pts = [(r["env_steps"], r[key]) for r in rows if r.get(key) is not None]
    if len(pts) < 2:
        return pts[0][1] if pts else None
    x, y = np.array(pts, dtype=float).T
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2) / (x[-1] - x[0]))


def _labels(cfgs: list[Config]) -> list[str]:
    """Config names, made unique when two configs share one."""
    labels = []
    for cfg in cfgs:
        label, n = cfg.name, 2
        while label in labels:
            label, n = f"{cfg.name}-{n}", n + 1
        labels.append(label)
    return labels


def run_comparison(config_paths: list[str], overrides: list[str], seeds: int,
                   out_dir: str | os.PathLike) -> list[dict]:
    from flowrl_ray.plotting import plot_runs
    from flowrl_ray.runtime.cluster import init_ray, required_cpus
    from flowrl_ray.runtime.trainer import Trainer

    cfgs = [load_config(p, overrides) for p in config_paths]      # every config valid before Ray starts
    labels = _labels(cfgs)
    out = Path(out_dir)
    biggest = max(cfgs, key=required_cpus)
    started = init_ray(biggest)
    total, done, table, run_dirs = len(cfgs) * seeds, 0, [], []
    try:
        for cfg, label in zip(cfgs, labels):
            finals, areas, steps, walls = [], [], [], []
            for i in range(seeds):
                run_cfg = dataclasses.replace(cfg, seed=cfg.seed + i, name=label)
                run_dir = out / label / f"seed{run_cfg.seed}"
                done += 1
                print(f"[compare] run {done}/{total}: {label} seed {run_cfg.seed}", flush=True)
                t0 = time.perf_counter()
                trainer = Trainer(run_cfg, run_dir)
                try:
                    trainer.setup()
                    summary = trainer.train()
                finally:
                    trainer.close()
                walls.append(time.perf_counter() - t0)
                finals.append(summary["final_episode_return_mean"])
                areas.append(learning_curve_area(read_metrics(run_dir)))
                steps.append(summary["env_steps"])
                run_dirs.append(run_dir)
            f = np.array([v for v in finals if v is not None], float)
            a = np.array([v for v in areas if v is not None], float)
            table.append({"config": label, "algorithm": cfg.algorithm, "env": cfg.env.id, "seeds": seeds,
                          "final_return_mean": float(f.mean()) if f.size else None,
                          "final_return_std": float(f.std()) if f.size else None,
                          "auc_mean": float(a.mean()) if a.size else None,
                          "auc_std": float(a.std()) if a.size else None,
                          "env_steps": int(np.mean(steps)), "wall_clock_s_mean": float(np.mean(walls))})
    finally:
        if started:
            import ray
            ray.shutdown()
    _write(table, out)
    plot_runs(run_dirs, out / "comparison.png", title=" vs ".join(labels))
    return table


def _fmt(mean, std) -> str:
    return "-" if mean is None else f"{mean:,.1f} ± {std:,.1f}"


def _write(table: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "comparison.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    lines = ["| config | algorithm | env | seeds | final return | area under curve | env steps | wall-clock (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['config']} | {r['algorithm']} | {r['env']} | {r['seeds']} | "
                     f"{_fmt(r['final_return_mean'], r['final_return_std'])} | {_fmt(r['auc_mean'], r['auc_std'])} | "
                     f"{r['env_steps']:,} | {r['wall_clock_s_mean']:.1f} |")
    (out / "comparison.md").write_text("\n".join(lines) + "\n")
    (out / "comparison.json").write_text(json.dumps(table, indent=2) + "\n")
    print("\n".join(lines), flush=True)
