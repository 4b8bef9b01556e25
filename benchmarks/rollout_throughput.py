"""Rollout throughput: flowrl_ray's Ray rollout workers against a single-process loop.

Run from the repository root (about 3 minutes on 2 cores with the defaults, plus up to
5 minutes waiting for an idle machine first, see --wait-quiet):

    .venv/bin/python benchmarks/rollout_throughput.py
    .venv/bin/python benchmarks/rollout_throughput.py --env HalfCheetah-v5 --reps 15

Every measurement runs the same code: an :class:`flowrl_ray.envs.rollout.EnvRunner` stepping
``envs_per_worker`` gymnasium envs with the PPO Gaussian policy from
``flowrl_ray.algorithms.ppo.PPO.make_policy(cfg, spec)`` (same weights everywhere, with a
non-empty observation normaliser as in training). The config is
``configs/ppo/pendulum.yaml`` with ``env.id`` / ``runtime.*`` overridden. Configurations:

- ``single process``: the EnvRunner called directly in this process (no Ray, 1 torch thread);
  this is the baseline, 1 core.
- ``ray, 1 worker`` / ``ray, 2 workers``: ``flowrl_ray.runtime.actors.RolloutWorker`` actors on a
  local Ray started by ``flowrl_ray.runtime.trainer.init_ray`` (as the Trainer does). Each round
  calls ``sample.remote()`` on every worker and waits for all of them; the driver fetches only the
  small ``BatchMeta`` objects (as the Trainer does: batches go to the learner).
- ``ray, 2 workers + fetch``: the same, but the driver also ``ray.get``s the batches, to show
  the transfer cost.
- ``2 processes, no Ray``: two plain ``multiprocessing`` processes each running an EnvRunner,
  driven over pipes (only step counts come back). This is the hardware ceiling for 2-way
  parallelism on this machine, without Ray: if it is below 2x as well, the gap is the machine.

Before Ray starts, a calibration measures how well this machine runs *any* 2 CPU-bound processes
at once (a pure-Python loop, timed inside each process): a VM's 2 vCPUs often do not give 2x.
The report also gives the niceness of the Ray workers (Ray starts them at nice 15 by default,
the baseline runs at nice 0: on a loaded machine that alone changes the ratios; see
``--ray-worker-niceness``) and what else used the CPU during the timed part.

Steady state: every configuration first runs ``--warmup`` rounds, then ``--reps`` repetitions of
``--calls`` back-to-back rounds each; the configurations are interleaved (the order rotates every
repetition) so that load from other processes hits all of them alike. Reported: the median
env steps/s over repetitions, and ``ratio per core`` = (steps/s / workers) / (single-process
steps/s), from the medians and paired per repetition (target: >= 0.9). No assertion is made.

Results go to stdout and to ``benchmarks/results/rollout_throughput.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runners import ProcessPair, make_runner, niceness  # noqa: E402
from _common import (REPO_ROOT, LoadMonitor, git_revision, load_lines, md_table, wait_for_quiet,  # noqa: E402
                     write_results)

BASE_CONFIG = REPO_ROOT / "configs" / "ppo" / "pendulum.yaml"
TARGET_RATIO = 0.9
RAY_INLINE_LIMIT = 100 * 1024   # Ray's default max_direct_call_object_size: smaller returns are inlined


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--env", nargs="+", default=["Pendulum-v1", "HalfCheetah-v5"],
                   help="gymnasium env ids, measured one after the other")
    p.add_argument("--envs-per-worker", type=int, default=4)
    p.add_argument("--rollout-length", type=int, default=256, help="env steps per env per sample() call")
    p.add_argument("--warmup", type=int, default=3, help="warm-up rounds per configuration")
    p.add_argument("--reps", type=int, default=15, help="timed repetitions per configuration")
    p.add_argument("--calls", type=int, default=4, help="back-to-back sample rounds per repetition")
    p.add_argument("--ray-worker-niceness", type=int, default=None,
                   help="set RAY_worker_niceness for the local Ray (Ray's default runs workers at nice 15, "
                        "below the nice-0 single-process baseline and every ordinary process)")
    p.add_argument("--no-mp-reference", action="store_true", help="skip the '2 processes, no Ray' row")
    p.add_argument("--wait-quiet", type=float, default=300,
                   help="first wait up to this many seconds for the machine to be idle (0: don't)")
    p.add_argument("--output", default="rollout_throughput", help="results file name (benchmarks/results/<name>.md)")
    return p.parse_args()


def make_config(env_id: str, args: argparse.Namespace):
    from flowrl_ray.config import load_config
    return load_config(BASE_CONFIG, [f"env.id={env_id}", "runtime.num_workers=2",
                                     f"runtime.envs_per_worker={args.envs_per_worker}",
                                     f"runtime.rollout_length={args.rollout_length}"])


# --------------------------------------------------------------------------- the "no Ray" reference

# --------------------------------------------------------------------------- machine calibration

def _spin(n: int) -> float:
    """A pure-Python integer loop: no memory traffic, no shared data, no I/O."""
    t, x = time.perf_counter(), 0
    for i in range(n):
        x += i * i
    return time.perf_counter() - t


def machine_two_way_scaling(reps: int = 12, n: int = 3_000_000) -> float:
    """Per-core ratio of the same CPU-bound loop run by 2 processes at once vs 1 alone: the best
    2-way scaling any 2-process workload can get on this machine (a VM's vCPUs may share a
    physical core or clock down when both are busy)."""
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        pool.map(_spin, [n // 10] * 2)                    # start both processes
        alone, both = [], []
        for _ in range(reps):
            alone.append(pool.apply(_spin, (n,)))
            both.append(max(pool.map(_spin, [n, n], chunksize=1)))
    return statistics.median(a / b for a, b in zip(alone, both))


# --------------------------------------------------------------------------- measurements

@dataclass
class Samples:
    """Per repetition: env steps/s; per round: in-worker sample time and driver-side overhead."""
    steps_per_s: list[float] = field(default_factory=list)
    worker_steps_per_s: list[float] = field(default_factory=list)   # inside EnvRunner.sample, per worker
    overhead_ms: list[float] = field(default_factory=list)          # round wall - slowest worker's sample time


def timed_rounds(round_fn, calls: int, out: Samples | None) -> None:
    """Run `calls` rounds back to back; each round returns [(env_steps, sample_time_s)] per worker."""
    steps, t0 = 0, time.perf_counter()
    for _ in range(calls):
        r0 = time.perf_counter()
        results = round_fn()
        wall = time.perf_counter() - r0
        steps += sum(s for s, _ in results)
        if out is not None:
            out.worker_steps_per_s += [s / t for s, t in results]
            out.overhead_ms.append(1e3 * (wall - max(t for _, t in results)))
    if out is not None:
        out.steps_per_s.append(steps / (time.perf_counter() - t0))


def measure_env(env_id: str, args: argparse.Namespace) -> dict:
    import ray
    import torch

    from flowrl_ray.envs import env_family
    from flowrl_ray.runtime.actors import RolloutWorker
    from flowrl_ray.runtime.trainer import init_ray

    cfg = make_config(env_id, args)
    spec = env_family(cfg.env.family).spec(cfg.env)
    T, n_envs = cfg.runtime.rollout_length, cfg.runtime.envs_per_worker

    # Baseline runner; give its policy a non-empty observation normaliser (as after a first
    # update) so every configuration pays the normalisation it pays in training.
    single = make_runner(cfg, spec, 0, None)
    first = single.sample(T)
    single.policy.obs_norm.update(torch.as_tensor(first["obs"].reshape(-1, spec.obs_dim)))
    state = {k: v.clone() for k, v in single.policy.state_dict().items()}
    single.set_weights(state, 1)
    batch_bytes = len(pickle.dumps(first))

    init_ray(cfg)
    rt = cfg.runtime
    workers = [RolloutWorker.options(num_cpus=rt.num_cpus_per_worker).remote(cfg, spec, i) for i in range(2)]
    weights_ref = ray.put(state)
    ray.get([w.set_weights.remote(weights_ref, 1) for w in workers])
    worker_nice = [niceness(pid) for pid in ray.get([w.pid.remote() for w in workers])]
    pair = None if args.no_mp_reference else ProcessPair(cfg, spec, state)

    def single_round():
        b = single.sample(T)
        return [(b.meta.env_steps, b.meta.sample_time_s)]

    def ray_round(n: int, fetch: bool):
        def round_fn():
            pairs = [w.sample.remote() for w in workers[:n]]
            metas = ray.get([m for m, _ in pairs])          # small: what the Trainer fetches
            if fetch:
                ray.get([b for _, b in pairs])             # the arrays, to show the transfer cost
            return [(m.env_steps, m.sample_time_s) for m in metas]
        return round_fn

    configs = {"single process": (1, single_round), "ray, 1 worker": (1, ray_round(1, False)),
               "ray, 2 workers": (2, ray_round(2, False)), "ray, 2 workers + fetch": (2, ray_round(2, True))}
    if pair is not None:
        configs["2 processes, no Ray"] = (2, lambda: [(m.env_steps, m.sample_time_s) for m in pair.sample()])
    samples = {name: Samples() for name in configs}

    print(f"[bench] {env_id}: warm-up ({args.warmup} rounds per configuration)", flush=True)
    for name, (_, fn) in configs.items():
        timed_rounds(fn, args.warmup, None)
    monitor = LoadMonitor()
    names = list(configs)
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]   # rotate: interleaved
        for name in order:
            timed_rounds(configs[name][1], args.calls, samples[name])
        line = ", ".join(f"{n}: {samples[n].steps_per_s[-1]:,.0f}" for n in names)
        print(f"[bench] {env_id} rep {rep + 1}/{args.reps} steps/s  {line}", flush=True)
    load = monitor.stop()

    for w in workers:
        ray.kill(w)
    if pair is not None:
        pair.close()
    single.close()

    base = statistics.median(samples["single process"].steps_per_s)
    rows = []
    for name, (n, _) in configs.items():
        s = samples[name]
        med = statistics.median(s.steps_per_s)
        paired = statistics.median(r / n / b for r, b in zip(s.steps_per_s, samples["single process"].steps_per_s))
        rows.append([name, n, med, f"{min(s.steps_per_s):,.0f}–{max(s.steps_per_s):,.0f}",
                     f"{med / n / base:.3f}", f"{paired:.3f}",
                     statistics.median(s.worker_steps_per_s), statistics.median(s.overhead_ms)])
    fetch_ms = (statistics.median(samples["ray, 2 workers + fetch"].overhead_ms)
                - statistics.median(samples["ray, 2 workers"].overhead_ms))
    return {"env": env_id, "obs_dim": spec.obs_dim, "action_dim": spec.action_dim, "T": T, "n_envs": n_envs,
            "rows": rows, "base": base, "worker_nice": worker_nice, "batch_bytes": batch_bytes, "fetch_ms": fetch_ms, "load": load,
            "ratios": {name: float(rows[i][4]) for i, name in enumerate(configs)}}


def report(results: list[dict], args: argparse.Namespace, elapsed: float, quiet: str, machine_ratio: float) -> str:
    headers = ["configuration", "workers", "env steps/s (median)", "min–max", "ratio per core",
               "ratio per core (paired)", "in-worker steps/s per worker", "overhead per round (ms)"]
    parts = [f"## Setup\n\n- flowrl_ray revision: {git_revision()}\n"
             f"- config: configs/ppo/pendulum.yaml with env.id=<env>, runtime.envs_per_worker="
             f"{args.envs_per_worker}, runtime.rollout_length={args.rollout_length} (PPO Gaussian policy, "
             f"[64, 64] tanh, observation normaliser on, 1 torch thread everywhere)\n"
             f"- {args.warmup} warm-up rounds, then {args.reps} interleaved repetitions x {args.calls} rounds "
             f"per configuration; one round = one sample() call per worker "
             f"({args.rollout_length} steps x {args.envs_per_worker} envs each)\n"
             f"- ratio per core = (steps/s / workers) / (single-process steps/s); target >= {TARGET_RATIO}. "
             f"'paired' is the median over repetitions of the same ratio within each repetition.\n"
             f"- in-worker steps/s: env steps / time inside EnvRunner.sample (CPU contention shows here); "
             f"overhead per round: round wall time minus the slowest worker's sample time "
             f"(Ray scheduling, transfer, driver)\n- before starting: {quiet}\n"
             f"- machine calibration: a pure-Python CPU loop run by 2 processes at once runs at "
             f"{machine_ratio:.3f} per core of the same loop run alone (median of pairs; timed inside each "
             f"process, so no start-up or IPC in it). No 2-process workload can scale better than this here.\n"
             f"- total benchmark time: {elapsed:.0f} s"]
    for r in results:
        ray2 = r["ratios"]["ray, 2 workers"]
        ray1 = r["ratios"]["ray, 1 worker"]
        verdict = lambda x: "met" if x >= TARGET_RATIO else "NOT met"
        notes = [f"- single process: {r['base']:,.0f} env steps/s; target {TARGET_RATIO} per core: "
                 f"1 worker {ray1:.3f} ({verdict(ray1)}), 2 workers {ray2:.3f} ({verdict(ray2)})",
                 f"- batch per sample() call: {r['batch_bytes'] / 1024:.0f} KiB pickled "
                 f"({'below' if r['batch_bytes'] < RAY_INLINE_LIMIT else 'above'} Ray's 100 KiB inline limit: "
                 f"{'returned inline to the driver even when it is not fetched' if r['batch_bytes'] < RAY_INLINE_LIMIT else 'stored in the object store'}); "
                 f"fetching both batches costs {r['fetch_ms']:.1f} ms per round (median)"]
        notes.append(f"- niceness: Ray rollout workers {r['worker_nice']}, this process (single-process "
                     f"baseline) {os.nice(0)}"
                     + ("" if args.ray_worker_niceness is not None else
                        " (Ray's default worker niceness; --ray-worker-niceness changes it)"))
        if "2 processes, no Ray" in r["ratios"]:
            notes.append(f"- 2 plain processes (no Ray) reach {r['ratios']['2 processes, no Ray']:.3f} per core: "
                         f"the machine's own 2-way scaling")
        parts.append(f"## {r['env']} (obs {r['obs_dim']}, action {r['action_dim']}; "
                     f"{r['n_envs']} envs x {r['T']} steps per call)\n\n"
                     + md_table(headers, r["rows"]) + "\n\n" + "\n".join(notes)
                     + "\n\nCPU load during the timed repetitions:\n\n" + "\n".join(load_lines(r["load"])))
    return "\n\n".join(parts)


def main() -> None:
    args = parse_args()
    os.chdir(REPO_ROOT)
    import ray
    if args.ray_worker_niceness is not None:           # read by the raylet that init_ray starts
        os.environ["RAY_worker_niceness"] = str(args.ray_worker_niceness)
    quiet = wait_for_quiet(args.wait_quiet)
    print(f"[bench] {quiet}", flush=True)
    t0 = time.perf_counter()
    machine_ratio = machine_two_way_scaling()
    print(f"[bench] machine 2-way scaling of a pure CPU loop: {machine_ratio:.3f} per core", flush=True)
    results = []
    try:
        for env_id in args.env:
            results.append(measure_env(env_id, args))
    finally:
        if ray.is_initialized():
            ray.shutdown()
    write_results(args.output, "Rollout throughput: Ray rollout workers vs a single process",
                  report(results, args, time.perf_counter() - t0, quiet, machine_ratio))


if __name__ == "__main__":
    main()
