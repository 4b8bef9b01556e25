"""W&B and MLflow tracking with the real libraries: no import without a logging section, media to
every sink, a failing tracker that the run survives, a tiny PPO run read back from W&B's offline
run file and from MLflow's file store (equal to metrics.jsonl), a resumed run that stays one
tracked run, and a Tune sweep with one tracked run per trial."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import PENDULUM, REPO, run_trainer, tiny_config
from flowrl_ray.config import load_config
from unit.runtime.test_tracking import offline_wandb  # noqa: F401 (an autouse fixture)


def tracking_overrides(tmp_path: Path) -> list[str]:
    return ["logging.wandb.project=flowrl-tests", "logging.wandb.mode=offline", "logging.wandb.tags=[tiny]",
            f"logging.mlflow.tracking_uri={tmp_path / 'mlruns'}", "logging.mlflow.experiment=tracking-tests"]


# --------------------------------------------------------------------------- reading W&B back

def _wandb_log_records(path: Path):
    """The records of a .wandb file: W&B's header (':W&B', magic, version: 7 bytes), then
    LevelDB-log framing (32 KiB blocks; each chunk: crc32, length, type), each record one of
    W&B's own protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:                     # a block's tail too short for a header
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:                                   # FULL
            pending = chunk
        elif kind in (2, 3):                            # FIRST, MIDDLE
            pending = (pending if kind == 3 else b"") + chunk
            continue
        elif kind == 4:                                 # LAST
            pending += chunk
        else:
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        yield record


