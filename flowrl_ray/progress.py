"""Progress lines: no Ray, no terminal tricks, one line per update (readable in job logs).
:class:`CountProgress` for long work counted in items (evaluation episodes, demos),
:class:`Progress` for the training loop's iterations."""

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


class Progress:
    """One line per iteration with throughput and ETA (readable in job logs, no terminal tricks).

    Env steps are simulator steps; where the policy emits action chunks (robot tasks: each runs
    up to ``env.act_steps`` simulator steps) the row's ``chunks`` follow in brackets."""

    def __init__(self, total: int, label: str, start_iteration: int = 0, stream=None):
        self.total, self.label, self.stream = total, label, stream or sys.stdout
        self.start_iteration, self.t0 = start_iteration, time.perf_counter()
        self.t_loop = self.t0

    def begin(self) -> None:
        """The iterations start now: the ETA extrapolates their time only (what ran before, such
        as the starting policy's evaluation, stays in ``elapsed``)."""
        self.t_loop = time.perf_counter()

    def update(self, row: dict) -> None:
        it = row["iteration"]
        done = it - self.start_iteration
        now = time.perf_counter()
        elapsed = now - self.t0
        eta = (now - self.t_loop) / done * (self.total - it) if done > 0 else float("nan")
        ret = row.get("episode_return_mean")
        chunks = f" ({row['chunks']:,} chunks)" if row.get("chunks") else ""
        parts = [f"[{self.label}] it {it}/{self.total}", f"env steps {row.get('env_steps', 0):,}{chunks}",
                 f"return {ret:.1f}" if isinstance(ret, (int, float)) else "return -"]
        if row.get("eval/return_mean") is not None:
            parts.append(f"eval {row['eval/return_mean']:.1f}")
        parts += [f"{row.get('env_steps_per_s', 0):,.0f} env steps/s",
                  f"elapsed {format_duration(elapsed)}",
                  f"ETA {format_duration(eta)}" if math.isfinite(eta) else "ETA -"]
        if row.get("worker_restarts"):
            parts.append(f"restarts {row['worker_restarts']}")
        print(" | ".join(parts), file=self.stream, flush=True)
