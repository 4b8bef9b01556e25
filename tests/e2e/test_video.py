"""Evaluation videos end to end: `flowrl-ray train` and `eval` (through `main`, on a local Ray)
write MP4s that decode, one frame per robosuite step (see tests/unit/test_video.py)."""

import json
import os
import re

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from flowrl_ray.cli import main  # noqa: E402
from unit.test_video import FRAMES, robot_config  # noqa: E402


def decode(path) -> np.ndarray:
    """[T, H, W, 3] uint8: every frame the MP4 holds."""
    import imageio.v2 as imageio
    with imageio.get_reader(path) as reader:
        return np.stack([frame for frame in reader])


@pytest.mark.slow
def test_train_and_eval_write_videos_that_decode(tmp_path, capsys, monkeypatch, local_ray):
    from flowrl_ray.runtime.metrics import MetricsLogger
    media = []           # (path, step, caption) of every video handed to the media sinks (not the plots)
    log_media = MetricsLogger.log_media
    monkeypatch.setattr(MetricsLogger, "log_media",
                        lambda self, path, step, caption="": (path.suffix == ".mp4" and media.append((path, step, caption)))
                        or log_media(self, path, step, caption))
    run, config = tmp_path / "run", tmp_path / "video.yaml"
    # evaluations at iterations 1, 2, 3: films at every 2nd (number 2) and at the last one (3)
    data = robot_config(video={"episodes": 1, "every": 2, "size": 32})
    data["logging"] = {"mlflow": {"tracking_uri": str(tmp_path / "mlruns")}}    # a local file store
    config.write_text(yaml.safe_dump(data))
    assert main(["train", str(config), "--run-dir", str(run), "--no-tensorboard"]) == 0
    out = capsys.readouterr().out
    # env steps are robosuite steps: an iteration is one 7-step episode run as 4 chunks (2, 2, 2, 1 rows)
    assert "[fpopp lift] it 3/3 | env steps 21 (12 chunks) |" in out and " env steps/s |" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/success_rate"] for r in rows] == [0.0, 0.0, 0.0]
    names = sorted(p.name for p in (run / "videos").glob("*.mp4"))
    assert names == ["iter_0002_0_failure.mp4", "iter_0003_0_failure.mp4"]
    assert "videos: videos/iter_0003_0_failure.mp4" in out
    for name in names:
        frames = decode(run / "videos" / name)
        assert frames.shape == (FRAMES, 32, 32, 3)

    # at the env steps of iterations 2 and 3 (7 robosuite steps an iteration)
    assert [r["env_steps"] for r in rows] == [7, 14, 21] and [r["chunks"] for r in rows] == [4, 8, 12]
    assert [(p.name, step) for p, step, _ in media] == [(names[0], 14), (names[1], 21)]
    assert media[0][2] == f"iteration 2: failure, return 0.0, {FRAMES} frames at 20 fps"

    assert main(["eval", str(run), "--episodes", "2", "--video", "1"]) == 0
    captured = capsys.readouterr()
    [line] = captured.out.strip().splitlines()          # stdout: the JSON only, progress on stderr
    result = json.loads(line)
    assert result["episodes"] == 2 and result["success_rate"] == 0.0
    assert result["videos"] == [str(run / "videos" / "eval" / "iter_0003_0_failure.mp4")]
    assert decode(result["videos"][0]).shape == (FRAMES, 32, 32, 3)        # the run's eval.video.size
    assert [(str(p), step) for p, step, _ in media[2:]] == [(result["videos"][0], 21)]
    assert re.search(r"\[eval lift\] 2/2 episodes \| \d+\.\d s/episode \| elapsed \d+s \| ETA 0s", captured.err)

    # the training's videos and the eval's went to the run's one MLflow run too
    from mlflow.tracking import MlflowClient

    from flowrl_ray.runtime.tracking import mlflow_store_uri
    client = MlflowClient(tracking_uri=mlflow_store_uri(str(tmp_path / "mlruns")))
    [experiment] = [e for e in client.search_experiments() if e.name == "video"]
    [mlflow_run] = client.search_runs([experiment.experiment_id])

    def artifacts(path=""):
        for f in client.list_artifacts(mlflow_run.info.run_id, path):
            yield from artifacts(f.path) if f.is_dir else [f.path]
    logged = sorted(a for a in artifacts() if a.endswith(".mp4"))
    assert logged == sorted([f"videos/{n}" for n in names] + ["videos/eval/iter_0003_0_failure.mp4"])

