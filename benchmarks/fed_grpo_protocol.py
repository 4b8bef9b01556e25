"""The molecule evaluation protocol: does FED-GRPO lower energy and force while keeping
stability? Several training seeds per variant, the base EDM and every final policy sampling the
same molecules in one process, the change of each metric with a 95 % paired bootstrap CI.

Run from the repository root (after `flowrl-ray pretrain configs/fed_grpo/qm9_small.yaml`):

    # launch the runs of one variant (one at a time), then evaluate them
    .venv/bin/python benchmarks/fed_grpo_protocol.py --config configs/fed_grpo/qm9_small.yaml \\
        --seeds 0 1 2 --name stability algo.stability_adv_weight=1.0 --output fed_grpo_stability
    # compare finished runs of several variants on the same molecules
    .venv/bin/python benchmarks/fed_grpo_protocol.py --variant none=runs/a,runs/b,runs/c \\
        --variant stability=runs/d,runs/e,runs/f --variant pbrs=runs/g,runs/h,runs/i --molecules 512

Launched runs are `flowrl-ray train CONFIG --run-dir runs/protocol-<variant>-s<seed>-<time>
seed=<seed> [overrides]` (the launcher of ``robot_protocol.py``).

Evaluation: the base (the runs' ``algo.base_model``) and each run's last checkpoint sample
``--molecules`` (>= 512 for a result) molecules with the same atom counts, initial noise and
reverse-step noise (``--eval-seed``): molecule m of a policy and molecule m of the base form a
pair. Every molecule is scored by the runs' own scorer settings (``env.kwargs``: GFN2-xTB by
default) in this process.

Reported (``<results-dir>/<output>.{json,md}``, ``<output>_molecules_<model>.png``,
``<output>_<metric>_curve.png``): per variant,
per metric, the base, each seed, and the mean change over seeds with a 95 % percentile-bootstrap
CI over molecules (:func:`flowrl_ray.stats.paired_bootstrap_gain`): formation energy per atom
(eV/atom) and RMS force (eV/Å) on the molecules that the force field scored for the base and
for every seed of the variant (their count is reported: a policy that makes more molecules
unscorable shows in the scoring outcomes, not in these means); atom stability, molecule
stability and RDKit validity (points) and under- / over-bonded atoms per molecule on all of
them; the scoring outcomes (reasons) per model; training wall-clock per run; the runs' periodic
evaluation (RMS force, formation energy, atom stability, validity against molecules trained, mean
+- std over seeds). The pictures: the first molecules of the base and of each variant's first
seed, marked stable/valid.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import md_table, write_results  # noqa: E402
from _robot import run_config  # noqa: E402
from robot_protocol import (LEVEL, UsageError, add_shared_arguments, check_launch_args, collect_one_base,  # noqa: E402
                            launch_variants, log, metric_curve, parse_args, plot_run_curves, results_record,
                            write_outputs)

MIN_MOLECULES = 512
#: (key, label, unit, scale): physics on the molecules the force field scored, the rest on all
PHYSICS = (("formation_energy_per_atom_eV", "formation energy", "eV/atom", 1.0),
           ("rms_force", "RMS force", "eV/Å", 1.0))
CHEMISTRY = (("stable_atom_fraction", "atom stability", "points", 100.0),
             ("stable", "molecule stability", "points", 100.0),
             ("valid", "validity", "points", 100.0),
             ("under_bonded", "under-bonded atoms / molecule", "atoms", 1.0),
             ("over_bonded", "over-bonded atoms / molecule", "atoms", 1.0))
PICTURES = 12


# --------------------------------------------------------------------------- evaluation

def load_models(run_dir: Path):
    """(the run's config, the base EDM, the run's last EDM, the base's atom-count histogram)."""
    import torch

    from flowrl_ray.models.edm import load_base_model
    from flowrl_ray.checkpoint import latest_checkpoint, load_checkpoint
    from flowrl_ray.models.edm import EDM
    cfg = run_config(run_dir)
    base_ckpt = load_base_model(cfg.algo.base_model)
    base, tuned = EDM(cfg.algo.model), EDM(cfg.algo.model)
    base.load_state_dict(base_ckpt["state_dict"])
    tuned.load_state_dict(load_checkpoint(latest_checkpoint(run_dir))["learner"]["algorithm"]["model"])
    return cfg, base, tuned, base_ckpt["node_histogram"]


def evaluate_model(model, histogram, cfg, molecules: int, seed: int, label: str) -> dict:
    """``molecules`` paired samples of ``model`` scored by ``cfg``'s scorer -> per molecule: the
    PHYSICS and CHEMISTRY keys (float lists, NaN where the force field failed), ``reason``,
    ``n_atoms``, and ``pictures`` (snapshot items of the first PICTURES)."""
    import numpy as np

    from flowrl_ray.envs import env_family
    from flowrl_ray.pretrain.edm_qm9 import sample_molecules
    t0 = time.perf_counter()
    mols = sample_molecules(model, histogram, molecules, seed=seed)
    scorer = env_family(cfg.env.family).make_scorer(cfg.env, cfg.seed, 0)
    try:
        b = scorer.score({"ids": np.arange(len(mols)), "positions": [m[0] for m in mols],
                          "atom_types": [m[1] for m in mols]}, snapshots=PICTURES)
    finally:
        scorer.close()
    out = {k: [float(x) for x in np.asarray(b[k], dtype=np.float64)] for k, *_ in PHYSICS + CHEMISTRY}
    out.update(reason=[str(r) for r in b["reason"]], n_atoms=[len(t) for _, t in mols],
               pictures=b.meta.extra.get("snapshots", []), seconds=round(time.perf_counter() - t0, 1))
    scored = np.isfinite(out["rms_force"])
    log(f"evaluated {label}: {scored.sum()}/{len(mols)} scored, atom stability "
        f"{np.mean(out['stable_atom_fraction']):.3f}, validity {np.mean(out['valid']):.3f}, {out['seconds']:.0f} s")
    return out


def summarise(base: dict, runs: list[dict], n_boot: int) -> dict:
    """Per metric: base, per seed, mean, and the paired change (mean over seeds of policy - base)
    with its CI, in the metric's reported unit; physics on the molecules scored for all."""
    import numpy as np

    from flowrl_ray.stats import paired_bootstrap_gain
    both = np.isfinite(base["rms_force"]) & np.all([np.isfinite(r["outcomes"]["rms_force"]) for r in runs], axis=0)
    out = {"molecules": len(base["rms_force"]), "scored_by_all": int(both.sum())}
    for key, label, unit, scale in PHYSICS + CHEMISTRY:
        rows = both if (key, label, unit, scale) in PHYSICS else np.ones(len(both), bool)
        if not rows.any():
            out[key] = None
            continue
        b = scale * np.asarray(base[key])[rows]
        per_seed = [scale * np.asarray(r["outcomes"][key])[rows] for r in runs]
        out[key] = {"label": label, "unit": unit, "n": int(rows.sum()), "base": float(b.mean()),
                    "per_seed": [float(x.mean()) for x in per_seed], "mean": float(np.mean([x.mean() for x in per_seed])),
                    "change": paired_bootstrap_gain(per_seed, b, n_boot=n_boot, level=LEVEL)}
    return out


def reasons(outcomes: dict) -> dict[str, float]:
    from collections import Counter
    n = len(outcomes["reason"])
    return {k: v / n for k, v in sorted(Counter(outcomes["reason"]).items())}


#: the runs' periodic evaluation (eval.episodes molecules, eval.interval) drawn against molecules trained:
#: (metrics key, curve name, y label, scale)
CURVES = (("eval/rms_force_eV_per_A", "force_curve", "RMS force (eV/Å)", 1.0),
          ("eval/energy_per_atom_eV", "energy_curve", "formation energy (eV/atom)", 1.0),
          ("eval/atom_stability", "atom_stability_curve", "atom stability (%)", 100.0),
          ("eval/validity", "validity_curve", "RDKit validity (%)", 100.0))


def run_info(run_dir: Path) -> dict:
    """The run's length, training wall-clock and its periodic evaluation curves (CURVES)."""
    from flowrl_ray.metrics import read_metrics
    rows = read_metrics(run_dir)
    last = rows[-1] if rows else {}
    return {"iterations": last.get("iteration"), "molecules_trained": last.get("env_steps"), "time_s": last.get("time_s"),
            **{name: metric_curve(rows, key, scale=scale) for key, name, _, scale in CURVES}}


# --------------------------------------------------------------------------- output

def pictures(items: list[dict], results_dir: Path, output: str, label: str) -> str | None:
    from flowrl_ray.envs.molecules.snapshots import grid_png
    if not items:
        return None
    path = results_dir / f"{output}_molecules_{label}.png"
    path.write_bytes(grid_png(items))
    return str(path)


def plot(variants: dict, results_dir: Path, output: str) -> list[str]:
    written = [plot_run_curves(variants, name, results_dir / f"{output}_{name}.png", "molecules trained", label,
                               f"FED-GRPO periodic evaluation ({label.split(' (')[0]})")
               for _, name, label, _ in CURVES]
    return [w for w in written if w]


def report(results: dict, results_dir: Path, output: str) -> None:
    rows, runs, outcome_rows = [], [], []
    for name, v in results["variants"].items():
        s = v["summary"]
        for key, *_ in PHYSICS + CHEMISTRY:
            e = s.get(key)
            if e is None:
                continue
            c = e["change"]
            rows.append([name, e["label"], e["unit"], e["n"], f"{e['base']:.3f}", ", ".join(f"{x:.3f}" for x in e["per_seed"]),
                         f"{e['mean']:.3f}", f"{c['gain']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]"])
        for r in v["runs"]:
            t = "-" if r["time_s"] is None else f"{r['time_s'] / 60:.1f} min"
            runs.append([name, r["seed"], r["run_dir"], r["iterations"], r["molecules_trained"], t])
            outcome_rows.append([f"{name} seed {r['seed']}", ", ".join(f"{k} {100 * x:.1f} %" for k, x in r["reasons"].items())])
    outcome_rows.insert(0, ["base", ", ".join(f"{k} {100 * x:.1f} %" for k, x in results["base"]["reasons"].items())])
    p = results["protocol"]
    body = (f"Protocol: the base EDM and every final policy sample the same {p['molecules']} molecules (same atom "
            f"counts and noise, evaluation seed {p['eval_seed']}) in one process, scored by the runs' scorer; "
            f"change = mean over seeds of (policy - base) with a {100 * LEVEL:.0f} % percentile bootstrap CI over "
            f"molecules ({p['n_boot']:,} resamples, paired by molecule). Energy and force: on the molecules the "
            f"force field scored for the base and every seed of the variant (n); the rest on all."
            + (f"\n\n{results['note']}" if results.get("note") else "") + "\n\n"
            + md_table(["variant", "metric", "unit", "n", "base", "per seed", "mean", "change [95 % CI]"], rows)
            + "\n\nScoring outcomes:\n\n" + md_table(["model", "fractions"], outcome_rows)
            + "\n\nRuns:\n\n" + md_table(["variant", "seed", "run", "iterations", "molecules trained", "training"], runs)
            + "\n\nPictures: " + ", ".join(f"`{Path(x).name}`" for x in results["pictures"] if x)
            + "\n\nCurves (the runs' periodic evaluation, mean +- std over seeds): "
            + (", ".join(f"`{Path(x).name}`" for x in results["plots"]) or "none")
            + f"\n\nEvaluation time: {results['eval_time_s'] / 60:.1f} min.\n")
    write_results(output, "Molecule evaluation protocol (FED-GRPO)", body, results_dir=results_dir)


# --------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_arguments(p, "fed_grpo_protocol")
    p.add_argument("--molecules", type=int, default=MIN_MOLECULES, help=f"paired samples (>= {MIN_MOLECULES} for a result)")
    p.add_argument("--eval-seed", type=int, default=1234, help="the evaluation's sampling seed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    from flowrl_ray.config import ConfigError
    try:
        check_launch_args(args)
        if args.molecules < 1:
            raise UsageError(f"--molecules must be >= 1, got {args.molecules}")
        variants, cfg, name = collect_one_base(args, "fed_grpo", "molecule", "algo.base_model", Path.is_file)
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    launch_variants(args, cfg, name, variants)
    if args.molecules < MIN_MOLECULES:
        log(f"{args.molecules} molecules; a protocol result needs >= {MIN_MOLECULES}")

    import torch
    t0 = time.perf_counter()
    first = next(iter(variants.values()))[0]
    base_cfg, base_model, _, histogram = load_models(first)
    torch.set_num_threads(base_cfg.runtime.torch_threads)
    base = evaluate_model(base_model, histogram, base_cfg, args.molecules, args.eval_seed, "the base EDM")
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    pics = [pictures(base["pictures"], results_dir, args.output, "base")]
    evaluated = {}
    for name, dirs in variants.items():
        runs = []
        for i, d in enumerate(dirs):
            rc, _, tuned, _ = load_models(d)
            outcomes = evaluate_model(tuned, histogram, rc, args.molecules, args.eval_seed, f"{name} seed {rc.seed}")
            if outcomes["n_atoms"] != base["n_atoms"]:
                print(f"error: {d} sampled other atom counts than the base (another histogram?)", file=sys.stderr)
                return 2
            if i == 0:
                pics.append(pictures(outcomes["pictures"], results_dir, args.output, name))
            runs.append({"run_dir": str(d), "seed": rc.seed, "reasons": reasons(outcomes),
                         "outcomes": {k: v for k, v in outcomes.items() if k != "pictures"}, **run_info(d)})
        evaluated[name] = {"runs": runs, "summary": summarise(base, runs, args.n_boot)}
    results = results_record(
        args, cfg, {"molecules": args.molecules, "eval_seed": args.eval_seed,
                    "change": "mean over seeds of (policy - base), CI: percentile bootstrap over molecules, paired"},
        base={"base_model": base_cfg.algo.base_model, "reasons": reasons(base),
              "outcomes": {k: v for k, v in base.items() if k != "pictures"}},
        variants=evaluated, pictures=pics, eval_time_s=round(time.perf_counter() - t0, 1))
    return write_outputs(results, args, plot, report)


if __name__ == "__main__":
    sys.exit(main())
