"""Evaluation videos as MP4 files: H.264 in yuv420p (what browsers, TensorBoard and W&B play),
encoded by the ffmpeg binary that the imageio-ffmpeg wheel ships. No Ray, no simulator."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

OUTCOME = {True: "success", False: "failure", None: "done"}    # None: the family reports none


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: float) -> Path:
    """Write ``frames`` [T, H, W, 3] uint8 (H and W multiples of 16) to ``path`` at ``fps``
    frames per second, atomically (a half-written file never carries the final name)."""
    import imageio.v2 as imageio
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected frames [T, H, W, 3] uint8, got {frames.shape} {frames.dtype}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")       # the suffix picks the format
    # macro_block_size=1: imageio would otherwise resize frames that are not multiples of 16.
    with imageio.get_writer(tmp, fps=fps, codec="libx264", pixelformat="yuv420p",
                            macro_block_size=1, ffmpeg_log_level="error") as writer:
        for frame in frames:
            writer.append_data(frame)
    os.replace(tmp, path)
    return path


def video_name(iteration: int, index: int, success: bool | None) -> str:
    """iter_<iteration>_<index>_<success|failure>.mp4 (``done`` where success is not known)."""
    return f"iter_{iteration:04d}_{index}_{OUTCOME[success]}.mp4"


def save_videos(videos: list[dict], out_dir: str | os.PathLike, iteration: int) -> list[Path]:
    """Write the evaluation's ``videos`` (EnvRunner.evaluate's: frames, fps, success) to
    ``out_dir``/iter_<i>_<k>_<success|failure>.mp4, k = 0, 1, ...; returns the paths."""
    return [write_video(Path(out_dir) / video_name(iteration, k, v["success"]), v["frames"], v["fps"])
            for k, v in enumerate(videos)]


def video_caption(iteration: int, video: dict) -> str:
    """"iteration 20: success, return 12.0, 301 frames at 20 fps" for the media sinks."""
    return (f"iteration {iteration}: {OUTCOME[video['success']]}, return {video['return']:.1f}, "
            f"{len(video['frames'])} frames at {video['fps']:g} fps")
