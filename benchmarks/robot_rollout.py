"""Robot rollout throughput: FPO++ flow policy on robosuite, Ray rollout workers vs one process.

Run from the repository root (about 5 minutes on 2 cores with the defaults, plus up to
--wait-quiet seconds waiting for an idle machine first):

    .venv/bin/python benchmarks/robot_rollout.py                      # Lift, 4 envs per worker
    .venv/bin/python benchmarks/robot_rollout.py --task square --rollout-length 40 --repeats 7
    .venv/bin/python benchmarks/robot_rollout.py --rollout-length 4 --repeats 2 --output /tmp/smoke

Every measurement runs the same code: a :class:`flowrl_ray.envs.rollout.EnvRunner` stepping
``--envs-per-worker`` envs of the ``robot`` family (robosuite Lift / PickPlaceCan /
NutAssemblySquare, low-dim observations, action chunks of 16 of which 8 are executed, 20 Hz
control) with the FPO++ flow policy from ``FPOPP.make_policy(cfg, spec)`` (velocity MLP
[512, 512, 512], 10 Euler steps per action, N_mc = 8 Monte Carlo CFM losses recorded per action;
random initial weights, the same weights everywhere). No dataset normalisation unless
``--dataset`` names a robomimic hdf5 (it changes nothing in the cost). Configurations:

- ``single process``: the EnvRunner called directly in this process (no Ray, 1 torch thread):
  the baseline, 1 core.
- ``ray, 1 worker`` / ``ray, 2 workers``: the real ``flowrl_ray.runtime.actors.RolloutWorker``
  actors (1 torch thread each) on a local ``ray.init(address="local", num_cpus=2)``. A round calls
  ``sample.remote()`` on every worker and waits for all; the driver fetches only the small
  ``BatchMeta`` objects, as the Trainer does (the batches go to the learner).
- ``2 processes, no Ray``: two plain ``multiprocessing`` processes, each with an EnvRunner built
  as RolloutWorker builds one, driven over pipes: the machine's own 2-way ceiling without Ray
  (``--no-mp-reference`` skips it).

Steps are counted at the low (20 Hz) level: chunk steps x act_steps, less the rows a chunk did not
run because the episode's time limit fell inside it (the env's ``info["substeps"]``, recovered from
each finished episode in ``BatchMeta``: a truncated episode's last chunk runs
``max_episode_steps - act_steps * (chunks - 1)`` rows; a success-terminated episode's last chunk is
counted as full, an upper bound, and such episodes are counted in the report).

Steady state: each configuration runs ``--warmup`` rounds first (excluded), then ``--repeats``
timed rounds, the configurations interleaved (the order rotates every repetition). Reported: median
low-level steps/s and the per-core efficiency ``(steps/s / workers) / single-process steps/s``
(target for 2 Ray workers: >= 0.85), from the medians and paired per repetition; in-worker steps/s
(time inside ``EnvRunner.sample``) and the per-round overhead (round wall time minus the slowest
worker's sample time) tell contention from Ray overhead. A machine calibration (a pure-Python loop
in 2 processes vs 1, from ``rollout_throughput.py``) gives the best 2-way scaling possible here.

Shared machines: every round also records how many cores processes *outside* this benchmark used
meanwhile (machine-wide busy CPU from /proc/stat minus this process tree's CPU time), and a second
table repeats the figures over the "clean" rounds only (outside load < ``--clean-threshold``
cores). With 2 cores, one busy outside process halves what 2 workers can get, so only the clean
table says anything about Ray; the all-rounds table is kept to show the load.

Time split: after the timed part, ``--profile-rounds`` extra single-process rounds run with the
policy's and the env's methods wrapped by timers (hierarchical, exclusive of nested timers):
``FlowPolicy.act`` -> Euler sampling (10 velocity-MLP passes) and the N_mc CFM losses (one pass on
B x N_mc rows), the vector env's step -> RobotEnv.step -> robosuite's control step (controller,
physics substeps, observables, reward) and flowrl_ray's own per-step ``sim.forward`` and success
check, observations, resets; the rest is EnvRunner's bookkeeping.

Results go to stdout, ``benchmarks/results/robot_rollout.md`` and ``.json``. No assertion is made.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runners import ProcessPair, make_runner, niceness  # noqa: E402
from _common import (REPO_ROOT, RESULTS_DIR, LoadMonitor, _descendants, _proc_table, git_revision,  # noqa: E402
                     load_lines, machine_info, md_table, wait_for_quiet, write_json, write_results)

TARGET_EFFICIENCY = 0.85
NUM_WORKERS = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", choices=["lift", "can", "square"], default="lift")
    p.add_argument("--envs-per-worker", type=int, default=4)
    p.add_argument("--rollout-length", type=int, default=10, help="chunk steps per env per sample() call")
    p.add_argument("--repeats", type=int, default=16, help="timed rounds per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds per configuration (first sample)")
    p.add_argument("--clean-threshold", type=float, default=0.15,
                   help="a round is 'clean' when processes outside this benchmark used fewer cores than this")
    p.add_argument("--profile-rounds", type=int, default=3, help="instrumented single-process rounds (0: none)")
    p.add_argument("--dataset", default=None, help="robomimic hdf5 for obs/action normalisation (optional)")
    p.add_argument("--no-mp-reference", action="store_true", help="skip the '2 processes, no Ray' row")
    p.add_argument("--no-calibration", action="store_true", help="skip the pure-CPU 2-process calibration")
    p.add_argument("--ray-worker-niceness", type=int, default=None,
                   help="set RAY_worker_niceness (Ray starts workers at nice 15 by default)")
    p.add_argument("--wait-quiet", type=float, default=120,
                   help="first wait up to this many seconds for the machine to be idle (0: don't)")
    p.add_argument("--output", default="robot_rollout", help="results name (benchmarks/results/<name>.md/.json)")
    return p.parse_args()


def make_config(args: argparse.Namespace):
    from flowrl_ray.config import config_from_dict
    batch = NUM_WORKERS * args.envs_per_worker * args.rollout_length
    return config_from_dict({
        "algorithm": "fpopp", "seed": 0,
        "env": {"family": "robot", "id": args.task, "obs_mode": "low_dim", "horizon_steps": 16, "act_steps": 8,
                "dataset": args.dataset},
        "runtime": {"num_workers": NUM_WORKERS, "envs_per_worker": args.envs_per_worker,
                    "rollout_length": args.rollout_length, "num_cpus": 2, "torch_threads": 1},
        "algo": {"hidden_sizes": [512, 512, 512], "flow_steps": 10, "n_mc": 8,
                 "minibatch_size": min(500, batch)}})


# --------------------------------------------------------------------------- low-level step count

def low_level_steps(meta, act_steps: int, max_steps: int) -> tuple[int, int]:
    """(20 Hz steps in a sample() call, success-terminated episodes in it). Every chunk runs
    ``act_steps`` rows except an episode's last one: cut at the time limit (truncated) or at the
    first successful row (terminated; counted as full, the upper bound)."""
    full = meta.env_steps * act_steps
    successes = meta.extra.get("successes", [False] * len(meta.episode_lengths))
    short, terminated = 0, 0
    for chunks, success in zip(meta.episode_lengths, successes):
        if success:
            terminated += 1
        else:                                        # truncated at max_steps inside its last chunk
            short += act_steps * chunks - max_steps
    return full - short, terminated


# --------------------------------------------------------------------------- the "no Ray" reference

# --------------------------------------------------------------------------- time split

class Profiler:
    """Wraps methods of live objects (instance attributes, the classes stay untouched) with
    timers. Times are kept per call path, so a method reached from two places (robosuite's own
    sim.forward vs flowrl_ray's extra one) is told apart; exclusive time = inclusive minus the
    nested timers'."""

    def __init__(self) -> None:
        self.stack: list[list] = []                        # [path, start, child time]
        self.stats: dict[tuple, list] = {}                 # path -> [calls, inclusive s, exclusive s]

    def wrap(self, obj, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def timed(*a, **kw):
            parent = self.stack[-1][0] if self.stack else ()
            frame = [parent + (label,), time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*a, **kw)
            finally:
                self.stack.pop()
                incl = time.perf_counter() - frame[1]
                s = self.stats.setdefault(frame[0], [0, 0.0, 0.0])
                s[0] += 1
                s[1] += incl
                s[2] += incl - frame[2]
                if self.stack:
                    self.stack[-1][2] += incl
        setattr(obj, attr, timed)


def instrument(runner, prof: Profiler) -> None:
    pol = runner.policy
    prof.wrap(runner, "sample", "EnvRunner.sample")
    prof.wrap(pol, "act", "policy.act")
    prof.wrap(pol, "sample", "Euler sampling (flow_steps velocity passes, B rows)")
    prof.wrap(pol, "cfm_losses", "N_mc CFM losses (old losses, B x N_mc rows)")
    prof.wrap(pol.velocity, "forward", "velocity MLP forward")
    prof.wrap(runner.envs, "step", "vector env step (SyncVectorEnv)")
    for env in runner.envs.envs:
        prof.wrap(env, "step", "RobotEnv.step (one chunk)")
        prof.wrap(env, "reset", "RobotEnv.reset (autoreset)")
        prof.wrap(env, "step_raw", "RobotEnv.step_raw (one 20 Hz row)")
        prof.wrap(env, "raw_obs", "RobotEnv.raw_obs (observation from sim state)")
        prof.wrap(env, "observation", "RobotEnv.observation (vector assembly)")
        raw = env.raw
        prof.wrap(raw, "step", "robosuite env.step")
        prof.wrap(raw, "reset", "robosuite env.reset")
        prof.wrap(raw, "_pre_action", "controller (_pre_action: OSC + gripper)")
        prof.wrap(raw, "_update_observables", "_update_observables")
        prof.wrap(raw, "_post_action", "_post_action (reward, success)")
        prof.wrap(raw, "_get_observations", "_get_observations")
        prof.wrap(raw, "_check_success", "_check_success")
        for name in ("forward", "step1", "step2", "step"):
            if hasattr(raw.sim, name):
                prof.wrap(raw.sim, name, f"MuJoCo sim.{name}")


def profile_rows(prof: Profiler, chunk_steps: int) -> tuple[list[list], list[dict], float]:
    """Rows of a tree table: path, calls per chunk step, inclusive / exclusive ms per chunk step,
    % of EnvRunner.sample."""
    root = ("EnvRunner.sample",)
    total = prof.stats[root][1]
    paths = sorted(prof.stats)                       # lexicographic = depth-first with parents first
    # order children by inclusive time, parents before children
    def key(path):
        return tuple(-prof.stats[path[:i + 1]][1] for i in range(len(path)))
    paths.sort(key=key)
    rows, raw = [], []
    for path in paths:
        calls, incl, excl = prof.stats[path]
        if incl / total < 0.001 and len(path) > 2:
            continue
        label = "  " * (len(path) - 1) + ("└ " if len(path) > 1 else "") + path[-1]
        rows.append([label, f"{calls / chunk_steps:,.1f}", f"{1e3 * incl / chunk_steps:,.2f}",
                     f"{1e3 * excl / chunk_steps:,.2f}", f"{100 * incl / total:.1f} %"])
        raw.append({"path": list(path), "calls": calls, "inclusive_s": incl, "exclusive_s": excl})
    return rows, raw, total


def summary_split(prof: Profiler) -> dict[str, float]:
    """Seconds in: the policy's act, the vector env's step, and the rest of EnvRunner.sample."""
    total = prof.stats[("EnvRunner.sample",)][1]
    act = prof.stats.get(("EnvRunner.sample", "policy.act"), [0, 0.0])[1]
    env = prof.stats.get(("EnvRunner.sample", "vector env step (SyncVectorEnv)"), [0, 0.0])[1]
    euler = prof.stats.get(("EnvRunner.sample", "policy.act", "Euler sampling (flow_steps velocity passes, B rows)"),
                           [0, 0.0])[1]
    cfm = prof.stats.get(("EnvRunner.sample", "policy.act", "N_mc CFM losses (old losses, B x N_mc rows)"),
                         [0, 0.0])[1]
    physics = sum(v[2] for p, v in prof.stats.items() if p[-1].startswith("MuJoCo sim."))
    return {"total": total, "policy.act": act, "Euler sampling": euler, "N_mc CFM losses": cfm,
            "env step": env, "MuJoCo sim calls (all, exclusive)": physics, "rest": total - act - env}


# --------------------------------------------------------------------------- measurements

def _our_cpu_seconds() -> float:
    """CPU seconds used so far by this process and its descendants (Ray's processes, the
    multiprocessing children)."""
    table = _proc_table()
    return sum(table[p][2] for p in _descendants(table, os.getpid()) if p in table)


def _machine_busy_seconds() -> float | None:
    return LoadMonitor._busy_seconds()


@dataclass
class Samples:
    steps_per_s: list[float] = field(default_factory=list)          # low-level steps/s per round
    chunk_steps_per_s: list[float] = field(default_factory=list)
    worker_steps_per_s: list[float] = field(default_factory=list)   # inside EnvRunner.sample, per worker
    overhead_ms: list[float] = field(default_factory=list)          # round wall - slowest worker's sample time
    others_cores: list[float] = field(default_factory=list)         # load from outside this benchmark, per round
    terminated: int = 0


def run_round(round_fn, act_steps: int, max_steps: int, out: Samples | None) -> None:
    busy0, ours0 = _machine_busy_seconds(), _our_cpu_seconds()
    t0 = time.perf_counter()
    metas = round_fn()
    wall = time.perf_counter() - t0
    busy1, ours1 = _machine_busy_seconds(), _our_cpu_seconds()
    if out is None:
        return
    # Machine-wide busy CPU minus this benchmark's own processes: what else ran during the round.
    out.others_cores.append(float("nan") if busy0 is None or busy1 is None
                            else max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall)
    counted = [low_level_steps(m, act_steps, max_steps) for m in metas]
    out.steps_per_s.append(sum(s for s, _ in counted) / wall)
    out.chunk_steps_per_s.append(sum(m.env_steps for m in metas) / wall)
    out.worker_steps_per_s += [s / m.sample_time_s for (s, _), m in zip(counted, metas)]
    out.overhead_ms.append(1e3 * (wall - max(m.sample_time_s for m in metas)))
    out.terminated += sum(t for _, t in counted)


def measure(args: argparse.Namespace) -> dict:
    import ray

    from flowrl_ray.envs import env_family
    from flowrl_ray.runtime.actors import RolloutWorker

    cfg = make_config(args)
    spec = env_family(cfg.env.family).spec(cfg.env)
    act_steps, max_steps = cfg.env.act_steps, spec.max_episode_steps
    T = cfg.runtime.rollout_length

    t0 = time.perf_counter()
    single = make_runner(cfg, spec, 0, None)
    state = {k: v.clone() for k, v in single.policy.state_dict().items()}
    single.set_weights(state, 1)
    startup = {"single-process EnvRunner": time.perf_counter() - t0}

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2)
    workers = [RolloutWorker.options(num_cpus=1).remote(cfg, spec, i) for i in range(NUM_WORKERS)]
    weights_ref = ray.put(state)
    ray.get([w.set_weights.remote(weights_ref, 1) for w in workers])
    startup["ray.init + 2 RolloutWorkers"] = time.perf_counter() - t0
    worker_nice = [niceness(pid) for pid in ray.get([w.pid.remote() for w in workers])]
    pair = None
    if not args.no_mp_reference:
        t0 = time.perf_counter()
        pair = ProcessPair(cfg, spec, state, NUM_WORKERS)
        startup["2 plain processes"] = time.perf_counter() - t0

    def single_round():
        return [single.sample(T).meta]

    def ray_round(n: int):
        def round_fn():
            pairs = [w.sample.remote() for w in workers[:n]]
            return ray.get([m for m, _ in pairs])          # only the small metas, as the Trainer
        return round_fn

    configs = {"single process": (1, single_round), "ray, 1 worker": (1, ray_round(1)),
               "ray, 2 workers": (2, ray_round(2))}
    if pair is not None:
        configs["2 processes, no Ray"] = (2, pair.sample)
    samples = {name: Samples() for name in configs}

    print(f"[bench] warm-up: {args.warmup} round(s) per configuration", flush=True)
    for _ in range(args.warmup):
        for _, fn in configs.values():
            run_round(fn, act_steps, max_steps, None)
    monitor = LoadMonitor()
    names = list(configs)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            run_round(configs[name][1], act_steps, max_steps, samples[name])
        print(f"[bench] rep {rep + 1}/{args.repeats} low-level steps/s (other processes' cores): "
              + ", ".join(f"{n}: {samples[n].steps_per_s[-1]:,.0f} ({samples[n].others_cores[-1]:.2f})"
                          for n in names), flush=True)
    load = monitor.stop()

    for w in workers:
        ray.kill(w)
    if pair is not None:
        pair.close()

    profile = None
    if args.profile_rounds > 0:
        print(f"[bench] time split: {args.profile_rounds} instrumented single-process round(s)", flush=True)
        prof = Profiler()
        instrument(single, prof)
        for _ in range(args.profile_rounds):
            single.sample(T)
        chunk_steps = args.profile_rounds * T
        rows, raw, total = profile_rows(prof, chunk_steps)
        profile = {"rows": rows, "raw": raw, "chunk_steps": chunk_steps, "total_s": total,
                   "split_s": summary_split(prof),
                   # one chunk step = one policy decision for all the runner's envs
                   "uninstrumented_s_per_chunk_step":
                       args.envs_per_worker / statistics.median(samples["single process"].chunk_steps_per_s)}
    single.close()

    base = statistics.median(samples["single process"].steps_per_s)
    rows, eff = [], {}
    for name, (n, _) in configs.items():
        s = samples[name]
        med = statistics.median(s.steps_per_s)
        paired = statistics.median(r / n / b for r, b in zip(s.steps_per_s, samples["single process"].steps_per_s))
        eff[name] = {"median": med / n / base, "paired": paired}
        rows.append([name, n, med, f"{min(s.steps_per_s):,.0f}–{max(s.steps_per_s):,.0f}",
                     statistics.median(s.chunk_steps_per_s), f"{med / n / base:.3f}", f"{paired:.3f}",
                     statistics.median(s.worker_steps_per_s), statistics.median(s.overhead_ms),
                     statistics.median(s.others_cores)])
    # The same from the clean rounds only (other processes below --clean-threshold cores).
    clean = {name: [v for v, o in zip(s.steps_per_s, s.others_cores) if o < args.clean_threshold]
             for name, s in samples.items()}
    clean_rows, clean_eff = [], {}
    if clean["single process"]:
        cbase = statistics.median(clean["single process"])
        for name, (n, _) in configs.items():
            c = clean[name]
            if not c:
                clean_rows.append([name, n, 0, None, None, None])
                continue
            med = statistics.median(c)
            clean_eff[name] = med / n / cbase
            clean_rows.append([name, n, len(c), med, f"{min(c):,.0f}–{max(c):,.0f}", f"{med / n / cbase:.3f}"])
    return {"task": args.task, "obs_dim": spec.obs_dim, "max_episode_steps": max_steps, "act_steps": act_steps,
            "rows": rows, "clean_rows": clean_rows, "clean_efficiency": clean_eff, "base": base, "efficiency": eff, "worker_nice": worker_nice, "load": load,
            "startup_s": startup, "profile": profile,
            "samples": {k: vars(v) for k, v in samples.items()}}


def report(r: dict, args: argparse.Namespace, elapsed: float, quiet: str, calibration: float | None) -> str:
    eff = r["efficiency"]["ray, 2 workers"]
    verdict = "met" if eff["median"] >= TARGET_EFFICIENCY else "NOT met"
    setup = [f"- flowrl_ray revision: {git_revision()}",
             f"- task: robosuite {args.task} (robot family, low-dim obs {r['obs_dim']}-d, Panda OSC_POSE, 20 Hz, "
             f"{r['max_episode_steps']}-step episodes), action chunks [16, 7] with {r['act_steps']} rows executed per "
             f"chunk step; dataset normalisation: {args.dataset or 'none'}",
             "- policy: FPOPP.make_policy (FlowPolicy, velocity MLP [512, 512, 512], 10 Euler steps, N_mc 8 CFM "
             "losses recorded per action), random init, same weights in every configuration, 1 torch thread",
             f"- one round = one sample() call per worker: {args.envs_per_worker} envs x {args.rollout_length} chunk "
             f"steps = {args.envs_per_worker * args.rollout_length * r['act_steps']} low-level steps per worker; "
             f"{args.warmup} warm-up round(s) per configuration (excluded), then {args.repeats} interleaved timed rounds",
             "- Ray: private local `ray.init(address='local', num_cpus=2)`, RolloutWorker actors with num_cpus=1; the driver fetches only "
             "the BatchMeta (as the Trainer does)",
             f"- per-core efficiency = (steps/s / workers) / (single-process steps/s); target for 2 Ray workers >= "
             f"{TARGET_EFFICIENCY}. 'paired': median over repetitions of the same ratio within each repetition.",
             "- steps/s counts low-level 20 Hz steps (see the script's docstring); 'chunk steps/s' counts policy "
             "decisions",
             f"- before starting: {quiet}",
             (f"- machine calibration: a pure-Python CPU loop run by 2 processes at once runs at {calibration:.3f} "
              f"per core of the same loop run alone; no 2-process workload scales better here"
              if calibration is not None else "- machine calibration: skipped"),
             "- start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["startup_s"].items()),
             f"- total benchmark time: {elapsed:.0f} s"]
    headers = ["configuration", "workers", "low-level steps/s (median)", "min–max", "chunk steps/s",
               "per-core efficiency", "paired", "in-worker steps/s per worker", "overhead per round (ms)",
               "other processes (cores)"]
    notes = [f"- single process: {r['base']:,.0f} low-level steps/s; 2 Ray workers: per-core efficiency "
             f"{eff['median']:.3f} (paired {eff['paired']:.3f}), target {TARGET_EFFICIENCY}: **{verdict}**",
             f"- niceness: Ray rollout workers {r['worker_nice']}, this process (single-process baseline) {os.nice(0)}",
             f"- success-terminated episodes (last chunk counted as full): "
             + ", ".join(f"{k} {v['terminated']}" for k, v in r["samples"].items())]
    if "2 processes, no Ray" in r["efficiency"]:
        notes.append(f"- 2 plain processes (no Ray): {r['efficiency']['2 processes, no Ray']['median']:.3f} per core, "
                     f"the 2-way ceiling for this workload on this machine")
    ceff = r["clean_efficiency"].get("ray, 2 workers")
    clean_text = (f"Only the rounds during which processes outside this benchmark used < {args.clean_threshold} "
                  f"cores (machine-wide busy CPU minus this benchmark's process tree, per round):\n\n"
                  + (md_table(["configuration", "workers", "clean rounds", "low-level steps/s (median)", "min–max",
                               "per-core efficiency"], r["clean_rows"]) if r["clean_rows"] else
                     "(no clean single-process round)")
                  + "\n\n" + (f"- 2 Ray workers, clean rounds: per-core efficiency {ceff:.3f}, target "
                               f"{TARGET_EFFICIENCY}: **{'met' if ceff >= TARGET_EFFICIENCY else 'NOT met'}**"
                               if ceff is not None else "- 2 Ray workers: no clean round"))
    parts = ["## Setup\n\n" + "\n".join(setup),
             "## Throughput, all rounds\n\n" + md_table(headers, r["rows"]) + "\n\n" + "\n".join(notes),
             "## Throughput, clean rounds\n\n" + clean_text,
             "## CPU load during the timed rounds\n\n" + "\n".join(load_lines(r["load"]))]
    p = r["profile"]
    if p is not None:
        s = p["split_s"]
        tot = s["total"]
        pct = lambda k: f"{100 * s[k] / tot:.1f} %"           # noqa: E731
        per = lambda k: f"{1e3 * s[k] / p['chunk_steps']:.1f} ms"   # noqa: E731
        split = [f"- policy.act (Euler sampling + N_mc CFM losses + noise draws): {pct('policy.act')} "
                 f"({per('policy.act')} per chunk step of {args.envs_per_worker} envs), of which Euler sampling "
                 f"{pct('Euler sampling')} and the N_mc CFM losses {pct('N_mc CFM losses')}",
                 f"- env step (vector env, {args.envs_per_worker} robosuite envs x {r['act_steps']} rows, resets "
                 f"included): {pct('env step')} ({per('env step')} per chunk step); MuJoCo sim calls alone "
                 f"(forward / step1 / step2, exclusive): {pct('MuJoCo sim calls (all, exclusive)')}",
                 f"- EnvRunner bookkeeping (buffers, tensor conversion): {pct('rest')}",
                 f"- instrumented rounds: {1e3 * tot / p['chunk_steps']:.1f} ms per chunk step vs "
                 f"{1e3 * p['uninstrumented_s_per_chunk_step']:.1f} ms uninstrumented (median of the timed "
                 f"single-process rounds): the timers' own cost"]
        parts.append(f"## Where the single-process loop's time goes ({p['chunk_steps']} chunk steps, instrumented)\n\n"
                     + "\n".join(split) + "\n\nPer chunk step (all envs); exclusive = minus the nested rows; rows "
                     "under 0.1 % left out:\n\n"
                     + md_table(["call path", "calls / chunk step", "inclusive ms", "exclusive ms", "% of sample"],
                                p["rows"]))
    return "\n\n".join(parts)


def main() -> None:
    args = parse_args()
    os.chdir(REPO_ROOT)
    import ray
    if args.ray_worker_niceness is not None:
        os.environ["RAY_worker_niceness"] = str(args.ray_worker_niceness)
    quiet = wait_for_quiet(args.wait_quiet)
    print(f"[bench] {quiet}", flush=True)
    t0 = time.perf_counter()
    calibration = None
    if not args.no_calibration:
        from rollout_throughput import machine_two_way_scaling
        calibration = machine_two_way_scaling()
        print(f"[bench] machine 2-way scaling of a pure CPU loop: {calibration:.3f} per core", flush=True)
    try:
        result = measure(args)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    elapsed = time.perf_counter() - t0
    write_results(args.output, f"Robot rollout throughput (FPO++ flow policy, robosuite {args.task}): "
                  f"Ray rollout workers vs a single process", report(result, args, elapsed, quiet, calibration))
    store = write_json(RESULTS_DIR / f"{args.output}.json",
                       {"benchmark": "robot_rollout", "args": vars(args), "machine": machine_info(),
                        "revision": git_revision(), "quiet": quiet, "calibration": calibration,
                        "elapsed_s": elapsed, "target_efficiency": TARGET_EFFICIENCY, "result": result})
    print(f"[bench] raw numbers written to {os.path.relpath(store, Path.cwd())}", flush=True)


if __name__ == "__main__":
    main()
