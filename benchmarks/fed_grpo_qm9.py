"""FED-GRPO on QM9 on this machine: the EDM before and after post-training at a fixed budget.

Run from the repository root:

    .venv/bin/python benchmarks/fed_grpo_qm9.py                            # base (made if missing) + one run
    .venv/bin/python benchmarks/fed_grpo_qm9.py --iterations 20 --eval-molecules 256
    .venv/bin/python benchmarks/fed_grpo_qm9.py --runs runs/fed-grpo-qm9-small   # a finished run
    .venv/bin/python benchmarks/fed_grpo_qm9.py --bases pretrained/edm_qm9_small.pt \
        pretrained/qm9_small_edm.pt pretrained/qm9_mid_edm.pt --eval-molecules 512 --output edm_import_qm9_small

Steps: the base EDM (`flowrl-ray pretrain configs/fed_grpo/qm9_small.yaml`, made if missing), one
`flowrl-ray train` run of the config for `--iterations` iterations, then the base model and the
run's last checkpoint each sample the same `--eval-molecules` molecules (same atom counts, same
initial noise and reverse-step noise: a paired comparison) in this process, scored by the same
GFN2-xTB scorer the run used: formation energy per atom, RMS force, atom and molecule
stability, RDKit validity and uniqueness (ELIGN's claim: lower energies and forces with
stability kept). Results: ``benchmarks/results/fed_grpo_qm9.{md,json}``. No assertion is made.

``--bases CKPT ...`` measures base checkpoints instead, no training: each (a `flowrl-ray pretrain`
or `flowrl-ray import-edm` output, with its own architecture) samples ``--eval-molecules``
molecules with the same atom counts when the histograms agree (seed ``--seed``), reported with
EDM's sample metrics (atom stability over all atoms, molecule stability, RDKit validity,
uniqueness among the valid) and the config's scorer (formation energy, RMS force, outcomes);
results: ``benchmarks/results/<--output>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (REPO_ROOT, RESULTS_DIR, git_revision, md_table,  # noqa: E402
                     write_json, write_results)

CONFIG = "configs/fed_grpo/qm9_small.yaml"
FLOWRL = [sys.executable, "-m", "flowrl_ray.cli"]
METRICS = [("energy_per_atom_eV", "formation energy (eV/atom)"), ("rms_force_eV_per_A", "RMS force (eV/Å)"),
           ("atom_stability", "atom stability"), ("molecule_stability", "molecule stability"),
           ("validity", "validity"), ("uniqueness", "uniqueness"), ("force_reward_mean", "force reward"),
           ("energy_reward_mean", "energy reward")]


def score(cfg, molecules: list) -> dict:
    """The family's scorer on (positions, types) pairs -> fed_grpo.molecule_summary."""
    import numpy as np
    from flowrl_ray.algorithms.fed_grpo import molecule_summary, scores_of
    from flowrl_ray.envs import env_family
    scorer = env_family(cfg.env.family).make_scorer(cfg.env, cfg.seed, 0)
    try:
        b = scorer.score({"ids": np.arange(len(molecules)), "positions": [m[0] for m in molecules],
                          "atom_types": [m[1] for m in molecules]})
    finally:
        scorer.close()
    return molecule_summary(scores_of(b))


def models(cfg, run_dir: Path):
    """(base EDM, post-trained EDM, atom-count histogram)."""
    import torch
    from flowrl_ray.models.edm import load_base_model
    from flowrl_ray.checkpoint import latest_checkpoint, load_checkpoint
    from flowrl_ray.models.edm import EDM
    base_ckpt = load_base_model(cfg.algo.base_model)
    base, tuned = EDM(cfg.algo.model), EDM(cfg.algo.model)
    base.load_state_dict(base_ckpt["state_dict"])
    state = load_checkpoint(latest_checkpoint(run_dir))
    tuned.load_state_dict(state["learner"]["algorithm"]["model"])
    torch.set_num_threads(cfg.runtime.torch_threads)
    return base, tuned, base_ckpt["node_histogram"], state["trainer"]["iteration"]


