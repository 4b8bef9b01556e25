"""Molecule force-field rewards: GFN2-xTB scoring actors on Ray vs a bare tblite loop in one process.

Run from the repository root (about 1-2 minutes on 2 cores with the defaults, plus up to
--wait-quiet seconds waiting for an idle machine first):

    .venv/bin/python benchmarks/molecule_rewards.py
    .venv/bin/python benchmarks/molecule_rewards.py --molecules 40 --repeats 1 --output molecule_rewards_smoke

The molecules are real QM9 ones (DFT geometries), a fixed random sample of the whole set
(``flowrl_ray.envs.molecules.qm9.load_qm9``; qm9pack's first CSV if that loader is missing), so
their sizes follow QM9's (18 atoms on average). A round scores ``2 x --molecules`` molecules in
every configuration (the same ones); configurations are interleaved round by round:

- ``tblite loop``: the baseline, in this process (one thread): per molecule a
  ``tblite.interface.Calculator("GFN2-xTB", ...)``, ``singlepoint()``, energy and gradient.
  Nothing else: no checks, no child process, no chemistry.
- ``scorer, 1 process``: ``MoleculeScorer`` (the ``molecules`` family's scorer: overlap/NaN
  checks, GFN2 in its child process, EDM stability, RDKit validity + SMILES, rewards) called here.
- ``ray, 2 actors``: two Ray actors (``num_cpus=1``, local ``ray.init(address="local", num_cpus=2)``) that each
  hold a scorer from ``make_scorer`` — what a scoring RolloutWorker holds — and score half of the
  round's molecules; only the small reward arrays come back.
- ``2 tblite loops, 2 processes``: the baseline's loop in two pool processes at once, half the
  round each: what two concurrent GFN2 calls get from this machine (shared cache and memory
  bandwidth), the ceiling for two actors (reported, not the target's baseline).
- ``mmff scorer, 1 process`` (for the ms/molecule of the cheaper backend; not in the ratio).

Reported: median molecules/s over ``--repeats`` timed rounds (after ``--warmup``), ms per
molecule, and ``ratio per core = (ray molecules/s / 2) / tblite-loop molecules/s`` (target >=
0.85). The scorer does real work beyond the force field (about 1 ms of RDKit per molecule), which
the bare loop does not. Also: molecules per CPU-second of this benchmark's process tree, and the
niceness of the actors (Ray starts workers at nice 15 unless ``--ray-worker-niceness``; on a
shared machine that alone moves the ratio). Results go to stdout and
``benchmarks/results/<output>.md`` / ``.json``. No assertion is made.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"              # before numpy/tblite load: the baseline runs one thread

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS_DIR, LoadMonitor, _descendants, _proc_table, git_revision, load_lines,  # noqa: E402
                     machine_info, md_table, write_json, wait_for_quiet, write_results)
from _runners import niceness  # noqa: E402

TARGET = 0.85


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--molecules", type=int, default=200, help="molecules per actor per round")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds per configuration")
    p.add_argument("--ray-worker-niceness", type=int, default=None,
                   help="RAY_worker_niceness for the local Ray (default: Ray's, 15)")
    p.add_argument("--wait-quiet", type=float, default=30,
                   help="first wait up to this many seconds for the machine to be idle (0: don't)")
    p.add_argument("--output", default="molecule_rewards", help="results name: benchmarks/results/<name>.md and .json")
    return p.parse_args()


def load_pool(n: int, seed: int = 0) -> list:
    """n QM9 molecules (positions [k, 3] Å, atom_types [k]) drawn without replacement."""
    import numpy as np
    rng = np.random.default_rng(seed)
    try:
        from flowrl_ray.envs.molecules.qm9 import load_qm9
        data = load_qm9()
        return [data.molecule(int(i)) for i in rng.choice(len(data), n, replace=False)]
    except ImportError:
        import csv

        from flowrl_ray.envs.molecules.chemistry import ATOM_TYPES
        path = Path(sys.prefix) / "lib/python3.11/site-packages/qm9pack/data/qm9_part1.csv"
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        out = []
        for i in rng.choice(len(rows), n, replace=False):
            xyz = np.array(rows[i]["XYZ_Ang"].replace("[", "").replace("]", "").split(","), dtype=float)
            types = [ATOM_TYPES.index(s.strip(" '")) for s in rows[i]["Elements"].strip("[]").split(",")]
            out.append((xyz.reshape(-1, 3), np.array(types)))
        return out


def env_cfg(backend: str = "gfn2"):
    return SimpleNamespace(family="molecules", id="qm9", kwargs={"backend": backend})


def samples(mols: list) -> dict:
    import numpy as np
    return {"ids": np.arange(len(mols)), "positions": [p for p, _ in mols], "atom_types": [t for _, t in mols]}


class _Scoring:
    """What a scoring actor holds: a scorer from the family's factory."""

    def __init__(self, backend: str, worker_id: int):
        from flowrl_ray.envs.molecules import make_scorer
        self.scorer = make_scorer(env_cfg(backend), seed=worker_id, worker_id=worker_id)

    def score(self, s: dict) -> dict:
        b = self.scorer.score(s)
        return {"force_reward": b["force_reward"], "energy_reward": b["energy_reward"],
                "ff_s": float(b["ff_seconds"].sum()), "reasons": b.meta.extra["reasons"]}

    def pids(self) -> list[int]:
        return [os.getpid(), self.scorer.ff.pid]

    def close(self) -> bool:
        self.scorer.close()
        return True


