"""FPO++ learner: one ``FPOPP.update`` epoch against a bare-PyTorch loop of the same math.

Run from the repository root (about 1 minute on 2 cores with the defaults):

    .venv/bin/python benchmarks/fpopp_learner.py
    .venv/bin/python benchmarks/fpopp_learner.py --threads 1 --reps 20

The batch is what a realistic FPO++ iteration hands the learner (``configs/fpopp/*_state.yaml``
sizes): ``--workers`` (2) rollout batches of ``--envs-per-worker`` (25) envs x ``--chunk-steps``
(20) chunk steps = 1000 samples, observation 19-d (Lift, low-dim), action chunks [16, 7], N_mc 8
Monte Carlo pairs per action, built as ``tests/unit/algorithms/test_fpopp.py::_rollout_batch`` does (random
observations, sparse rewards, each step's actions / taus / mc_eps / cfm_old recorded by the
policy's own ``act``), then turned into training tensors once by ``FPOPP.prepare``.

Two learners, built with the same seed (identical initial weights, identical minibatch
permutations), each timed on the same prepared batch:

- **flowrl_ray**: ``FPOPP.update(prepared)`` with ``algo.epochs = 1`` and
  ``algo.critic_warmup_iters = 0`` (actor and critic trained), minibatch 500 (2 minibatches):
  the whole method, metrics included.
- **bare PyTorch**: the same networks and AdamW optimisers (taken from a second ``FPOPP``
  instance), with the update written inline: randperm -> per minibatch: critic value loss, CFM
  losses of the new policy (one velocity-MLP pass over B x N_mc rows), per-sample ratios
  ``exp(clamp(l_old - l_new, +-5))``, normalised advantages, PPO clip objective, backward, grad
  clip (norm 1.0, actor and critic each by its own norm), actor + critic step. No statistics, no ``float()`` reads, no finiteness checks.

Before timing, one update of each from identical states is compared parameter by parameter (the
bare loop must compute the same math: the maximum absolute difference is reported). Then
``--warmup`` untimed updates each, then ``--reps`` timed repetitions, alternating which side goes
first. Reported per torch thread count (``--threads``, default 1 then 2): median wall time of one
update epoch per side, min-max, ``flowrl / bare`` from the medians and paired per repetition
(target <= 1.1), and an instrumented pass of the bare loop splitting a minibatch into forward,
backward, grad clip and optimiser step. No assertion is made.

Results go to stdout, ``benchmarks/results/fpopp_learner.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (REPO_ROOT, RESULTS_DIR, LoadMonitor, git_revision, load_lines, machine_info,  # noqa: E402
                     md_table, write_json, write_results)

TARGET_RATIO = 1.1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="rollout batches (one per worker)")
    p.add_argument("--envs-per-worker", type=int, default=25)
    p.add_argument("--chunk-steps", type=int, default=20, help="chunk steps per env per batch")
    p.add_argument("--obs-dim", type=int, default=19)
    p.add_argument("--horizon", type=int, default=16, help="action chunk length (env.horizon_steps)")
    p.add_argument("--n-mc", type=int, default=8)
    p.add_argument("--minibatch", type=int, default=500)
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 512, 512])
    p.add_argument("--critic-hidden", type=int, nargs="+", default=[256, 256, 256])
    p.add_argument("--flow-steps", type=int, default=10)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts, one row each")
    p.add_argument("--warmup", type=int, default=2, help="untimed updates per side (per thread count)")
    p.add_argument("--reps", type=int, default=10, help="timed updates per side (per thread count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="fpopp_learner", help="results name (benchmarks/results/<name>.md/.json)")
    return p.parse_args()


def make_config(args: argparse.Namespace):
    from flowrl_ray.config import config_from_dict
    return config_from_dict({
        "algorithm": "fpopp", "seed": args.seed,
        # The robot family only names the chunk shape here: no env is built.
        "env": {"family": "robot", "id": "lift", "obs_mode": "low_dim", "horizon_steps": args.horizon,
                "act_steps": min(8, args.horizon)},
        "train": {"iterations": 200},
        "runtime": {"num_workers": args.workers, "envs_per_worker": args.envs_per_worker,
                    "rollout_length": args.chunk_steps},
        # configs/fpopp/lift_state.yaml's values, with 1 epoch and no critic warm-up
        "algo": {"hidden_sizes": args.hidden, "critic_hidden_sizes": args.critic_hidden,
                 "flow_steps": args.flow_steps, "n_mc": args.n_mc, "clip": 0.05, "use_aspo": False,
                 "ratio_mode": "per_sample", "cfm_loss_clamp": 0.0, "cfm_diff_clamp": 5.0,
                 "gamma": 0.99, "gae_lambda": 0.99, "epochs": 1, "minibatch_size": args.minibatch,
                 "lr": 1e-5, "critic_lr": 1e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0,
                 "critic_warmup_iters": 0, "normalize_advantages": True, "target_kl": None}})


def make_algo(cfg, spec, device=None):
    import torch

    from flowrl_ray.algorithms.fpopp import FPOPP
    torch.manual_seed(cfg.seed)               # identical initial weights for every instance
    return FPOPP(cfg, spec, device or torch.device("cpu"))


def rollout_batches(algo, args: argparse.Namespace) -> list:
    """Time-major batches as the EnvRunner writes them (see tests/unit/algorithms/test_fpopp.py::_rollout_batch)."""
    import torch

    from flowrl_ray.batch import Batch, BatchMeta
    t, n, d = args.chunk_steps, args.envs_per_worker, args.obs_dim
    out = []
    for w in range(args.workers):
        gen = torch.Generator().manual_seed(args.seed + 1000 + w)
        obs = torch.randn(t, n, d, generator=gen)
        data = {"obs": obs.numpy(), "rewards": (torch.rand(t, n, generator=gen) > 0.9).float().numpy(),
                "terminated": torch.zeros(t, n, dtype=torch.bool).numpy(),
                "truncated": torch.zeros(t, n, dtype=torch.bool).numpy(),
                "final_obs": torch.zeros(t, n, d).numpy(), "last_obs": torch.randn(n, d, generator=gen).numpy()}
        records = [algo.policy.act(obs[i], generator=gen)[1] for i in range(t)]
        for k in records[0]:
            data[k] = torch.stack([r[k] for r in records]).numpy()
        out.append(Batch(data, BatchMeta(policy_version=0, worker_id=w, env_steps=t * n)))
    return out


# --------------------------------------------------------------------------- the bare loop

class BareLearner:
    """The FPO++ update of FPOPP.update/_losses written inline on another FPOPP instance's
    networks and optimisers (same seed: same weights, same permutation generator)."""

    def __init__(self, algo, cfg):
        import torch
        c = cfg.algo
        self.actor, self.critic = algo.policy, algo.critic
        self.velocity = algo.policy.velocity              # the velocity MLP (time embedding inside)
        self.opts = [algo.actor_opt, algo.critic_opt]
        self.params = [[p for g in o.param_groups for p in g["params"]] for o in self.opts]   # actor, critic
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.mb, self.clip, self.diff_clamp = c.minibatch_size, c.clip, c.cfm_diff_clamp
        self.vf_coef, self.max_grad_norm = c.vf_coef, c.max_grad_norm

    def minibatch_loss(self, b: dict, idx):
        import torch
        obs, actions, taus, eps = b["obs"][idx], b["actions"][idx], b["taus"][idx], b["mc_eps"][idx]
        v_loss = (0.5 * (self.critic.net(obs).squeeze(-1) - b["returns"][idx]).pow(2)).mean()
        bs, n = taus.shape
        a = actions.unsqueeze(1)                                        # [B, 1, Ta, Da]
        t = taus[..., None, None]
        x = t * a + (1.0 - t) * eps                                     # [B, N, Ta, Da]
        v = self.velocity(x.reshape(bs * n, *actions.shape[1:]), taus.reshape(bs * n),
                          obs.repeat_interleave(n, dim=0))
        err = (v.reshape(bs, n, *actions.shape[1:]) - (a - eps)).pow(2).mean(-1)        # [B, N, Ta]
        new = (err * b["row_mask"][idx][:, None]).sum(-1)               # executed rows: [B, N]
        ratio = (b["cfm_old"][idx] - new).clamp(-self.diff_clamp, self.diff_clamp).exp()
        adv = b["advantages"][idx]
        adv = ((adv - adv.mean()) / (adv.std() + 1e-8))[:, None]
        pg_loss = -torch.min(ratio * adv, ratio.clamp(1.0 - self.clip, 1.0 + self.clip) * adv).mean()
        return pg_loss + self.vf_coef * v_loss

    def step(self, loss) -> None:
        import torch
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        loss.backward()
        for params in self.params:                      # each network by its own norm
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        for o in self.opts:
            o.step()

    def update(self, b: dict) -> None:
        import torch
        m = b["advantages"].shape[0]
        perm = torch.randperm(m, generator=self.generator)
        for start in range(0, m, self.mb):
            self.step(self.minibatch_loss(b, perm[start:start + self.mb]))

    def profiled_update(self, b: dict) -> dict[str, float]:
        """One update with the minibatch phases timed (seconds, summed over minibatches)."""
        import torch
        out = {"forward (critic + CFM losses + objective)": 0.0, "zero_grad + backward": 0.0,
               "grad clip": 0.0, "optimiser steps (actor + critic AdamW)": 0.0}
        keys = list(out)
        m = b["advantages"].shape[0]
        perm = torch.randperm(m, generator=self.generator)
        for start in range(0, m, self.mb):
            t0 = time.perf_counter()
            loss = self.minibatch_loss(b, perm[start:start + self.mb])
            t1 = time.perf_counter()
            for o in self.opts:
                o.zero_grad(set_to_none=True)
            loss.backward()
            t2 = time.perf_counter()
            for params in self.params:
                torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            t3 = time.perf_counter()
            for o in self.opts:
                o.step()
            t4 = time.perf_counter()
            for k, d in zip(keys, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                out[k] += d
        return out


# --------------------------------------------------------------------------- measurement

def max_param_diff(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


def measure(threads: int, cfg, spec, batches: list, args: argparse.Namespace) -> dict:
    import torch
    torch.set_num_threads(threads)
    flow = make_algo(cfg, spec)
    bare_algo = make_algo(cfg, spec)
    assert max_param_diff(flow.policy, bare_algo.policy) == 0.0 and max_param_diff(flow.critic, bare_algo.critic) == 0.0
    bare = BareLearner(bare_algo, cfg)
    t0 = time.perf_counter()
    b = flow.prepare(batches)
    prepare_s = time.perf_counter() - t0
    m = b["advantages"].shape[0]
    n_minibatches = -(-m // cfg.algo.minibatch_size)

    # Same math: one update each from identical states, then compare the weights.
    metrics = flow.update(b)
    bare.update(b)
    check = {"actor_max_abs_diff": max_param_diff(flow.policy, bare_algo.policy),
             "critic_max_abs_diff": max_param_diff(flow.critic, bare_algo.critic),
             "flowrl_actor_steps": metrics["fpopp/actor_steps"], "flowrl_skipped_updates": metrics["fpopp/skipped_updates"]}
    print(f"[bench] {threads} thread(s): same-math check after one update: actor max |diff| "
          f"{check['actor_max_abs_diff']:.3g}, critic {check['critic_max_abs_diff']:.3g}", flush=True)

    sides = {"flowrl_ray FPOPP.update": lambda: flow.update(b), "bare PyTorch": lambda: bare.update(b)}
    for _ in range(args.warmup):
        for fn in sides.values():
            fn()
    times = {k: [] for k in sides}
    monitor = LoadMonitor()
    names = list(sides)
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):      # alternate which goes first
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
        print(f"[bench] {threads} thread(s) rep {rep + 1}/{args.reps}: "
              + ", ".join(f"{k} {1e3 * v[-1]:.0f} ms" for k, v in times.items()), flush=True)
    load = monitor.stop()
    profile = bare.profiled_update(b)
    flow_t, bare_t = times[names[0]], times[names[1]]
    return {"threads": threads, "samples": m, "minibatches": n_minibatches, "prepare_s": prepare_s,
            "flowrl_s": flow_t, "bare_s": bare_t,
            "flowrl_median_s": statistics.median(flow_t), "bare_median_s": statistics.median(bare_t),
            "ratio": statistics.median(flow_t) / statistics.median(bare_t),
            "ratio_paired": statistics.median(f / r for f, r in zip(flow_t, bare_t)),
            "bare_profile_s": profile, "check": check, "load": load}


def report(results: list[dict], args: argparse.Namespace, elapsed: float) -> str:
    r0 = results[0]
    setup = [f"- flowrl_ray revision: {git_revision()}",
             f"- batch: {args.workers} workers x {args.envs_per_worker} envs x {args.chunk_steps} chunk steps = "
             f"{r0['samples']} samples; obs {args.obs_dim}-d, action chunk [{args.horizon}, 7], N_mc {args.n_mc} "
             f"({r0['samples'] * args.n_mc} CFM rows per epoch)",
             f"- networks: flow policy velocity MLP {args.hidden} (mish, time embedding 32), critic "
             f"{args.critic_hidden}; AdamW (actor lr 1e-5, critic lr 1e-4, weight decay 1e-4); clip 0.05, "
             f"per-sample ratios, diff clamp 5, grad-norm clip 1.0",
             f"- one update epoch = {r0['minibatches']} minibatches of {args.minibatch} "
             f"(FPOPP: epochs=1, critic_warmup_iters=0)",
             f"- {args.warmup} warm-up updates per side, then {args.reps} timed repetitions, sides alternating "
             f"which goes first; ratio = flowrl / bare from the medians; 'paired' = median of the per-repetition "
             f"ratios; target <= {TARGET_RATIO}",
             f"- total benchmark time: {elapsed:.0f} s"]
    headers = ["torch threads", "flowrl_ray update (ms, median)", "min–max", "bare PyTorch (ms, median)",
               "min–max", "flowrl / bare", "paired", "target"]
    rows = []
    for r in results:
        f, b = r["flowrl_s"], r["bare_s"]
        rows.append([r["threads"], 1e3 * r["flowrl_median_s"], f"{1e3 * min(f):,.0f}–{1e3 * max(f):,.0f}",
                     1e3 * r["bare_median_s"], f"{1e3 * min(b):,.0f}–{1e3 * max(b):,.0f}",
                     f"{r['ratio']:.3f}", f"{r['ratio_paired']:.3f}",
                     "met" if r["ratio"] <= TARGET_RATIO else "NOT met"])
    notes = []
    for r in results:
        c = r["check"]
        notes.append(f"- {r['threads']} thread(s): same-math check, one update each from identical weights: "
                     f"max |actor diff| {c['actor_max_abs_diff']:.3g}, max |critic diff| {c['critic_max_abs_diff']:.3g} "
                     f"(0 = bit-identical); FPOPP.prepare on the {r['samples']} samples took "
                     f"{1e3 * r['prepare_s']:.0f} ms (critic values + GAE, once per iteration, not in the timings)")
    prof_headers = ["torch threads", *results[0]["bare_profile_s"].keys(), "total (ms)"]
    prof_rows = []
    for r in results:
        p = r["bare_profile_s"]
        total = sum(p.values())
        prof_rows.append([r["threads"], *(f"{1e3 * v:,.0f} ({100 * v / total:.0f} %)" for v in p.values()),
                          1e3 * total])
    parts = ["## Setup\n\n" + "\n".join(setup),
             "## One FPO++ update epoch\n\n" + md_table(headers, rows) + "\n\n" + "\n".join(notes),
             "## Where the bare loop's time goes (one instrumented update, ms summed over its minibatches)\n\n"
             + md_table(prof_headers, prof_rows)]
    for r in results:
        parts.append(f"## CPU load during the timed repetitions ({r['threads']} thread(s))\n\n"
                     + "\n".join(load_lines(r["load"])))
    return "\n\n".join(parts)


def main() -> None:
    args = parse_args()
    os.chdir(REPO_ROOT)
    import torch

    from flowrl_ray.envs import EnvSpec
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    cfg = make_config(args)
    spec = EnvSpec(obs_shape=(args.obs_dim,), action_dim=7, max_episode_steps=300)
    batches = rollout_batches(make_algo(cfg, spec), args)
    results = [measure(t, cfg, spec, batches, args) for t in args.threads]
    elapsed = time.perf_counter() - t0
    write_results(args.output, "FPO++ learner: FPOPP.update vs a bare-PyTorch loop", report(results, args, elapsed))
    store = write_json(RESULTS_DIR / f"{args.output}.json",
                       {"benchmark": "fpopp_learner", "args": vars(args), "machine": machine_info(),
                        "revision": git_revision(), "elapsed_s": elapsed, "target_ratio": TARGET_RATIO,
                        "results": results})
    print(f"[bench] raw numbers written to {os.path.relpath(store, Path.cwd())}", flush=True)


if __name__ == "__main__":
    main()
