"""How many action chunks an FPO++ policy-gradient step needs on Lift before its direction is
signal rather than noise.

Run from the repository root (about 10 minutes on 2 cores with the defaults):

    .venv/bin/python benchmarks/fpopp_gradient_snr.py
    .venv/bin/python benchmarks/fpopp_gradient_snr.py --rounds 24 algo.base_policy=pretrained/lift_state_e20.pt
    .venv/bin/python benchmarks/fpopp_gradient_snr.py --gae-lambdas 0.99 0.95 0.9   # same rollouts, each lambda
    .venv/bin/python benchmarks/fpopp_gradient_snr.py --variants algo.cfm_loss_clamp=0 algo.cfm_loss_clamp=40

Steps: two plain processes (no Ray) roll out the pretrained base policy exactly as FPO++'s
rollout workers do (random sampling, ``runtime.envs_per_worker`` envs, windows of
``runtime.rollout_length`` chunk steps); FPO++'s own ``prepare`` and critic updates (actor frozen,
as in its critic warm-up) fit the critic on every second window; the other windows are split into
disjoint sets of whole env windows (independent trajectories) of ``B`` chunks, and the actor gradient of
FPO++'s objective is taken on each set, at the base policy (every ratio 1, where the per-sample
and the averaged ratio give the same gradient). Reported per ``B``: the mean cosine between the
gradients of disjoint sets, with the true advantages and with the advantages shuffled (no signal:
the noise floor). For gradients ``g = mu + noise / sqrt(B)`` the cosine is
about ``|mu|^2 / (|mu|^2 + sigma^2 / B)``: near 0 while the noise dominates, rising towards 1 as
``B`` grows. Results: ``benchmarks/results/<output>.md/.json``.
No assertion is made.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS_DIR, git_revision, machine_info, md_table,  # noqa: E402
                     pair_cosines, write_json, write_results)

os.environ.setdefault("MUJOCO_GL", "egl")
CONFIG = "configs/fpopp/lift_state_quickstart.yaml"


def collect(cfg, spec, state_dict: dict, worker_id: int, rounds: int) -> list:
    """``rounds`` rollout windows of one worker (runs in a child process)."""
    from _runners import make_runner
    runner = make_runner(cfg, spec, worker_id, state_dict)
    try:
        return [runner.sample(cfg.runtime.rollout_length) for _ in range(rounds)]
    finally:
        runner.close()


def actor_gradient(algo, b: dict, rows, permute: bool, generator) -> "torch.Tensor":
    """The flat gradient of FPO++'s policy loss over ``rows`` (advantages permuted among them when
    ``permute``: the same magnitudes with the signal removed)."""
    import torch
    sub = dict(b)
    if permute:
        adv = b["advantages"].clone()
        adv[rows] = adv[rows][torch.randperm(len(rows), generator=generator)]
        sub["advantages"] = adv
    algo.policy.zero_grad(set_to_none=True)
    loss, _ = algo._losses(sub, rows, train_actor=True)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in algo.policy.parameters() if p.grad is not None])


def mean_pairwise_cosine(grads: list) -> float:
    cos = pair_cosines(grads)
    return sum(cos) / len(cos)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--rounds", type=int, default=24, help="rollout windows per process (2 processes)")
    p.add_argument("--critic-updates", type=int, default=20,
                   help="FPO++ critic-only updates (each: algo.epochs over the batch) before the gradients")
    p.add_argument("--sizes", type=int, nargs="+", default=[160, 320, 640, 1280, 2560],
                   help="chunks per gradient (rounded down to whole env windows)")
    p.add_argument("--gae-lambdas", type=float, nargs="+",
                   help="analyse the same rollouts with each GAE lambda (default: the config's)")
    p.add_argument("--variants", nargs="+", default=[],
                   help="analyse the same rollouts with each of these algo overrides (a variant is one "
                        "or more comma-separated key=value, e.g. algo.cfm_loss_clamp=40,algo.n_mc=16)")
    p.add_argument("--rollouts", help="a pickle of the rollout windows: read when it exists, else written "
                                       "after collecting (to analyse more variants of the same rollouts)")
    p.add_argument("--output", default="fpopp_gradient_snr")
    p.add_argument("overrides", nargs="*", help="config overrides (key.sub=value)")
    args = p.parse_args()

    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from flowrl_ray.algorithms.advantages import explained_variance
    from flowrl_ray.models.flow_policy import load_base_policy
    from flowrl_ray.algorithms.fpopp import FPOPP
    from flowrl_ray.config import load_config
    from flowrl_ray.envs import env_family
    cfg = load_config(args.config, args.overrides + ["algo.critic_warmup_iters=1000000"])
    spec = env_family("robot").spec(cfg.env)
    base = load_base_policy(cfg.algo.base_policy)["policy"]
    t0 = time.perf_counter()
    if args.rollouts and Path(args.rollouts).is_file():
        saved = pickle.loads(Path(args.rollouts).read_bytes())
        batches, collect_s = saved["batches"], saved["collect_s"]
    else:
        with ProcessPoolExecutor(2, multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(collect, cfg, spec, base, i, args.rounds) for i in range(2)]
            batches = [b for f in futures for b in f.result()]
        collect_s = time.perf_counter() - t0
        if args.rollouts:
            Path(args.rollouts).write_bytes(pickle.dumps({"batches": batches, "collect_s": collect_s}))
    successes = [s for b in batches for s in b.meta.extra.get("successes", [])]
    print(f"[bench] {len(batches)} windows, {sum(b.meta.env_steps for b in batches):,} chunks in {collect_s:.0f} s; "
          f"{len(successes)} episodes ended, success {sum(successes) / max(len(successes), 1):.2f}", flush=True)

    torch.set_num_threads(2)
    results = {"args": vars(args), "machine": machine_info(), "git": git_revision(), "collect_s": collect_s,
               "episodes": len(successes), "success_rate": sum(successes) / max(len(successes), 1),
               "variants": {}}
    variants = [f"algo.gae_lambda={lam}" for lam in args.gae_lambdas or []] + args.variants
    rows, explained_of, fitted_of = [], {}, {}
    for variant in variants or ["(config)"]:
        # Every variant sees the same rollouts (a paired comparison), a fresh critic and seed.
        var_cfg = cfg if variant == "(config)" else load_config(
            args.config, args.overrides + ["algo.critic_warmup_iters=1000000"] + variant.split(","))
        torch.manual_seed(0)
        algo = FPOPP(var_cfg, spec, torch.device("cpu"))          # the base policy, a fresh critic
        # The critic is fitted on half of the windows and the gradients are taken on the other
        # half, as in training, where V comes from earlier data (fitted on the same rows, V
        # would absorb the part of each return that the action caused).
        fit_windows, grad_windows = batches[::2], batches[1::2]
        for _ in range(args.critic_updates):                  # actor frozen: the critic warm-up
            algo.update(algo.prepare(fit_windows))
        b_fit = algo.prepare(fit_windows)                     # how well it fits what it saw
        fitted_of[variant] = explained_variance(b_fit["returns"], b_fit["values_old"])
        del b_fit
        b = algo.prepare(grad_windows)
        with torch.no_grad():     # the old losses under this variant's loss (the rollouts' are squared)
            b["cfm_old"] = algo.policy.cfm_losses(b["obs"], b["actions"], b["taus"], b["mc_eps"],
                                                  row_mask=b["row_mask"])
        explained = explained_of[variant] = explained_variance(b["returns"], b["values_old"])
        t_len, n_cols = cfg.runtime.rollout_length, b["advantages"].shape[0] // cfg.runtime.rollout_length
        g = torch.Generator().manual_seed(0)
        cols = torch.randperm(n_cols, generator=g)
        rows_of = lambda c: (torch.arange(t_len)[:, None] * n_cols + c[None, :]).flatten()   # noqa: E731
        results["chunks"] = int(b["advantages"].shape[0])
        per_var = results["variants"][variant] = {"critic_explained_variance_held_out": explained,
                                                  "critic_explained_variance_fitted": fitted_of[variant],
                                                  "sizes": {}}
        for size in args.sizes:
            per = size // t_len
            k = n_cols // per
            if per < 1 or k < 2:
                continue
            sets = [rows_of(cols[i * per:(i + 1) * per]) for i in range(k)]
            true = mean_pairwise_cosine([actor_gradient(algo, b, r, False, g) for r in sets])
            null = mean_pairwise_cosine([actor_gradient(algo, b, r, True, g) for r in sets])
            per_var["sizes"][per * t_len] = {"sets": k, "cosine": true, "cosine_shuffled": null}
            rows.append([variant, per * t_len, k, f"{true:.3f}", f"{null:.3f}"])
            print(f"[bench] {variant}, B = {per * t_len}: {k} sets, cosine {true:.3f} "
                  f"(shuffled advantages {null:.3f})", flush=True)
    lines = [f"- {len(batches)} rollout windows of {t_len} chunk steps x {cfg.runtime.envs_per_worker} envs "
             f"({2 * results['chunks']:,} chunks, {results['episodes']} episodes ended, random-sampling success "
             f"{results['success_rate']:.2f}) collected in {collect_s:.0f} s by 2 plain processes",
             f"- gradients on {results['chunks']:,} chunks (every second window); the critic fitted on the other "
             f"half ({args.critic_updates} FPO++ critic-only updates), explained variance on the gradient half "
             + ", ".join(f"{v:.2f} ({var})" for var, v in explained_of.items())
             + "; on the half it was fitted on "
             + ", ".join(f"{v:.2f} ({var})" for var, v in fitted_of.items())]
    body = (f"Config `{args.config}`{' with ' + ' '.join(args.overrides) if args.overrides else ''}, base "
            f"`{cfg.algo.base_policy}`.\n\n"
            + md_table(["variant", "chunks per gradient B", "disjoint sets", "mean cosine between sets",
                        "same, advantages shuffled"], rows) + "\n\n" + "\n".join(lines) + "\n")
    write_results(args.output, "FPO++ on Lift: policy-gradient agreement between disjoint batches", body)
    write_json(RESULTS_DIR / f"{args.output}.json", results)


if __name__ == "__main__":
    main()
