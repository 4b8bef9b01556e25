"""How a fine-tuned flow policy's action distribution differs from its base's: is it broader,
shifted, or further from the demonstrations?

Run from the repository root (seconds per policy on 2 cores):

    .venv/bin/python benchmarks/flow_policy_spread.py --variant uniform-centred=runs/can30-unc-s0,runs/can30-unc-s1,runs/can30-unc-s2 \\
        --variant shuffled=runs/can30-uncshuf-s0,runs/can30-uncshuf-s1,runs/can30-uncshuf-s2 --output flowsar_policy_spread_can

Every policy (the runs' common base and each run's latest checkpoint) samples K action chunks at
the same N states, taken evenly from the base's demonstrations (``env.dataset``, normalised as the
env normalises them), from the same initial noise (one seeded draw shared by every policy, so
differences are the policies', not the noise's). Only the executed rows of a chunk
(``env.act_steps``) count. Per policy, in normalised action units ([-1, 1]):

- spread: the standard deviation over the K samples, averaged over states, rows and action dims;
  the gripper dim (the last) alone; and the spread in each quarter of a demo (by its progress
  t / T: reach, grasp, transport, place on a pick-and-place task);
- shift: the RMS difference between the policy's mean action and the base's (over the K samples),
  per state; and per action dim its signed mean over the states (a move every state shares, such
  as "close the gripper more");
- demo error: the RMS difference between the zero-noise action (the protocol's ``zero`` sampling)
  and the demonstration's own chunk.
- agreement (per variant): the mean cosine, over pairs of its seeds, between their shifts (each
  the policy's mean action minus the base's, flattened over the N states): near 0 when the
  seeds moved in unrelated directions (an update that is mostly noise), towards 1 when every
  seed moved the same way (a systematic direction); and between two variants, the mean cosine
  over every pair of a seed of one and a seed of the other (do they move the same way?).

Results: ``benchmarks/results/<output>.md/.json``. No assertion is made: this is a measurement.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS_DIR, command_line, git_revision, machine_info, md_table, pair_cosines,  # noqa: E402
                     write_json, write_results)
from _robot import base_policy, run_config  # noqa: E402
from robot_protocol import UsageError, parse_variant  # noqa: E402

QUARTERS = 4


def demo_states(cfg, n_states: int):
    """(obs [N, D], demo chunks [N, Ta, Da], progress [N] in [0, 1)) at N steps taken evenly from
    every step of every demo of ``cfg.env.dataset``."""
    import numpy as np

    from flowrl_ray.envs import env_family
    from flowrl_ray.envs.robot.robomimic_data import iter_demos
    from flowrl_ray.envs.robot import obs_keys
    from flowrl_ray.pretrain.flow_bc import chunk_dataset
    if cfg.env.obs_mode != "low_dim":
        raise SystemExit("flow_policy_spread: state (low_dim) policies only")
    norm = env_family(cfg.env.family).load_norm(cfg.env)
    obs, chunks = chunk_dataset(cfg.env.dataset, cfg.env, norm)
    lengths = [len(d["actions"]) for d in iter_demos(cfg.env.dataset, list(obs_keys(cfg.env.obs_mode)))]
    progress = np.concatenate([np.arange(t) / t for t in lengths])
    idx = np.linspace(0, len(obs) - 1, min(n_states, len(obs))).round().astype(int)
    return obs[idx], chunks[idx], progress[idx]


def measure(policy, obs, chunks, progress, eps, rows: int, base_mean=None) -> tuple[dict, object]:
    """The figures of one policy (see the module docstring) and its mean action [N, rows, Da]."""
    import numpy as np
    import torch
    n, k = eps.shape[:2]
    o = torch.as_tensor(obs)
    with torch.no_grad():
        a = policy.sample(o.repeat_interleave(k, 0), eps.flatten(0, 1)).view(n, k, *eps.shape[2:])[:, :, :rows]
        zero = policy.sample(o, torch.zeros(n, *eps.shape[2:]))[:, :rows]
    std = a.std(1, unbiased=False)                                  # [N, rows, Da]
    mean = a.mean(1)                                                # [N, rows, Da]
    demo = torch.as_tensor(chunks)[:, :rows]
    quarter = np.minimum((progress * QUARTERS).astype(int), QUARTERS - 1)
    out = {"spread": float(std.mean()), "spread_gripper": float(std[..., -1].mean()),
           "spread_by_quarter": [float(std[torch.as_tensor(quarter == q)].mean()) for q in range(QUARTERS)],
           "demo_error": float((zero - demo).pow(2).mean().sqrt())}
    if base_mean is not None:
        out["shift"] = float((mean - base_mean).pow(2).mean(dim=(1, 2)).sqrt().mean())
        out["shift_by_dim"] = (mean - base_mean).mean(dim=(0, 1)).tolist()      # signed, [Da]
    return out, mean


def seed_agreement(shifts: list) -> float | None:
    """The mean cosine over pairs of the seeds' shift vectors (None for one seed)."""
    pairs = pair_cosines(shifts)
    return sum(pairs) / len(pairs) if pairs else None


