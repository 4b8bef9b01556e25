"""Flow-GRPO update time with and without step subsampling (``algo.timestep_fraction``).

One batch is generated once (the config's prompts x group size, its unmasking steps); then the
update is timed on that same batch, from the same weights, optimiser state and update-generator
state, at each fraction (default 1.0 and 0.5), the fractions interleaved repeat by repeat. The
rewards are seeded random numbers, not browser episodes: the update's cost does not depend on
their values, and the browser is left out of the timing. Everything else is the config's
(epochs, minibatch_groups, kl_coeff, model, gen_length, steps). Without the config's SFT
checkpoint the model is the config's fresh one (same size, same cost).

Run from the repository root (about 2 x repeats x 2 updates; a few minutes on 2 cores):

    .venv/bin/python benchmarks/flow_grpo_update_time.py
    .venv/bin/python benchmarks/flow_grpo_update_time.py --repeats 1 --output smoke \
        algo.num_generation_steps=8 algo.gen_length=48        # a quick check that it works

Results: ``benchmarks/results/<output>.md/.json`` (median seconds per update, the ratio of each
fraction to 1.0). No assertion is made; a timing is never a test.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS_DIR, git_revision, machine_info, md_table,  # noqa: E402
                     write_json, write_results)

CONFIG = "configs/flow_grpo/forms_small.yaml"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5])
    p.add_argument("--repeats", type=int, default=3, help="timed updates per fraction")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="flow_grpo_update_time")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_args()


def main() -> None:
    import numpy as np
    import torch

    from flowrl_ray.algorithms.flow_grpo import FlowGRPO
    from flowrl_ray.batch import Batch, BatchMeta
    from flowrl_ray.config import apply_overrides, config_from_dict, read_yaml
    from flowrl_ray.envs import EnvSpec

    args = parse_args()
    torch.set_num_threads(args.threads)
    raw = apply_overrides(read_yaml(args.config), args.overrides)
    raw["seed"] = args.seed
    sft = (raw.get("algo") or {}).get("sft_checkpoint")
    fresh = not sft or not Path(sft).exists()
    tmp = tempfile.TemporaryDirectory()
    if fresh:                      # a fresh model of the config's size, its tokenizer trained here
        from flowrl_ray.models.masked_diffusion import build_masked_lm
        from flowrl_ray.models.text_tokenizer import train_tokenizer
        from flowrl_ray.pretrain.text_sft import sft_pairs
        print(f"[bench] {sft} not found: a fresh model of the config's size", flush=True)
        model_cfg = dict(raw["algo"].get("model") or {})
        texts = [t for pair in sft_pairs(config_from_dict(raw).env)[:400] for t in pair]
        lm = build_masked_lm(model_cfg, tokenizer=train_tokenizer(texts, model_cfg.get("vocab_size", 2048)),
                             seed=args.seed)
        lm.save(Path(tmp.name) / "model")
        raw["algo"]["sft_checkpoint"] = str(Path(tmp.name) / "model")
    cfg = config_from_dict(raw)
    c = cfg.algo
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    algo = FlowGRPO(cfg, EnvSpec(obs_shape=(1,), action_dim=1), device)

    t0 = time.perf_counter()
    chunks = algo.generate(1, "train")
    gen_s = time.perf_counter() - t0
    n = algo.pending["n"]
    rewards = np.random.default_rng(args.seed).random(n).astype(np.float32)
    ids = np.concatenate([ch["ids"] for ch in chunks])
    zeros = np.zeros(n, np.float32)
    data = {"ids": ids, "rewards": rewards[ids], "task_completion": zeros, "field_accuracy": rewards[ids],
            "execution_completeness": zeros, "unparseable_lines": zeros}
    prepared = algo.prepare([Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=n))])
    start = copy.deepcopy(algo.state_dict())
    steps = int(prepared["trajectory"]["unmasked"].shape[0])
    print(f"[bench] {n} rollouts x {steps} unmasking steps generated in {gen_s:.1f} s", flush=True)

    times: dict[float, list[float]] = {f: [] for f in args.fractions}
    metrics: dict[float, dict] = {}
    for r in range(args.repeats):
        for f in args.fractions:
            algo.load_state_dict(copy.deepcopy(start))     # same weights, optimiser, update generator
            algo.c.timestep_fraction = f
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics[f] = algo.update(prepared)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[f].append(time.perf_counter() - t0)
            print(f"[bench] repeat {r + 1}/{args.repeats} fraction {f}: {times[f][-1]:.2f} s", flush=True)

    base = statistics.median(times[1.0]) if 1.0 in times else None
    rows, out = [], {}
    for f in args.fractions:
        med = statistics.median(times[f])
        m = metrics[f]
        out[str(f)] = {"seconds": times[f], "median_s": med, "ratio_to_full": med / base if base else None,
                       "steps_per_minibatch": m["flow_grpo/steps_per_minibatch"],
                       "optimizer_steps": m["flow_grpo/optimizer_steps"], "kl": m.get("kl"),
                       "clipfrac": m.get("clipfrac")}
        rows.append([f, int(m["flow_grpo/steps_per_minibatch"]), int(m["flow_grpo/optimizer_steps"]),
                     f"{med:.2f}", f"{min(times[f]):.2f}-{max(times[f]):.2f}",
                     f"{med / base:.2f}" if base else "-"])
    results = {"args": vars(args), "machine": machine_info(), "git": git_revision(), "device": str(device),
               "config": args.config, "fresh_model": fresh, "rollouts": n, "steps": steps,
               "epochs": c.epochs, "minibatch_groups": c.minibatch_groups, "kl_coeff": c.kl_coeff,
               "generation_s": gen_s, "fractions": out}
    body = (f"Config `{args.config}`{' with ' + ' '.join(args.overrides) if args.overrides else ''}"
            f"{' (fresh model: the SFT checkpoint was not found)' if fresh else ''}; device {device}; "
            f"{n} rollouts ({c.prompts_per_iteration} prompts x {c.group_size}), {steps} unmasking steps, "
            f"{c.epochs} epochs, minibatch_groups {c.minibatch_groups or c.prompts_per_iteration}, "
            f"kl_coeff {c.kl_coeff}; {args.repeats} timed updates per fraction, interleaved, each from the "
            f"same state. Generating the batch took {gen_s:.1f} s.\n\n"
            + md_table(["timestep_fraction", "steps per minibatch (K)", "optimiser steps", "median s per update",
                        "range s", "vs fraction 1.0"], rows)
            + "\n\nBesides the gradient passes (epochs x K steps per minibatch), an update runs no-grad "
              "forward passes: the reference's once per (minibatch, step) used, and the old log-probs of "
              "the (minibatch, step) pairs not first met before any optimiser step. A minibatch keeps its "
              "K steps in every epoch, so those passes shrink with K as well.\n")
    write_results(args.output, "Flow-GRPO update time: step subsampling (timestep_fraction)", body)
    write_json(RESULTS_DIR / f"{args.output}.json", results)


if __name__ == "__main__":
    main()