def read_wandb_run(run_dir: Path) -> dict:
    """{id, config, history: {step: {key: value}}} of an offline run directory (a media entry
    comes as flat keys: `<key>/_type`, `<key>/path`, `<key>/caption`, ...)."""
    (wandb_file,) = run_dir.glob("run-*.wandb")
    out = {"id": None, "config": {}, "history": {}}
    for record in _wandb_log_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
            out["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            out["history"].setdefault(record.history.step.num, {}).update(items)
    return out


def offline_runs(wandb_dir: Path) -> list[Path]:
    return sorted(wandb_dir.glob("**/wandb/offline-run-*"))


def test_without_logging_section_neither_library_is_imported():
    import subprocess
    import sys
    # A fresh interpreter: configs without `logging` import neither library.
    code = ("import sys; from flowrl_ray.config import load_config; from flowrl_ray.runtime import trainer; "
            f"cfg = load_config({str(PENDULUM)!r}); assert cfg.logging.wandb is None and cfg.logging.mlflow is None; "
            "trainer.preflight(cfg.logging); print('wandb' in sys.modules, 'mlflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO)
    assert out.stdout.split() == ["False", "False"]


# --------------------------------------------------------------------------- the logger, no Ray

def _png(path: Path, color) -> Path:
    from PIL import Image
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (24, 16), color).save(path)
    return path


def _mp4(path: Path, frames: int = 6) -> Path:
    import imageio
    path.parent.mkdir(parents=True, exist_ok=True)
    video = np.zeros((frames, 32, 48, 3), np.uint8)            # [T, H, W, 3]
    video[:, :, :, 0] = np.linspace(0, 255, frames, dtype=np.uint8)[:, None, None]
    imageio.mimwrite(path, video, fps=5, macro_block_size=16)
    return path


def _open_logger(cfg, run_dir: Path, stream=None):
    from flowrl_ray.runtime.metrics import MetricsLogger
    from flowrl_ray.runtime.tracking import open_trackers
    run_dir.mkdir(parents=True, exist_ok=True)
    trackers = open_trackers(cfg, run_dir, resume=False)
    return MetricsLogger(run_dir, cfg.name, tensorboard=True, trackers=trackers,
                         stream=stream)


def test_media_reach_tensorboard_wandb_and_mlflow(tmp_path, offline_wandb):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flowrl_ray.runtime.tracking import mlflow_store_uri
    cfg = tiny_config(*tracking_overrides(tmp_path))
    run_dir = tmp_path / "run"
    logger = _open_logger(cfg, run_dir)
    assert [t.label for t in logger.trackers] == ["W&B", "MLflow"]
    logger.log({"iteration": 1, "env_steps": 256, "episode_return_mean": -1200.5})
    plot = _png(run_dir / "plots" / "learning_curve.png", (200, 10, 10))
    video = _mp4(run_dir / "videos" / "iter_0001_0_success.mp4", frames=6)
    still = _png(run_dir / "media" / "forms" / "iter_0001_0.png", (10, 10, 200))
    logger.log_media(video, 256, "episode 0: success")
    logger.log_media(still, 256, "form 0")
    logger.log({"iteration": 2, "env_steps": 512, "episode_return_mean": -1100.0})
    logger.log_media(plot, 512, "episode_return_mean")
    ids = json.loads((run_dir / "tracking.json").read_text())
    logger.close()

    # TensorBoard: the PNGs as images, the MP4 as a video (an animated GIF with all 6 frames)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert set(events.Tags()["images"]) == {"plots/learning_curve", "videos/iter_0001_0_success",
                                            "forms/iter_0001_0"}
    (gif,) = events.Images("videos/iter_0001_0_success")
    assert gif.step == 256 and (gif.width, gif.height) == (48, 32)
    from PIL import Image
    frames = Image.open(io.BytesIO(gif.encoded_image_string))
    assert frames.format == "GIF" and frames.n_frames == 6
    (curve,) = events.Images("plots/learning_curve")
    assert curve.step == 512 and Image.open(io.BytesIO(curve.encoded_image_string)).getpixel((0, 0)) == (200, 10, 10)

    # W&B: the files under the offline run's media/, the keys in its history at their steps
    (wb_dir,) = offline_runs(offline_wandb)
    run = read_wandb_run(wb_dir)
    assert run["id"] == ids["wandb_run_id"]
    assert run["history"][256]["videos/iter_0001_0_success/_type"] == "video-file"
    assert run["history"][256]["forms/iter_0001_0/_type"] == "image-file"
    assert run["history"][512]["plots/learning_curve/caption"] == "episode_return_mean"
    assert run["history"][512]["episode_return_mean"] == -1100.0
    assert len(list(wb_dir.glob("files/media/videos/**/*.mp4"))) == 1
    assert len(list(wb_dir.glob("files/media/images/**/*.png"))) == 2

    # MLflow: the files as artifacts under their folders, the PNGs also as images at their steps
    client = MlflowClient(tracking_uri=mlflow_store_uri(str(tmp_path / "mlruns")))
    rid = ids["mlflow_run_id"]
    listed = lambda folder: sorted(f.path for f in client.list_artifacts(rid, folder))
    assert listed("videos") == ["videos/iter_0001_0_success.mp4"]
    assert listed("plots") == ["plots/learning_curve.png"]
    assert listed("media/forms") == ["media/forms/iter_0001_0.png"]
    images = listed("images")
    assert any("plots~learning_curve+step+512" in p and p.endswith(".png") for p in images), images
    assert [(m.step, m.value) for m in client.get_metric_history(rid, "episode_return_mean")] == \
        [(256, -1200.5), (512, -1100.0)]
    assert client.get_run(rid).info.status == "FINISHED"


