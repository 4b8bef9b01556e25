"""Is there a learning signal at the base? The policy gradient of Flow-GRPO's surrogate at the
weights that generated (every ratio 1) on disjoint batches of training prompts, and how much two
batches' gradients agree (their cosine), with the real advantages and with the no-signal control
(outcomes permuted within each group), for the sequence and the line advantages.

    .venv/bin/python benchmarks/flow_grpo_gradient_agreement.py --batches 6 --steps 16
    .venv/bin/python benchmarks/flow_grpo_gradient_agreement.py algo.sft_checkpoint=DIR

Each batch is ``--prompts`` training tasks (none shared with another batch) x the config's group
size, sampled at the config's temperature and sampler, scored in headless Chromium by the env's
reward. Per batch and variant the gradient is taken over ``--steps`` unmasking steps spread
evenly over the trajectory (the same steps for every variant). Gradients that point the same way
on different prompts (cosine > 0 beyond the control's) are a signal an update can follow; the
control's cosines show what agreement an update of the same size has without it.

Results: ``<results-dir>/<output>.{json,md}``: per variant the mean cosine over all pairs of
batches with a 95 % bootstrap interval over pairs (pairs share batches, so the interval is
optimistic), the gradient norms, and the cosine between the sequence and line gradients of the
same batch. No assertion is made.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS_DIR, command_line, git_revision, machine_info, md_table,  # noqa: E402
                     pair_cosines, write_json, write_results)

CONFIG = "configs/flow_grpo/forms_small.yaml"
VARIANTS = (("sequence", False), ("sequence", True), ("line", False), ("line", True))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--batches", type=int, default=6, help="disjoint batches (>= 2)")
    p.add_argument("--prompts", type=int, default=2, help="prompts per batch (x the group size)")
    p.add_argument("--steps", type=int, default=16, help="unmasking steps per gradient, spread evenly")
    p.add_argument("--same-prompts", action="store_true",
                   help="batches 2i and 2i+1 share their prompts (independent samples of the same tasks): "
                        "their cosine is reported apart from the pairs of different prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-boot", type=int, default=10_000)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--output", default="flow_grpo_gradient_agreement")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    import numpy as np
    import torch

    from flowrl_ray.algorithms.flow_grpo import FlowGRPO
    from flowrl_ray.config import load_config
    from flowrl_ray.envs import env_family
    from flowrl_ray.stats import mean_interval

    args = parse_args(argv)
    if args.batches < 2:
        raise SystemExit("--batches: at least 2 to compare")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, args.overrides)
    family = env_family(cfg.env.family)
    algo = FlowGRPO(cfg, family.spec(cfg.env), torch.device("cpu"))
    rng = np.random.default_rng(args.seed)
    picks = rng.choice(len(algo.train_tasks), size=args.batches * args.prompts, replace=False)
    if args.same_prompts:                                # batch 2i+1 takes batch 2i's prompts
        picks = picks.reshape(args.batches, args.prompts)
        picks[1::2] = picks[0::2][:len(picks[1::2])]
        picks = picks.reshape(-1)
    steps = sorted({int(round(x)) for x in np.linspace(0, algo.c.num_generation_steps - 1, args.steps)})
    scorer = family.make_scorer(cfg.env, cfg.seed, 0)
    grads: dict[str, list] = {f"{a}{' shuffled' if sh else ''}": [] for a, sh in VARIANTS}
    batch_stats = []
    t0 = time.perf_counter()
    try:
        for b in range(args.batches):
            tasks = [algo.train_tasks[i] for i in picks[b * args.prompts:(b + 1) * args.prompts]]
            chunks = algo.generate(1, "train", tasks=tasks)
            scored = [scorer.score(chunk) for chunk in chunks]
            for advantage, shuffle in VARIANTS:
                algo.c.advantage, algo.c.advantage_shuffle = advantage, shuffle
                algo.c.ratio = "token" if advantage == "line" else algo.c.ratio
                p = algo.prepare(scored)
                grads[f"{advantage}{' shuffled' if shuffle else ''}"].append(algo.policy_gradient(p, steps))
            rewards = p["rewards"]
            batch_stats.append({"tasks": [t.task_id for t in tasks], "reward_mean": float(rewards.mean()),
                                "field_accuracy": float(p["field_accuracy"].mean())})
            print(f"[agreement] batch {b + 1}/{args.batches}: reward {float(rewards.mean()):.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        scorer.close()
    results = {"command": command_line(), "args": vars(args), "machine": machine_info(), "git": git_revision(),
               "steps": steps, "batches": batch_stats, "seconds": round(time.perf_counter() - t0, 1), "variants": {}}
    pairs = list(itertools.combinations(range(args.batches), 2))
    same = [(i, j) for i, j in pairs if args.same_prompts and i % 2 == 0 and j == i + 1]
    pairs = [pair for pair in pairs if pair not in same]            # different prompts
    for name, gs in grads.items():
        cos = pair_cosines(gs, pairs)
        results["variants"][name] = {"cosine": mean_interval(cos, args.n_boot), "pair_cosines": cos,
                                     "norm_mean": float(np.mean([float(g.norm()) for g in gs]))}
        if same:
            results["variants"][name]["same_prompts"] = mean_interval(pair_cosines(gs, same),
                                                                      args.n_boot)
    results["sequence_vs_line"] = mean_interval(pair_cosines(grads["sequence"] + grads["line"],
                                                           [(i, args.batches + i) for i in range(args.batches)]),
                                          args.n_boot)
    ci = lambda c: f"{c['mean']:+.4f} [{c['ci_low']:+.4f}, {c['ci_high']:+.4f}] (n={c['n']})"   # noqa: E731
    rows = [[name, ci(v["cosine"]), ci(v["same_prompts"]) if same else "-", f"{v['norm_mean']:.3g}"]
            for name, v in results["variants"].items()]
    svl = results["sequence_vs_line"]
    body = (f"Checkpoint `{cfg.algo.sft_checkpoint}`; {args.batches} disjoint batches of {args.prompts} training "
            f"prompts x {cfg.algo.group_size} rollouts (temperature {cfg.algo.generation_temperature}, sampler "
            f"{cfg.algo.sampler}), scored in Chromium; gradients over {len(steps)} of "
            f"{cfg.algo.num_generation_steps} unmasking steps; {len(pairs)} pairs of different prompts, {len(same)} of the same; {results['seconds']:.0f} s.\n\n"
            + md_table(["advantages", "cosine, different prompts (mean [95 % CI over pairs])",
                        "cosine, the same prompts", "gradient norm"], rows)
            + f"\n\nCosine between the sequence and the line gradient of the same batch: {svl['mean']:+.3f} "
              f"[{svl['ci_low']:+.3f}, {svl['ci_high']:+.3f}].\n\nBatch rewards: "
            + ", ".join(f"{s['reward_mean']:.3f}" for s in batch_stats) + ".\n")
    write_results(args.output, "Flow-GRPO: do disjoint batches' gradients agree at the base?", body,
                  results_dir=Path(args.results_dir))
    write_json(Path(args.results_dir) / f"{args.output}.json", results)
    return results


if __name__ == "__main__":
    main()
