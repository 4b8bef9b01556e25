"""Evaluation videos of robot policies and the progress lines of long evaluations.

Episodes here are 7 robosuite steps run as chunks of 2 (the last chunk is cut after 1 step), so a
filmed episode that fails (a random policy lifts nothing in 0.35 s) has exactly 7 + 1 frames:
the reset frame and one per robosuite step."""

import json
import os
import re

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from conftest import PENDULUM  # noqa: E402

from flowrl_ray.cli import main  # noqa: E402
from flowrl_ray.config import ConfigError, config_from_dict  # noqa: E402

STEPS = 7            # robosuite steps per episode
FRAMES = STEPS + 1   # the reset frame and one per robosuite step
TINY_FPOPP = {"hidden_sizes": [32], "critic_hidden_sizes": [16], "minibatch_size": 4, "n_mc": 2,
              "flow_steps": 2, "critic_warmup_iters": 0, "feature_dim": 8}


def robot_config(**eval_section) -> dict:
    return {"name": "video", "algorithm": "fpopp",
            "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2,
                    "max_episode_steps": STEPS},
            "train": {"iterations": 3},
            "runtime": {"num_workers": 1, "envs_per_worker": 1, "rollout_length": 4,
                        "checkpoint_interval": 0},
            "eval": {"interval": 1, "episodes": 1, **eval_section},
            "algo": TINY_FPOPP}


def decode(path) -> np.ndarray:
    """[T, H, W, 3] uint8: every frame the MP4 holds."""
    import imageio.v2 as imageio
    with imageio.get_reader(path) as reader:
        return np.stack([frame for frame in reader])


def test_video_config_errors_name_the_key_before_ray_starts(tmp_path, capsys):
    from flowrl_ray.runtime.trainer import Trainer
    assert main(["train", str(PENDULUM), "eval.video.episodes=1", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "config key 'eval.video'" in err and "robot tasks" in err and "'gym'" in err
    assert not (tmp_path / "r").exists()                       # stopped before the run started
    for key, value, message in (("size", 40, "multiple of 16"), ("camera", "topview", "unknown camera")):
        cfg = config_from_dict(robot_config(video={"episodes": 1, key: value}))
        with pytest.raises(ConfigError, match=rf"'eval.video.{key}'.*{message}"):
            Trainer(cfg, tmp_path / "r2")
    Trainer(config_from_dict(robot_config(video={"episodes": 1, "size": 48})), tmp_path / "r3")


def test_only_the_wanted_episodes_are_rendered(monkeypatch):
    from flowrl_ray.algorithms.fpopp import FPOPP
    from flowrl_ray.envs import env_family
    from flowrl_ray.envs.robot import RobotEnv
    from flowrl_ray.envs.rollout import EnvRunner
    renders = []
    render = RobotEnv.render_camera
    monkeypatch.setattr(RobotEnv, "render_camera",
                        lambda self, *args, **kw: renders.append(id(self)) or render(self, *args, **kw))
    cfg = config_from_dict(robot_config())
    family = env_family("robot")
    runner = EnvRunner(family, cfg.env, 2, 0, FPOPP.make_policy(cfg, family.spec(cfg.env)))
    try:
        plain = runner.evaluate(3)
        assert renders == [] and "videos" not in plain
        filmed = runner.evaluate(3, video_episodes=1, video=("agentview", 32))
    finally:
        runner.close()
    # 3 episodes on 2 envs: env 0 films its first one; env 1 never renders. The 9th render is the
    # reset frame of env 0's next episode, taken at the autoreset before the runner stops it.
    assert len(set(renders)) == 1 and len(renders) == FRAMES + 1
    [video] = filmed["videos"]
    assert video["frames"].shape == (FRAMES, 32, 32, 3) and video["frames"].dtype == np.uint8
    assert video["fps"] == 20 and video["success"] is False and video["length"] == 4     # 4 chunks
    assert filmed["episode_returns"] == plain["episode_returns"]    # filming changes no episode
    assert not np.array_equal(video["frames"][0], video["frames"][-1])                  # the arm moved


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
    # FPO++ steps are action chunks: the progress line counts them as such
    assert "[fpopp lift] it 3/3 | chunks 12 (up to 2 robosuite steps each) |" in out and " chunks/s |" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/success_rate"] for r in rows] == [0.0, 0.0, 0.0]
    names = sorted(p.name for p in (run / "videos").glob("*.mp4"))
    assert names == ["iter_0002_0_failure.mp4", "iter_0003_0_failure.mp4"]
    assert "videos: videos/iter_0003_0_failure.mp4" in out
    for name in names:
        frames = decode(run / "videos" / name)
        assert frames.shape == (FRAMES, 32, 32, 3)

    # at the env steps of iterations 2 and 3 (4 chunks an iteration)
    assert [(p.name, step) for p, step, _ in media] == [(names[0], 8), (names[1], 12)]
    assert media[0][2] == f"iteration 2: failure, return 0.0, {FRAMES} frames at 20 fps"

    assert main(["eval", str(run), "--episodes", "2", "--video", "1"]) == 0
    captured = capsys.readouterr()
    [line] = captured.out.strip().splitlines()          # stdout: the JSON only, progress on stderr
    result = json.loads(line)
    assert result["episodes"] == 2 and result["success_rate"] == 0.0
    assert result["videos"] == [str(run / "videos" / "eval" / "iter_0003_0_failure.mp4")]
    assert decode(result["videos"][0]).shape == (FRAMES, 32, 32, 3)        # the run's eval.video.size
    assert [(str(p), step) for p, step, _ in media[2:]] == [(result["videos"][0], 12)]
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


def test_pretraining_evaluation_and_demo_collection_show_progress(tmp_path, capsys):
    from flowrl_ray.algorithms.fpopp import FPOPP
    from flowrl_ray.envs import env_family
    from flowrl_ray.envs.robot.experts import collect_demos
    from flowrl_ray.pretrain import evaluate
    cfg = config_from_dict(robot_config())
    policy = FPOPP.make_policy(cfg, env_family("robot").spec(cfg.env))
    result = evaluate(cfg, policy, 2, progress=True)
    assert result["zero"]["success_rate"] == 0.0
    lines = capsys.readouterr().out.splitlines()
    # 2 envs finish together: one line per sampling mode, 2 + 2 episodes in all
    assert [line.split(" | ")[0] for line in lines] == ["[pretrain eval] 2/4 episodes (zero sampling)",
                                                        "[pretrain eval] 4/4 episodes (random sampling)"]
    assert all(re.search(r"\| \d+\.\d s/episode \| elapsed \d+s \| ETA", line) for line in lines)

    stats = collect_demos("lift", 1, tmp_path / "lift.hdf5", max_attempts=1, progress=True)
    [line] = capsys.readouterr().out.splitlines()
    ok = "ok" if stats.successes else "failed"
    assert line.startswith(f"[demos lift] {stats.successes}/1 demos (attempt 1: {ok}, "
                           f"{stats.steps} robosuite steps) | ")
    assert re.search(r"s/demo \| elapsed \d+s \| ETA (0s|-)$", line)

