"""Is there a force or energy signal at the base? The policy gradient of FED-GRPO's surrogate at
the weights that generated (every ratio 1) on disjoint batches of groups, and how much two
batches' gradients agree (their cosine), for the run's advantages, for each reward's channel
alone and for the no-signal control (the same advantages permuted within each group).

    .venv/bin/python benchmarks/fed_grpo_gradient_agreement.py --batches 12
    .venv/bin/python benchmarks/fed_grpo_gradient_agreement.py --config configs/fed_grpo/qm9_mid_cpu.yaml
    .venv/bin/python benchmarks/fed_grpo_gradient_agreement.py --from-json FILE.json   # the report again

Each batch is one training iteration's groups (the config's ``sample_group_size`` atom counts x
``each_prompt_sample`` molecules, the shared prefix as configured), sampled from the base and
scored by the env's force field. Per batch, the gradient is taken over ``--steps`` of the
branched transitions spread evenly (the same for every variant) for:

- ``run``: the config's advantages (what a training run follows);
- ``force`` / ``energy``: one channel alone, normalised over each group's RDKit-valid members,
  0 for the invalid ones (the signal the targets ask for, without the validity penalty);
- ``validity``: RDKit validity (0/1) normalised within each group (what the penalty teaches);
- each with `` shuffled``: the same advantages permuted within every group (no signal).

If each molecule's gradient is a common direction plus independent noise, two batches of B
molecules agree with cosine c = B s / (1 + B s) in expectation, s the signal-to-noise ratio of
one molecule; the report turns the mean cosine into s and into the molecules an update needs for
c = 0.5 (B = 1 / s). Results: ``<results-dir>/<output>.{json,md}``: per variant the mean cosine
over all pairs of batches with a 95 % bootstrap interval over pairs (pairs share batches, so the
interval is optimistic) and the gradient norm. No assertion is made.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS_DIR, command_line, git_revision, machine_info, md_table,  # noqa: E402
                     pair_cosines, write_json, write_results)

CONFIG = "configs/fed_grpo/qm9_edm_small.yaml"
CHANNELS = ("run", "force", "energy", "validity")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--batches", type=int, default=12, help="disjoint batches (>= 2), one iteration's groups each")
    p.add_argument("--steps", type=int, default=16, help="branched transitions per gradient, spread evenly")
    p.add_argument("--seed", type=int, default=0, help="atom counts and diffusion noise")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-boot", type=int, default=10_000)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--output", default="fed_grpo_gradient_agreement")
    p.add_argument("--from-json", help="write the report again from a results JSON (no sampling)")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_args(argv)


def signal_to_noise(c: float, batch: int) -> float:
    """s of c = B s / (1 + B s): one molecule's squared mean gradient over its noise variance."""
    return c / (batch * (1.0 - c)) if 0.0 < c < 1.0 else float("nan")


def channel_advantages(p: dict, group_index, generator) -> dict:
    """name -> [B, K] advantages for one prepared batch: CHANNELS and each one's in-group shuffle."""
    import torch

    from flowrl_ray.algorithms.advantages import group_normalize
    s, run = p["scores"], p["advantages"]
    k = run.shape[1]
    scored = torch.isfinite(s["force_reward"])
    valid = scored & (s["valid"] == 1)

    def among_valid(r):
        return torch.where(valid, group_normalize(torch.nan_to_num(r), group_index, members=valid), 0.0)

    out = {"run": run,
           "force": among_valid(s["force_reward"])[:, None].expand(-1, k),
           "energy": among_valid(s["energy_reward"])[:, None].expand(-1, k),
           "validity": group_normalize(valid.double(), group_index)[:, None].expand(-1, k)}
    perm = torch.arange(len(group_index))
    for g in group_index.unique():                              # one permutation within each group
        rows = (group_index == g).nonzero().flatten()
        perm[rows] = rows[torch.randperm(len(rows), generator=generator)]
    for name in CHANNELS:
        out[f"{name} shuffled"] = out[name][perm]
    return out