def tblite_loop(mols: list) -> None:
    import numpy as np
    from tblite.interface import Calculator

    from flowrl_ray.envs.molecules.chemistry import ATOMIC_NUMBERS
    z = np.asarray(ATOMIC_NUMBERS)
    for pos, types in mols:
        calc = Calculator("GFN2-xTB", z[types], pos / 0.529177210903)
        calc.set("verbosity", 0)
        calc.set("max-iter", 250)
        res = calc.singlepoint()
        res.get("energy"), res.get("gradient")


def timed_tblite_loop(mols: list) -> float:
    """Seconds of :func:`tblite_loop` over ``mols`` (run in a pool process)."""
    t = time.perf_counter()
    tblite_loop(mols)
    return time.perf_counter() - t


def tree_cpu_s() -> float:
    """CPU seconds used so far by this process and its descendants (Ray, actors, FF children)."""
    table = _proc_table()
    return sum(table[pid][2] for pid in _descendants(table, os.getpid()) if pid in table)


def main() -> None:
    args = parse_args()
    quiet = wait_for_quiet(args.wait_quiet)
    print(f"[bench] {quiet}", flush=True)
    if args.ray_worker_niceness is not None:
        os.environ["RAY_worker_niceness"] = str(args.ray_worker_niceness)
    import ray

    rounds = args.warmup + args.repeats
    per_round = 2 * args.molecules
    pool = load_pool(per_round * rounds)
    atoms = statistics.fmean(len(t) for _, t in pool)
    print(f"[bench] {len(pool)} QM9 molecules, {atoms:.1f} atoms on average", flush=True)
    t0 = time.perf_counter()
    single, mmff = _Scoring("gfn2", 0), _Scoring("mmff", 0)
    startup = {"scorer (GFN2 child start)": time.perf_counter() - t0}
    tblite_loop(pool[:2])                                  # import + first-call costs out of the rounds
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    loops = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    list(loops.map(timed_tblite_loop, [pool[:2], pool[2:4]]))     # start both processes, import tblite
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    Actor = ray.remote(num_cpus=1)(_Scoring)
    actors = [Actor.remote("gfn2", i) for i in range(2)]
    pids = ray.get([a.pids.remote() for a in actors])
    startup["ray.init + 2 scoring actors"] = time.perf_counter() - t0

    def run_ray(mols: list) -> tuple[float, float]:
        half = len(mols) // 2
        t = time.perf_counter()
        out = ray.get([a.score.remote(samples(part)) for a, part in zip(actors, (mols[:half], mols[half:]))])
        return time.perf_counter() - t, sum(o["ff_s"] for o in out)

    def run_local(scoring: _Scoring):
        def run(mols: list) -> tuple[float, float]:
            t = time.perf_counter()
            out = scoring.score(samples(mols))
            return time.perf_counter() - t, out["ff_s"]
        return run

    def run_loop(mols: list) -> tuple[float, float]:
        t = time.perf_counter()
        tblite_loop(mols)
        dt = time.perf_counter() - t
        return dt, dt

    def run_two_loops(mols: list) -> tuple[float, float]:
        half = len(mols) // 2
        t = time.perf_counter()
        ff_s = sum(loops.map(timed_tblite_loop, [mols[:half], mols[half:]]))
        return time.perf_counter() - t, ff_s

    configs = {"tblite loop": run_loop, "scorer, 1 process": run_local(single), "ray, 2 actors": run_ray,
               "2 tblite loops, 2 processes": run_two_loops, "mmff scorer, 1 process": run_local(mmff)}
    rates = {k: [] for k in configs}
    per_cpu = {k: [] for k in configs}
    ff_ms = {k: [] for k in configs}
    names = list(configs)
    monitor = LoadMonitor()
    for r in range(rounds):
        mols = pool[r * per_round:(r + 1) * per_round]
        for name in names[r % len(names):] + names[:r % len(names)]:       # rotate the order
            cpu0 = tree_cpu_s()
            dt, ff_s = configs[name](mols)
            cpu = tree_cpu_s() - cpu0
            if r >= args.warmup:
                rates[name].append(len(mols) / dt)
                per_cpu[name].append(len(mols) / cpu if cpu > 0 else float("nan"))
                ff_ms[name].append(1e3 * ff_s / len(mols))
            print(f"[bench] round {r} {'(warmup) ' if r < args.warmup else ''}{name}: {len(mols)} molecules in "
                  f"{dt:.2f} s = {len(mols) / dt:.1f}/s", flush=True)
    load = monitor.stop()
    nice = {"actors": [niceness(p[0]) for p in pids], "actors' FF children": [niceness(p[1]) for p in pids],
            "this process": os.nice(0)}
    ray.get([a.close.remote() for a in actors])
    single.close()
    mmff.close()
    ray.shutdown()
    loops.shutdown()

    base = statistics.median(rates["tblite loop"])
    base_cpu = statistics.median(per_cpu["tblite loop"])
    rows, result = [], {"args": vars(args), "startup_s": startup, "machine": machine_info(), "git": git_revision(),
                        "mean_atoms": atoms, "niceness": nice, "load": load, "configs": {}}
    for name, procs in (("tblite loop", 1), ("scorer, 1 process", 1), ("ray, 2 actors", 2),
                        ("2 tblite loops, 2 processes", 2), ("mmff scorer, 1 process", 1)):
        med, cpu_med = statistics.median(rates[name]), statistics.median(per_cpu[name])
        ratio = med / procs / base
        rows.append([name, procs, med, 1e3 / med * procs, statistics.median(ff_ms[name]), ratio, cpu_med,
                     cpu_med / base_cpu])
        result["configs"][name] = {"molecules_per_s": rates[name], "median": med, "ms_per_molecule": 1e3 / med * procs,
                                   "ff_ms_per_molecule": statistics.median(ff_ms[name]), "ratio_per_core": ratio,
                                   "molecules_per_cpu_s": per_cpu[name], "cpu_efficiency": cpu_med / base_cpu}
    two = result["configs"]["ray, 2 actors"]["ratio_per_core"]
    ceiling = result["configs"]["2 tblite loops, 2 processes"]["ratio_per_core"]
    table = md_table(["configuration", "processes", "median molecules/s", "ms/molecule/process", "FF ms/molecule",
                      "ratio per core", "molecules per CPU-s", "CPU efficiency"], rows)
    body = (f"## Throughput\n\n{table}\n\n"
            f"- ratio per core, 2 Ray actors vs the tblite loop: {two:.2f} (target >= {TARGET}: "
            f"{'met' if two >= TARGET else 'not met'})\n"
            f"- two bare tblite loops at once, one per core, reach {ceiling:.2f} per core: what two "
            f"concurrent GFN2 calls get from this machine; the Ray actors reach {two / ceiling:.2f} of it\n"
            f"- FF ms/molecule: time inside the force-field call (the scorer's child process); the rest of a "
            f"scorer's time is checks, RDKit validity/SMILES, stability, rewards and the pipe\n"
            f"- molecules per CPU-s: per CPU-second used by this benchmark's process tree (driver, Ray, actors, "
            f"their force-field children); CPU efficiency: relative to the tblite loop\n"
            f"- {per_round} QM9 molecules per round ({atoms:.1f} atoms on average over the pool), {args.warmup} "
            f"warmup + {args.repeats} timed rounds, configurations interleaved\n"
            f"- niceness: {nice}\n"
            f"- startup: " + "; ".join(f"{k} {v:.1f} s" for k, v in startup.items()) + "\n"
            f"- git: {result['git']}\n\n## CPU load during the run\n\n{quiet}\n\n" + "\n".join(load_lines(load)) + "\n")
    write_results(args.output, "Molecule force-field rewards: GFN2-xTB scoring actors vs a tblite loop", body)
    out_json = RESULTS_DIR / f"{args.output}.json"
    write_json(out_json, result)
    print(f"[bench] json: {out_json}", flush=True)


if __name__ == "__main__":
    main()
