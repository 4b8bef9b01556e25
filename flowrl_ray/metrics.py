"""The metrics file of a run (``metrics.jsonl``: one JSON row per iteration, NaN/inf written as
null), read and cut back on resume. No Ray: plotting, benchmarks and the runtime read it alike.
The sinks that write it (TensorBoard, Tune, W&B, MLflow) are in flowrl_ray.runtime.metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

from flowrl_ray.utils import atomic_write_text


def json_safe(value):
    """JSON-safe: NaN/inf become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue   # a line cut by a crash mid-write
    return rows


def truncate_metrics(run_dir: str | Path, last_iteration: int) -> None:
    """Drop rows after `last_iteration` (used on resume so the file matches the checkpoint)."""
    rows = [r for r in read_metrics(run_dir) if r.get("iteration", 0) <= last_iteration]
    atomic_write_text(Path(run_dir) / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