def cross_agreement(shifts_a: list, shifts_b: list) -> float:
    """The mean cosine over every (seed of A, seed of B) pair of shift vectors: whether two
    variants move the policy the same way."""
    n = len(shifts_a)
    pairs = pair_cosines(list(shifts_a) + list(shifts_b), [(i, n + j) for i in range(n) for j in range(len(shifts_b))])
    return sum(pairs) / len(pairs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=True, metavar="NAME=RUN,RUN,...",
                   help="a setting's finished run directories (one base for all variants)")
    p.add_argument("--states", type=int, default=2000, help="demo states N")
    p.add_argument("--samples", type=int, default=16, help="action chunks K per state")
    p.add_argument("--seed", type=int, default=0, help="seed of the shared initial noise")
    p.add_argument("--output", default="flow_policy_spread")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    import numpy as np
    import torch

    from flowrl_ray.runtime.policy import load_policy
    try:
        variants = dict(parse_variant(text) for text in args.variant)
    except UsageError as e:
        p.error(str(e))
    cfgs = {d: run_config(d) for dirs in variants.values() for d in dirs}
    bases = {c.algo.base_policy for c in cfgs.values()}
    if len(bases) != 1:
        p.error(f"the runs start from different bases ({sorted(bases)}); compare one base at a time")
    cfg = next(iter(cfgs.values()))
    obs, chunks, progress = demo_states(cfg, args.states)
    gen = torch.Generator().manual_seed(args.seed)
    base = base_policy(cfg)
    eps = torch.randn(len(obs), args.samples, *base.chunk_shape, generator=gen)
    rows = cfg.env.act_steps
    base_fig, base_mean = measure(base, obs, chunks, progress, eps, rows)
    base_fig["shift"] = 0.0
    results = {"base": {"path": cfg.algo.base_policy, **base_fig}, "variants": {}}
    agreement, all_shifts = {}, {}
    for name, dirs in variants.items():
        runs, shifts = [], []
        for d in dirs:
            fig, mean = measure(load_policy(d)[2], obs, chunks, progress, eps, rows, base_mean)
            runs.append({"run_dir": str(d), **fig})
            shifts.append((mean - base_mean).flatten())
        results["variants"][name] = runs
        agreement[name] = seed_agreement(shifts)
        all_shifts[name] = shifts
        print(f"[spread] {name}: done", flush=True)
    results["agreement"] = agreement
    names = list(variants)
    results["cross_agreement"] = {f"{a} | {b}": cross_agreement(all_shifts[a], all_shifts[b])
                                  for i, a in enumerate(names) for b in names[i + 1:]}

    keys = ["spread", "spread_gripper", "shift", "demo_error"]
    headers = ["policy", "seeds", "spread", "spread, gripper", "shift from the base", "demo error (zero noise)",
               "agreement of the seeds' shifts", *[f"spread, quarter {q + 1}" for q in range(QUARTERS)]]
    fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs) if len(xs) > 1 else f"{xs[0]:.3f}"   # noqa: E731
    rows_md = [["base", "–", *[f"{base_fig[k]:.3f}" for k in keys], "–",
                *[f"{x:.3f}" for x in base_fig["spread_by_quarter"]]]]
    for name, runs in results["variants"].items():
        rows_md.append([name, len(runs), *[f"{np.mean([r[k] for r in runs]):.3f} ({fmt([r[k] for r in runs])})" for k in keys],
                        agreement[name], *[f"{np.mean([r['spread_by_quarter'][q] for r in runs]):.3f}" for q in range(QUARTERS)]])
    n_dims = len(next(iter(results["variants"].values()))[0]["shift_by_dim"])
    def dim_cell(runs, i):
        xs = [r["shift_by_dim"][i] for r in runs]
        return f"{np.mean(xs):+.3f} (" + " / ".join(f"{x:+.3f}" for x in xs) + ")"
    dim_rows = [[name, *[dim_cell(runs, i) for i in range(n_dims)]] for name, runs in results["variants"].items()]
    dim_table = md_table(["policy", *[f"dim {i}" for i in range(n_dims)]], dim_rows)
    body = (f"## Results\n\n{len(obs)} demo states of `{cfg.env.dataset}`, {args.samples} chunks per state from one "
            f"shared noise draw (seed {args.seed}), the first {rows} rows of each chunk; normalised action units. "
            f"Each cell: the mean over seeds (per seed in brackets).\n\n{md_table(headers, rows_md)}\n\n"
            f"The shift's signed mean per action dim (robosuite's OSC_POSE: dims 0-2 position, 3-5 "
            f"rotation, 6 the gripper, +1 closed):\n\n{dim_table}\n")
    if results["cross_agreement"]:
        body += ("\nAgreement between variants (the mean cosine over every pair of a seed of one and a seed of "
                 "the other):\n\n" + md_table(["variants", "agreement"],
                                               [[k, f"{v:+.2f}"] for k, v in results["cross_agreement"].items()]) + "\n")
    results_dir = Path(args.results_dir)
    write_json(results_dir / f"{args.output}.json",
               {"revision": git_revision(), "command": command_line(), "machine": machine_info(),
                "states": len(obs), "samples": args.samples, "seed": args.seed, "rows": rows, **results})
    write_results(args.output, "Flow policy spread: base vs fine-tuned policies", body, results_dir=results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
