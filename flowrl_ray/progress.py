"""Progress lines for long work counted in items (evaluation episodes, demos): no Ray, no
terminal tricks, one line per update (readable in job logs). The training loop's per-iteration
line is :class:`flowrl_ray.runtime.metrics.Progress`."""

from __future__ import annotations

import math
import sys
import time

from flowrl_ray.utils import format_duration


class CountProgress:
    """A progress line for long work counted in items (episodes, demos):
    ``[label] 8/20 episodes | 2.1 s/episode | elapsed 17s | ETA 25s``, one line per update."""

    def __init__(self, total: int, label: str, unit: str = "episodes", stream=None):
        self.total, self.label, self.unit = total, label, unit
        self.stream, self.t0 = stream or sys.stdout, time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        """``done`` items of ``total`` so far; ``note`` goes in brackets after the count."""
        elapsed = time.perf_counter() - self.t0
        per = elapsed / done if done > 0 else float("nan")
        eta = per * (self.total - done)
        one = self.unit[:-1] if self.unit.endswith("s") else self.unit
        parts = [f"[{self.label}] {done}/{self.total} {self.unit}" + (f" ({note})" if note else ""),
                 f"{per:.1f} s/{one}" if math.isfinite(per) else f"- s/{one}",
                 f"elapsed {format_duration(elapsed)}",
                 f"ETA {format_duration(eta)}" if math.isfinite(eta) else "ETA -"]
        print(" | ".join(parts), file=self.stream, flush=True)