def main(argv=None) -> dict:
    import numpy as np
    import torch

    from flowrl_ray.algorithms.fed_grpo import FEDGRPO
    from flowrl_ray.config import load_config
    from flowrl_ray.envs import env_family

    args = parse_args(argv)
    if args.from_json:                                    # the report again from saved results
        results = json.loads(Path(args.from_json).read_text())
        results["args"].update(results_dir=args.results_dir, output=args.output)
        report(results, args.n_boot)
        return results
    if args.batches < 2:
        raise SystemExit("--batches: at least 2 to compare")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [f"seed={args.seed}", *args.overrides])
    family = env_family(cfg.env.family)
    algo = FEDGRPO(cfg, family.spec(cfg.env), torch.device("cpu"))
    shuffler = torch.Generator().manual_seed(args.seed + 1)
    scorer = family.make_scorer(cfg.env, cfg.seed, 0)
    grads: dict[str, list] = {}
    batch_stats = []
    t0 = time.perf_counter()
    try:
        for b in range(args.batches):
            chunks = algo.generate(1, "train")
            p = algo.prepare([scorer.score(chunk) for chunk in chunks])
            k = p["advantages"].shape[1]
            steps = sorted({int(round(x)) for x in np.linspace(0, k - 1, args.steps)})
            advs = channel_advantages(p, algo.pending["group_index"], shuffler)
            for name, g in zip(advs, algo.policy_gradients(p, list(advs.values()), steps)):
                grads.setdefault(name, []).append(g)
            s = p["scores"]
            scored = torch.isfinite(s["rms_force"])
            batch_stats.append({"molecules": len(scored), "atoms": algo.pending["n_atoms"].unique().tolist(),
                                "validity": float(s["valid"].nan_to_num().mean()),
                                "rms_force_mean": float(s["rms_force"][scored].mean()) if scored.any() else None})
            print(f"[agreement] batch {b + 1}/{args.batches}: validity {batch_stats[-1]['validity']:.2f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        scorer.close()
    c = cfg.algo
    results = {"command": command_line(), "args": vars(args), "machine": machine_info(), "git": git_revision(),
               "setting": {"base_model": c.base_model, "groups": c.sample_group_size, "group_size": c.each_prompt_sample,
                           "shared_prefix_steps": c.shared_prefix_steps, "diffusion_steps": c.model.diffusion_steps},
               "transitions": k, "steps": steps, "batches": batch_stats,
               "seconds": round(time.perf_counter() - t0, 1), "variants": {}}
    pairs = list(itertools.combinations(range(args.batches), 2))
    for name, gs in grads.items():
        results["variants"][name] = {"pair_cosines": pair_cosines(gs, pairs),
                                     "norm_mean": float(np.mean([float(g.norm()) for g in gs]))}
    report(results, args.n_boot)
    return results


def report(results: dict, n_boot: int) -> None:
    """Each variant's mean cosine with its interval, what it says of one molecule's signal and of
    the molecules an update needs; ``<results-dir>/<output>.{json,md}``."""
    from flowrl_ray.stats import mean_interval
    args, setting = results["args"], results["setting"]
    molecules = results["batches"][0]["molecules"]
    for v in results["variants"].values():
        v["cosine"] = c = mean_interval(v["pair_cosines"], n_boot)
        v["signal_to_noise"] = signal_to_noise(c["mean"], molecules)
        # molecules for cosine 0.5 = 1 / s: at least 1 / s(upper bound); at most 1 / s(lower bound) when > 0
        v["molecules_for_cosine_half"] = {"at_least": 1.0 / signal_to_noise(c["ci_high"], molecules)
                                          if c["ci_high"] > 0 else None,
                                          "at_most": 1.0 / signal_to_noise(c["ci_low"], molecules)
                                          if c["ci_low"] > 0 else None}
    ci = lambda c: f"{c['mean']:+.4f} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}]"   # noqa: E731

    def need(v):
        lo, hi = v["molecules_for_cosine_half"]["at_least"], v["molecules_for_cosine_half"]["at_most"]
        if lo is None:
            return "no agreement"
        return f"{lo:,.0f}-{hi:,.0f}" if hi is not None else f">= {lo:,.0f}"
    rows = []
    for name in CHANNELS:
        v, sh = results["variants"][name], results["variants"][f"{name} shuffled"]
        rows.append([name, ci(v["cosine"]), ci(sh["cosine"]), f"{v['norm_mean']:.3g}", need(v)])
    body = (f"Base `{setting['base_model']}` (`{args['config']}`); {args['batches']} disjoint batches of "
            f"{setting['groups']} x {setting['group_size']} molecules ({molecules} a batch, the first "
            f"{setting['shared_prefix_steps']} of {setting['diffusion_steps']} steps shared in a group), scored by "
            f"the force field; gradients over {len(results['steps'])} of the {results['transitions']} branched "
            f"transitions; {len(results['variants']['run']['pair_cosines'])} pairs; {results['seconds']:.0f} s.\n\n"
            + md_table(["advantages", "cosine of two batches (mean [95 % CI over pairs])",
                        "the same, shuffled within groups", "gradient norm",
                        "molecules an update needs for cosine 0.5 (from the CI)"], rows)
            + "\n\nIf a molecule's gradient is a common direction plus independent noise (signal-to-noise s), two "
              "batches of B agree with cosine B s / (1 + B s), so cosine 0.5 needs B = 1 / s molecules; the last "
              "column turns the CI's bounds into bounds on B (no agreement: the CI's upper bound <= 0).\n\n"
              "Batch validity: " + ", ".join(f"{s['validity']:.2f}" for s in results["batches"]) + ".\n")
    results_dir = Path(args["results_dir"])
    write_results(args["output"], "FED-GRPO: do disjoint batches' gradients agree at the base?", body,
                  command=results["command"], results_dir=results_dir)
    write_json(results_dir / f"{args['output']}.json", results)


if __name__ == "__main__":
    main()