def test_failing_tracker_is_dropped_once_and_the_rest_go_on(tmp_path, offline_wandb):
    from mlflow.tracking import MlflowClient

    from flowrl_ray.metrics import read_metrics
    from flowrl_ray.runtime.tracking import mlflow_store_uri
    cfg = tiny_config(*tracking_overrides(tmp_path))
    stream = io.StringIO()
    logger = _open_logger(cfg, tmp_path / "run", stream=stream)
    wandb_tracker = logger.trackers[0]
    calls = []

    def broken_log(metrics, step=None):
        calls.append(step)
        raise ConnectionError("network down")
    wandb_tracker.run.log = broken_log
    for i in range(1, 4):
        logger.log({"iteration": i, "env_steps": 100 * i, "loss": 0.5 / i})
    logger.log_media(_png(tmp_path / "run" / "plots" / "p.png", (0, 0, 0)), 300)
    logger.close()
    lines = stream.getvalue().splitlines()
    assert lines == ["[flowrl_ray] W&B logging failed: ConnectionError: network down; "
                     "the run goes on without it"]
    assert calls == [100]                                  # not called again after it failed
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    client = MlflowClient(tracking_uri=mlflow_store_uri(str(tmp_path / "mlruns")))
    rid = json.loads((tmp_path / "run" / "tracking.json").read_text())["mlflow_run_id"]
    assert [(m.step, m.value) for m in client.get_metric_history(rid, "loss")] == \
        [(100, 0.5), (200, 0.25), (300, 0.5 / 3)]


# --------------------------------------------------------------------------- real runs

@pytest.mark.slow
def test_ppo_run_tracked_and_resumed_as_one_run(tmp_path, offline_wandb, local_ray):
    from mlflow.tracking import MlflowClient

    from flowrl_ray.checkpoint import latest_checkpoint
    from flowrl_ray.metrics import read_metrics
    from flowrl_ray.runtime.tracking import mlflow_store_uri
    run_dir = tmp_path / "run"
    # 50-step episodes: every iteration ends some, so the learning curve is drawn
    cfg = tiny_config("env.max_episode_steps=50", *tracking_overrides(tmp_path))
    run_trainer(cfg, run_dir)
    rows = read_metrics(run_dir)
    ids = json.loads((run_dir / "tracking.json").read_text())
    client = MlflowClient(tracking_uri=mlflow_store_uri(str(tmp_path / "mlruns")))
    rid = ids["mlflow_run_id"]
    checkpoint = str(latest_checkpoint(run_dir))

    # W&B: every numeric value of every metrics.jsonl row, at step env_steps; the config
    (first_dir,) = offline_runs(offline_wandb)
    first = read_wandb_run(first_dir)
    assert first["id"] == ids["wandb_run_id"]
    assert sorted(first["history"]) == [r["env_steps"] for r in rows] == [256, 512, 768]
    numeric = lambda row: {k: v for k, v in row.items()
                           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for row in rows:
        logged = first["history"][row["env_steps"]]
        for key, value in numeric(row).items():
            assert logged[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert first["config"]["algo"]["lr"] == cfg.algo.lr
    assert first["config"]["logging"]["wandb"]["tags"] == ["tiny"]
    assert first["history"][768]["plots/learning_curve/_type"] == "image-file"

    # MLflow: params, every metric's history (step env_steps), the plot, the final checkpoint
    run = client.get_run(rid)
    assert run.data.params["algo.lr"] == str(cfg.algo.lr)
    assert run.data.params["train.iterations"] == "3"
    assert run.data.tags["final_checkpoint"] == checkpoint
    for key in numeric(rows[0]):
        history = client.get_metric_history(rid, key)
        assert [(m.step, m.value) for m in history] == \
            [(r["env_steps"], pytest.approx(r[key], rel=1e-12)) for r in rows if r.get(key) is not None], key
    assert "plots/learning_curve.png" in [f.path for f in client.list_artifacts(rid, "plots")]

    # Resume with two more iterations: the same W&B run (same id) and the same MLflow run
    cfg5 = load_config(run_dir / "config.yaml", ["train.iterations=5"])
    run_trainer(cfg5, run_dir, resume=True)
    assert json.loads((run_dir / "tracking.json").read_text()) == ids
    rows = read_metrics(run_dir)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5]
    second_dirs = [d for d in offline_runs(offline_wandb) if d != first_dir]
    assert len(second_dirs) == 1
    second = read_wandb_run(second_dirs[0])
    assert second["id"] == first["id"]
    assert sorted(second["history"]) == [r["env_steps"] for r in rows[3:]] == [1024, 1280]
    assert second["history"][1280]["iteration"] == 5
    experiment = client.get_experiment_by_name("tracking-tests")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [rid]
    history = client.get_metric_history(rid, "iteration")
    assert [(m.step, m.value) for m in history] == [(r["env_steps"], r["iteration"]) for r in rows]
    run = client.get_run(rid)
    assert run.data.params["train.iterations"] == "3" and run.data.tags["resumed.train.iterations"] == "5"
    assert run.data.tags["final_checkpoint"] == str(latest_checkpoint(run_dir)) != checkpoint
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_backend_failing_mid_run_does_not_stop_training(tmp_path, local_ray, capsys, monkeypatch):
    from flowrl_ray.runtime import tracking
    from flowrl_ray.metrics import read_metrics
    real_log = tracking.MlflowTracker.log

    def log_until_second_iteration(self, row, step):
        if row["iteration"] == 2:
            raise OSError("disk full")
        real_log(self, row, step)
    monkeypatch.setattr(tracking.MlflowTracker, "log", log_until_second_iteration)
    cfg = tiny_config(*tracking_overrides(tmp_path))
    summary = run_trainer(cfg, tmp_path / "run")
    assert summary["iterations"] == 3
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]
    err = capsys.readouterr().err
    assert err.count("MLflow logging failed") == 1
    assert "[flowrl_ray] MLflow logging failed: OSError: disk full; the run goes on without it" in err


