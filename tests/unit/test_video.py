"""Evaluation videos: the config mistakes name the key before Ray starts. Filming real robosuite
episodes: tests/integration/test_video.py; train and eval writing videos: tests/e2e/test_video.py."""

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest  # noqa: E402

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

