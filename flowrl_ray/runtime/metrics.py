"""Metrics sinks: metrics.jsonl, TensorBoard, Tune, W&B and MLflow (flowrl_ray.runtime.tracking);
the progress line. The Ray dashboard's gauges: flowrl_ray.runtime.dashboard."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from flowrl_ray.utils import atomic_write_text, format_duration


def _clean(value):
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


def report_tracker_failure(label: str, error: Exception, stream=None) -> None:
    """The one line a failing tracker (W&B, MLflow) gets; the run goes on without it."""
    print(f"[flowrl_ray] {label} logging failed: {type(error).__name__}: {error}; "
          f"the run goes on without it", file=stream or sys.stderr, flush=True)


def read_video(path: Path) -> tuple:
    """Frames [T, H, W, 3] uint8 and frames per second of a video file (imageio's ffmpeg)."""
    import imageio.v3 as iio
    frames = iio.imread(path)
    fps = float(iio.immeta(path).get("fps") or 10.0)
    return frames, fps


def tensorboard_video(writer, tag: str, frames, fps: float, step: int) -> None:
    """A video in TensorBoard's own format, as `SummaryWriter.add_video` writes it: an animated
    GIF in an image summary. Encoded here with Pillow because add_video's encoder needs
    `moviepy.editor`, which moviepy 2 no longer has."""
    import io

    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary
    _, h, w, c = frames.shape
    buffer = io.BytesIO()
    images = [Image.fromarray(f) for f in frames]
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:],
                   duration=max(1, round(1000 / fps)), loop=0)         # ms per frame
    image = Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=buffer.getvalue())
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


class MetricsLogger:
    """Writes each iteration's metrics to every sink that is switched on.

    `trackers` are open W&B / MLflow runs (flowrl_ray.runtime.tracking); one that raises is
    reported once and dropped: the run goes on without it."""

    def __init__(self, run_dir: Path, run_name: str, tensorboard: bool = True,
                 tune: bool = False, purge_step: int | None = None,
                 trackers: list | None = None, stream=None):
        self.run_dir, self.run_name = Path(run_dir), run_name
        self.trackers = list(trackers or [])
        self._stream = stream or sys.stderr
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)
        self._tune = tune

    def log(self, row: dict) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        step = row.get("env_steps", row.get("iteration", 0))
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "env_steps":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._tune:
            from ray import tune
            tune.report({k: v for k, v in row.items() if v is not None})
        self._to_trackers("log", row, step)

    def log_media(self, path: str | Path, step: int, caption: str = "") -> None:
        """A picture of behaviour written under the run directory (a PNG, or an MP4 video) goes
        to every sink that shows media, under the tag `<folder>/<stem>` (e.g. plots/learning_curve,
        videos/iter_0010_0_success); W&B and MLflow also get the caption / the file itself."""
        path = Path(path)
        key = f"{path.parent.name}/{path.stem}"
        suffix = path.suffix.lower()
        if self._tb is not None and suffix == ".png":
            import numpy as np
            from PIL import Image
            image = np.asarray(Image.open(path).convert("RGB"))          # [H, W, 3] uint8
            self._tb.add_image(key, image, step, dataformats="HWC")
            self._tb.flush()
        elif self._tb is not None and suffix == ".mp4":
            try:
                frames, fps = read_video(path)                           # [T, H, W, 3] uint8
                tensorboard_video(self._tb, key, frames, fps, step)
                self._tb.flush()
            except Exception as e:  # noqa: BLE001 - a video that does not decode costs only itself
                print(f"[flowrl_ray] could not add {path.name} to TensorBoard: {e}", file=self._stream, flush=True)
        self._to_trackers("log_media", path, key, step, caption)

    def log_final(self, summary: dict, checkpoint: str | Path | None) -> None:
        """The finished run's summary and final checkpoint path, for the trackers."""
        self._to_trackers("log_final", summary, str(checkpoint) if checkpoint else None)

    def _to_trackers(self, method: str, *args) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # noqa: BLE001 - training never dies for a logger
                self.trackers.remove(tracker)
                report_tracker_failure(tracker.label, e, self._stream)
                try:
                    tracker.close()
                except Exception:  # noqa: BLE001 - it has failed already
                    pass

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        self._to_trackers("close")
        self.trackers = []


class Progress:
    """One line per iteration with throughput and ETA (readable in job logs, no terminal tricks).

    ``unit``: what env_steps counts: "steps", or "chunks" where the env executes an action chunk
    per step (robot tasks: ``unit_note`` says how many robosuite steps one chunk runs)."""

    def __init__(self, total: int, label: str, start_iteration: int = 0, stream=None,
                 unit: str = "steps", unit_note: str = ""):
        self.total, self.label, self.stream = total, label, stream or sys.stdout
        self.unit, self.unit_note = unit, unit_note
        self.start_iteration, self.t0 = start_iteration, time.perf_counter()

    def update(self, row: dict) -> None:
        it = row["iteration"]
        done = it - self.start_iteration
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - it) if done > 0 else float("nan")
        ret = row.get("episode_return_mean")
        note = f" ({self.unit_note})" if self.unit_note else ""
        parts = [f"[{self.label}] it {it}/{self.total}", f"{self.unit} {row.get('env_steps', 0):,}{note}",
                 f"return {ret:.1f}" if isinstance(ret, (int, float)) else "return -"]
        if row.get("eval/return_mean") is not None:
            parts.append(f"eval {row['eval/return_mean']:.1f}")
        parts += [f"{row.get('env_steps_per_s', 0):,.0f} {self.unit}/s",
                  f"elapsed {format_duration(elapsed)}",
                  f"ETA {format_duration(eta)}" if math.isfinite(eta) else "ETA -"]
        if row.get("worker_restarts"):
            parts.append(f"restarts {row['worker_restarts']}")
        print(" | ".join(parts), file=self.stream, flush=True)

