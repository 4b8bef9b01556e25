"""Metrics sinks: metrics.jsonl, TensorBoard, Tune, W&B and MLflow (flowrl_ray.runtime.tracking).
The Ray dashboard's gauges: flowrl_ray.runtime.dashboard. The per-iteration progress line:
flowrl_ray.progress.Progress."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flowrl_ray.metrics import json_safe


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
        row = {k: json_safe(v) for k, v in row.items()}
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
