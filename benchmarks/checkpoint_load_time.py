"""What loading a checkpoint costs, the way resume reads it now against the full unpickler it
replaced, paired on the same file.

    .venv/bin/python benchmarks/checkpoint_load_time.py RUN_DIR [--repeats 30]

Both paths read the run's newest checkpoint whole and decode every rollout worker's state and its
env snapshot (the data only; rebuilding the simulators afterwards is the same work either way):

- now: ``load_torch_file`` (torch's weights-only unpickler plus numpy's arrays and dtypes), the
  worker states through ``restricted_loads`` and the snapshots through the family's
  ``read_snapshot`` (plain data and the family's own config classes);
- before: ``torch.load(weights_only=False)`` and ``pickle.loads``.

The two alternate within each repeat (which one goes first alternates too), after one untimed
read of each that warms the page cache. Reported: the median and 10th-90th percentiles of each, and
the median of the paired ratios (now / before). Results: ``<results-dir>/<output>.{json,md}``.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, git_revision, machine_info, md_table, write_json, write_results  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run directory with at least one checkpoint")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--output", default="checkpoint_load_time")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    import numpy as np
    import torch

    from flowrl_ray.checkpoint import latest_checkpoint
    from flowrl_ray.config import load_config
    from flowrl_ray.envs import env_family
    from flowrl_ray.utils import load_torch_file, restricted_loads

    args = parse_args(argv)
    run = Path(args.run)
    path = latest_checkpoint(run)
    if path is None:
        raise SystemExit(f"{run}: no checkpoint")
    family = env_family(load_config(run / "config.yaml").env.family)

    def now():
        ckpt = load_torch_file(path)
        for blob in ckpt.get("workers") or []:
            state = restricted_loads(blob, "worker state") if blob is not None else None
            if state is not None and state.get("envs") is not None:
                family.read_snapshot(state["envs"])
        return ckpt

    def before():
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        for blob in ckpt.get("workers") or []:
            state = pickle.loads(blob) if blob is not None else None
            if state is not None and state.get("envs") is not None:
                pickle.loads(state["envs"])
        return ckpt

    ckpt = now()
    before()
    times = {"now": [], "before": []}
    for i in range(args.repeats):
        for name in (("now", "before") if i % 2 == 0 else ("before", "now")):
            t0 = time.perf_counter()
            (now if name == "now" else before)()
            times[name].append(time.perf_counter() - t0)
    ratio = np.asarray(times["now"]) / np.asarray(times["before"])
    stats = {k: {"median_ms": 1e3 * float(np.median(v)), "p10_ms": 1e3 * float(np.percentile(v, 10)),
                 "p90_ms": 1e3 * float(np.percentile(v, 90))} for k, v in times.items()}
    workers = [b for b in ckpt.get("workers") or [] if b is not None]
    size = path.stat().st_size
    rows = [[k, f"{v['median_ms']:.1f}", f"{v['p10_ms']:.1f}-{v['p90_ms']:.1f}"] for k, v in stats.items()]
    body = (f"Checkpoint: `{path}` ({size / 2**20:.1f} MiB, {len(workers)} worker states of "
            f"{', '.join(f'{len(b) / 1024:.0f} KiB' for b in workers) or 'none'}), {args.repeats} paired repeats.\n\n"
            + md_table(["path", "median ms", "10th-90th percentile ms"], rows)
            + f"\n\nnow / before, median of the paired ratios: {float(np.median(ratio)):.3f} "
              f"(10th-90th percentile {float(np.percentile(ratio, 10)):.3f}-{float(np.percentile(ratio, 90)):.3f}).\n")
    write_results(args.output, "Checkpoint load time: weights-only and plain-data reads vs the full unpickler",
                  body, results_dir=Path(args.results_dir))
    results = {"checkpoint": str(path), "bytes": size, "worker_states": len(workers), "repeats": args.repeats,
               "times": stats, "ratio_median": float(np.median(ratio)),
               "ratio_p10_p90": [float(np.percentile(ratio, 10)), float(np.percentile(ratio, 90))],
               "machine": machine_info(), "git": git_revision()}
    write_json(Path(args.results_dir) / f"{args.output}.json", results)
    return results


if __name__ == "__main__":
    main()
