"""Learner-group update throughput: one update on 1 learner process vs N gloo ranks, same global batch.

Run from the repository root (a few minutes on 2 cores with the defaults):

    .venv/bin/python benchmarks/learner_group.py
    .venv/bin/python benchmarks/learner_group.py --ranks 1 2 --reps 5 --algorithms fpopp
    .venv/bin/python benchmarks/learner_group.py --ranks 1 --devices cpu cuda --algorithms ppo fpopp fed_grpo

Each configuration runs in fresh processes started with ``torch.multiprocessing`` (one torch
thread each, as a learner actor has by default): with 1 rank, a plain process (no process group,
today's learner); with N > 1, N processes joined in a gloo process group, each holding the whole
batch and updating on its share of every minibatch, the gradients summed by one all-reduce per
optimiser step (``flowrl_ray/optim.py``). Every process builds the algorithm from the same seed
and prepares the same rollout batches; one untimed update, then ``--reps`` timed updates, each
started after a barrier; an update's time is the slowest rank's.

- ``fpopp``: FPO++ with ``configs/fpopp/lift_state.yaml``'s networks and loss (512 x 3 velocity
  MLP, N_mc 8, chunks of 16), 1,000 samples in minibatches of 500, 1 epoch
  (``benchmarks/fpopp_learner.py``'s batch).
- ``ppo``: Gaussian PPO with ``configs/ppo/halfcheetah.yaml``'s networks and update (64 x 64,
  minibatches of 64, 10 epochs) on 2,048 samples of a 17-d observation, 6-d action.
- ``fed_grpo``: FED-GRPO with ``configs/fed_grpo/qm9_small.yaml``'s EDM (4 x 64 EGNN, 100 steps,
  the last 40 branched) and update (micro-batches of 8, KL on): one iteration's 2 prompts x 8
  molecules, generated on the learner's device, with force and energy rewards drawn at random
  (the update's cost does not depend on their values).

``--devices cpu cuda`` (with ``--ranks 1``) times the one-process learner on each device: the
learner actor's update on a GPU against the same update on one CPU thread (CUDA time is taken
after ``torch.cuda.synchronize``). The ranks are gloo processes on the CPU.

Reported: median update time per rank count, the speed-up over one process and the parallel
efficiency (speed-up / ranks). With ranks > cores, or other work on the machine (see the load
lines), the ranks share cores and the speed-up says so. Results: stdout,
``benchmarks/results/learner_group.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import LoadMonitor, RESULTS_DIR, git_revision, load_lines, machine_info, md_table, write_json, write_results  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--algorithms", nargs="+", default=["fpopp", "ppo"], choices=["fpopp", "ppo", "fed_grpo"])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--devices", nargs="+", default=["cpu"], choices=["cpu", "cuda"],
                   help="devices of the one-process learner (cuda: with --ranks 1)")
    p.add_argument("--reps", type=int, default=5, help="timed updates per configuration")
    p.add_argument("--output", default="learner_group", help="results name (benchmarks/results/<name>.md/.json)")
    args = p.parse_args()
    if "cuda" in args.devices:
        import torch
        if args.ranks != [1]:
            p.error("--devices cuda times the one-process learner: use --ranks 1")
        if not torch.cuda.is_available():
            p.error("--devices cuda: torch sees no CUDA device")
    return args


def _fpopp(device):
    import torch

    import fpopp_learner
    from flowrl_ray.envs import EnvSpec
    args = argparse.Namespace(workers=2, envs_per_worker=25, chunk_steps=20, obs_dim=19, horizon=16, n_mc=8,
                              minibatch=500, hidden=[512, 512, 512], critic_hidden=[256, 256, 256],
                              flow_steps=10, seed=0)
    cfg = fpopp_learner.make_config(args)
    algo = fpopp_learner.make_algo(cfg, EnvSpec((19,), 7), device)
    sampler = algo if device.type == "cpu" else fpopp_learner.make_algo(cfg, EnvSpec((19,), 7))   # same weights
    torch.manual_seed(1)
    return algo, fpopp_learner.rollout_batches(sampler, args)      # the batch is sampled on the CPU


def _ppo(device):
    import torch

    from flowrl_ray.algorithms.ppo import PPO
    from flowrl_ray.batch import Batch, BatchMeta
    from flowrl_ray.config import load_config
    from flowrl_ray.envs import EnvSpec
    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "configs/ppo/halfcheetah.yaml",
                      ["runtime.num_workers=1", "runtime.envs_per_worker=1", "runtime.rollout_length=2048"])
    torch.manual_seed(0)
    algo = PPO(cfg, EnvSpec((17,), 6), device)
    g = torch.Generator().manual_seed(1)
    t, n = 2048, 1
    obs = torch.randn(t, n, 17, generator=g)
    sampler = algo
    if device.type != "cpu":                          # the batch is sampled on the CPU, same weights
        sampler = PPO(cfg, EnvSpec((17,), 6), torch.device("cpu"))
        sampler.policy.load_state_dict(algo.policy.state_dict())
    _, rec = sampler.policy.act(obs.reshape(-1, 17), generator=g)
    data = {"obs": obs.numpy(), "actions": rec["actions"].reshape(t, n, 6).numpy(),
            "logp": rec["logp"].reshape(t, n).numpy(), "rewards": torch.randn(t, n, generator=g).numpy(),
            "terminated": torch.zeros(t, n, dtype=torch.bool).numpy(),
            "truncated": torch.zeros(t, n, dtype=torch.bool).numpy(),
            "final_obs": torch.zeros(t, n, 17).numpy(), "last_obs": torch.randn(n, 17, generator=g).numpy()}
    return algo, [Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=t * n))]


def _fed_grpo(device):
    import numpy as np
    import torch

    from flowrl_ray.algorithms.fed_grpo import SCORE_KEYS, FEDGRPO
    from flowrl_ray.batch import Batch, BatchMeta
    from flowrl_ray.config import load_config
    from flowrl_ray.envs import EnvSpec
    repo = Path(__file__).resolve().parents[1]
    cfg = load_config(repo / "configs/fed_grpo/qm9_small.yaml", [])
    torch.manual_seed(0)
    algo = FEDGRPO(cfg, EnvSpec((1,), 1), device)
    g = np.random.default_rng(1)
    batches = []
    for chunk in algo.generate(2):
        k = len(chunk["ids"])
        data = {key: np.zeros(k, np.float32) for key in SCORE_KEYS}
        data.update(ids=chunk["ids"], force_reward=g.normal(size=k).astype(np.float32),
                    energy_reward=g.normal(size=k).astype(np.float32),
                    smiles=np.array([""] * k, dtype=object), reason=np.array(["ok"] * k, dtype=object))
        batches.append(Batch(data, BatchMeta(0, 0, k)))
    return algo, batches


def _rank(rank: int, world: int, init: str, name: str, reps: int, device: str, out: dict) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cuda = device == "cuda"
    try:
        algo, batches = {"fpopp": _fpopp, "ppo": _ppo, "fed_grpo": _fed_grpo}[name](torch.device(device))
        prepared = algo.prepare(batches)
        algo.update(prepared)                                         # untimed
        times = []
        for _ in range(reps):
            if world > 1:
                dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            algo.update(prepared)
            if cuda:
                torch.cuda.synchronize()
            dt = torch.tensor([time.perf_counter() - t0])
            if world > 1:
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)            # the slowest rank's
            times.append(float(dt))
        if rank == 0:
            out["times"] = times
    finally:
        if world > 1:
            dist.destroy_process_group()


def measure(name: str, world: int, reps: int, device: str = "cpu") -> list[float]:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(world, f"file://{tmp}/rendezvous", name, reps, device, out), nprocs=world, join=True)
        return list(out["times"])


def _key(name: str, world: int, device: str) -> str:
    """The results key: name/ranks on the CPU (as before), name/ranks/cuda on the GPU."""
    return f"{name}/{world}" + ("" if device == "cpu" else f"/{device}")


def main() -> int:
    args = parse_args()
    monitor = LoadMonitor()
    results = {}
    # (name, ranks, device): the first is the baseline of each algorithm
    configs = [(name, world, device) for name in args.algorithms for device in args.devices for world in args.ranks]
    for name, world, device in configs:
        times = measure(name, world, args.reps, device)
        results[_key(name, world, device)] = times
        print(f"[bench] {name} {world} rank(s) on {device}: median {statistics.median(times):.3f} s per update",
              flush=True)
    load = monitor.stop()
    rows = []
    for name, world, device in configs:
        base = statistics.median(results[_key(name, args.ranks[0], args.devices[0])])
        times = results[_key(name, world, device)]
        med = statistics.median(times)
        speedup = base / med
        rows.append([name, world, device, f"{med:.3f}", f"{min(times):.3f}-{max(times):.3f}", f"{speedup:.2f}x",
                     f"{speedup / (world / args.ranks[0]):.0%}" if device == args.devices[0] else "-"])
    body = ("## Update time\n\n"
            + md_table(["algorithm", "ranks", "device", "median s / update", "min-max", "speed-up", "efficiency"],
                       rows)
            + "\n\n## Load while it ran\n\n" + "\n".join(load_lines(load)) + "\n")
    write_results(args.output, "Learner group: update time on 1 process vs N gloo ranks", body)
    write_json(RESULTS_DIR / f"{args.output}.json",
        {"results": results, "ranks": args.ranks, "devices": args.devices, "reps": args.reps, "load": load,
         "machine": machine_info(), "revision": git_revision()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