#: (key, label, cell): fractions as percentages, energy and force as numbers
BASE_METRICS = [("atom_stability", "atom stability (EDM: stable atoms / atoms)", "{:.1%}"),
                ("molecule_stability", "molecule stability", "{:.1%}"), ("validity", "RDKit validity", "{:.1%}"),
                ("edm_validity", "validity by EDM's own check (its bond table; radicals pass)", "{:.1%}"),
                ("uniqueness", "uniqueness (among the valid)", "{:.1%}"),
                ("valid_and_unique", "valid and unique", "{:.1%}"),
                ("energy_per_atom_eV", "formation energy (eV/atom, scored)", "{:.3f}"),
                ("rms_force_eV_per_A", "RMS force (eV/Å, scored)", "{:.2f}")]


def measure_bases(cfg, paths: list[str], molecules: int, seed: int, output: str) -> None:
    """``--bases``: each checkpoint's own EDM samples ``molecules`` molecules (seed ``seed``), EDM's
    metrics and the scorer's; results ``benchmarks/results/<output>.{json,md}``."""
    import numpy as np
    import torch
    from flowrl_ray.envs.molecules.chemistry import molecule_metrics
    from flowrl_ray.models.edm import load_base_model, model_of_base
    from flowrl_ray.pretrain.edm_qm9 import sample_molecules
    torch.set_num_threads(cfg.runtime.torch_threads)
    rows, histograms = [], []
    for path in paths:
        ckpt = load_base_model(path)
        model = model_of_base(ckpt)
        histograms.append(np.asarray(ckpt["node_histogram"], dtype=np.float64))
        start = time.perf_counter()
        mols = sample_molecules(model, histograms[-1], molecules, seed=seed)
        sample_s = time.perf_counter() - start
        row = {"base": path, "source": ckpt.get("source"), "model": ckpt["model_config"],
               "parameters": sum(v.numel() for v in ckpt["state_dict"].values()), "molecules": molecules,
               "sample_s": round(sample_s, 1), **molecule_metrics(mols)}
        scored = score(cfg, mols)
        row.update({k: v for k, v in scored.items() if k in ("energy_per_atom_eV", "rms_force_eV_per_A")
                    or k.startswith("reason/")})
        row["score_s"] = round(time.perf_counter() - start - sample_s, 1)
        print(f"[bench] {path}: {json.dumps({k: v for k, v in row.items() if k != 'model'})}", flush=True)
        rows.append(row)
    same_counts = all(np.array_equal(h, histograms[0]) for h in histograms)
    write_json(RESULTS_DIR / f"{output}.json", {"config": cfg.name, "seed": seed, "git": git_revision(),
                                                "same_atom_counts": same_counts, "bases": rows})
    arch = [f"{r['model']['num_layers']} x {r['model']['hidden_size']}, T = {r['model']['diffusion_steps']}"
            f"{', charges' if r['model'].get('include_charges') else ''}" for r in rows]
    body = [f"{molecules} molecules per base (sampling seed {seed}; atom counts "
            f"{'the same for every base' if same_counts else 'from each base its own histogram'}), EDM's sample "
            f"metrics, and formation energy and RMS force from the scorer of `{cfg.name}` (GFN2-xTB unless its "
            f"env.kwargs say otherwise) on the molecules it could score.", "",
            md_table(["metric"] + [f"`{Path(r['base']).name}`" for r in rows],
                     [["architecture"] + arch, ["parameters"] + [f"{r['parameters']:,}" for r in rows]]
                     + [[label] + [None if r.get(k) is None else cell.format(r[k]) for r in rows]
                        for k, label, cell in BASE_METRICS]
                     + [["sampling + scoring (s)"] + [f"{r['sample_s']} + {r['score_s']}" for r in rows]]), ""]
    reasons = sorted({k for r in rows for k in r if k.startswith("reason/")})
    body += [md_table(["scoring outcome (fraction)"] + [f"`{Path(r['base']).name}`" for r in rows],
                      [[k[len("reason/"):]] + [f"{r.get(k, 0.0):.1%}" for r in rows] for k in reasons]), ""]
    write_results(output, "Base EDMs on QM9: samples of each base", "\n".join(body))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--runs", nargs="*", help="compare these finished run directories instead of training")
    p.add_argument("--bases", nargs="+", metavar="CKPT",
                   help="measure these base checkpoints instead (no training): EDM's metrics and the config's scorer")
    p.add_argument("--output", help="results name under benchmarks/results/ (default fed_grpo_qm9; --bases: edm_bases)")
    p.add_argument("--eval-molecules", type=int, default=256)
    p.add_argument("--pretrain-steps", type=int, default=4000)
    p.add_argument("--seed", type=int, default=1234, help="the evaluation's sampling seed")
    p.add_argument("overrides", nargs="*", help="config overrides for the training run")
    args = p.parse_args()
    os.chdir(REPO_ROOT)
    from flowrl_ray.config import load_config
    from flowrl_ray.pretrain.edm_qm9 import sample_molecules
    cfg = load_config(args.config, args.overrides)
    if args.bases:
        missing = [b for b in args.bases if not Path(b).is_file()]
        if missing:
            p.error(f"--bases: no such file {missing[0]}")
        measure_bases(cfg, args.bases, args.eval_molecules, args.seed, args.output or "edm_bases")
        return
    if not Path(cfg.algo.base_model).is_file():
        subprocess.run(FLOWRL + ["pretrain", args.config, "--steps", str(args.pretrain_steps), "--lr", "3e-4",
                                 "--eval-samples", "200"], check=True)
    runs = [Path(r) for r in args.runs] if args.runs else []
    if not runs:
        run = Path("runs") / f"fed-grpo-bench-{time.strftime('%Y%m%d-%H%M%S')}"
        start = time.perf_counter()
        subprocess.run(FLOWRL + ["train", args.config, "--run-dir", str(run), f"train.iterations={args.iterations}",
                                 *args.overrides], check=True)
        print(f"[bench] training took {time.perf_counter() - start:.0f} s", flush=True)
        runs = [run]
    results = []
    for run in runs:
        base, tuned, histogram, iterations = models(cfg, run)
        row = {"run": str(run), "iterations": iterations, "molecules": args.eval_molecules}
        for name, model in (("base", base), ("fed_grpo", tuned)):
            start = time.perf_counter()
            mols = sample_molecules(model, histogram, args.eval_molecules, seed=args.seed)
            row[name] = score(cfg, mols)
            row[name]["eval_s"] = round(time.perf_counter() - start, 1)
            print(f"[bench] {run} {name}: {json.dumps(row[name])}", flush=True)
        metrics_rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        row["train_time_s"] = metrics_rows[-1].get("time_s")
        row["molecules_trained"] = metrics_rows[-1].get("env_steps")
        results.append(row)
    output = args.output or "fed_grpo_qm9"
    write_json(RESULTS_DIR / f"{output}.json", {"config": args.config, "overrides": args.overrides,
                                                   "git": git_revision(), "results": results})
    body = ["## Before vs after (paired samples: same atom counts and noise)", ""]
    for row in results:
        body += [f"Run `{row['run']}`: {row['iterations']} iterations, {row['molecules_trained']} molecules "
                 f"sampled and scored in training, {row['train_time_s']} s; {row['molecules']} molecules per model.", "",
                 md_table(["metric", "base EDM", "after FED-GRPO"],
                          [[label, row["base"].get(k), row["fed_grpo"].get(k)] for k, label in METRICS]), ""]
        reasons = sorted({k for m in ("base", "fed_grpo") for k in row[m] if k.startswith("reason/")})
        body += [md_table(["scoring outcome (fraction)", "base EDM", "after FED-GRPO"],
                          [[k[len("reason/"):], row["base"].get(k, 0.0), row["fed_grpo"].get(k, 0.0)] for k in reasons]), ""]
    write_results(output, "FED-GRPO on QM9: the EDM before and after post-training", "\n".join(body))


if __name__ == "__main__":
    main()