@pytest.mark.slow
def test_tune_sweep_one_tracked_run_per_trial(tmp_path, offline_wandb, local_ray):
    from mlflow.tracking import MlflowClient

    from flowrl_ray.metrics import read_metrics
    from flowrl_ray.runtime.tracking import mlflow_store_uri
    from flowrl_ray.runtime.tune import parse_search_space, run_sweep
    overrides = ["train.iterations=2", "runtime.num_workers=1", "runtime.envs_per_worker=2",
                 "runtime.rollout_length=64", "algo.minibatch_size=64", "algo.epochs=2",
                 "eval.interval=0", "env.max_episode_steps=50", *tracking_overrides(tmp_path)]
    base = load_config(PENDULUM, overrides)
    space = parse_search_space(["algo.lr=1e-3,3e-4"], [], [], [], base=base)
    out = tmp_path / "sweep"
    result = run_sweep(PENDULUM, overrides, space, seeds=1, out_dir=out, max_concurrent=1)
    assert result["trials"] == 2 and result["errored"] == 0
    trial_ids = sorted(p.name for p in (out / "trials").iterdir())
    assert len(trial_ids) == 2
    for trial_id in trial_ids:      # the trials' Trainers opened no run of their own
        assert not (out / "trials" / trial_id / "tracking.json").exists()

    client = MlflowClient(tracking_uri=mlflow_store_uri(str(tmp_path / "mlruns")))
    experiment = client.get_experiment_by_name("tracking-tests")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2
    # Tune names a trial "<trainable>_<trial id>"
    by_trial = {next(t for t in trial_ids if r.data.tags["trial_name"].endswith(t)): r for r in runs}
    assert sorted(by_trial) == trial_ids
    for trial_id, run in by_trial.items():
        assert run.info.status == "FINISHED"
        rows = read_metrics(out / "trials" / trial_id)
        history = client.get_metric_history(run.info.run_id, "episode_return_mean")
        assert [(m.step, m.value) for m in history] == [(r["iteration"], r["episode_return_mean"]) for r in rows]

    # W&B: one offline run per trial (Tune's callback names it by the trial id), in $WANDB_DIR
    wb_runs = [read_wandb_run(d) for d in offline_runs(offline_wandb)]
    assert sorted(r["id"] for r in wb_runs) == trial_ids
    for run in wb_runs:
        rows = read_metrics(out / "trials" / run["id"])
        assert sorted(run["history"]) == [1, 2]
        assert [run["history"][s]["episode_return_mean"] for s in (1, 2)] == \
            [pytest.approx(r["episode_return_mean"], rel=1e-12) for r in rows]
