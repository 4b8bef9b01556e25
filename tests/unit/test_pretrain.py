"""`flowrl-ray demos` / `flowrl-ray pretrain` without a simulator: chunking demos into
(observation, action chunk) samples as the env sees them, the verbs' user errors and help. Demos,
pretraining and the base-policy checkpoint on real robosuite: tests/integration/test_pretrain.py."""

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("robosuite")

from flowrl_ray import cli                                                   # noqa: E402
from flowrl_ray.config import ConfigError  # noqa: E402
from flowrl_ray.envs.robot import robomimic_data as rd                             # noqa: E402
from flowrl_ray.envs import robot                                            # noqa: E402
from flowrl_ray.envs.robot.config import RobotEnvConfig                       # noqa: E402
from flowrl_ray.envs.robot.env import RobotEnv                               # noqa: E402
from flowrl_ray.pretrain.flow_bc import chunk_dataset  # noqa: E402

LIFT_ARGS = {"env_name": "Lift", "env_version": "1.5.2", "type": 1, "env_kwargs": {}}


def _env_observation(env_cfg: RobotEnvConfig, norm, raw: dict):
    """RobotEnv.observation (the env's own normalisation code) without starting a simulator."""
    image = env_cfg.obs_mode == "image"
    fake = SimpleNamespace(keys=robot.env.obs_keys(env_cfg.obs_mode), norm=norm, image=image,
                           cameras=tuple(env_cfg.cameras) if image else ())
    return RobotEnv.observation(fake, raw)


def _write(path, demos: list[dict], keys) -> None:
    with rd.DemoWriter(path, LIFT_ARGS) as w:
        for obs, actions in demos:
            t = len(actions)
            w.add(obs, actions, np.eye(t)[-1], np.eye(t)[-1], np.zeros((t, 5)))
    rd.write_stats(path, rd.compute_stats(path, keys))


def _low_dim_obs(rng, t: int) -> dict:
    return {"robot0_eef_pos": rng.normal(size=(t, 3)), "robot0_eef_quat": rng.normal(size=(t, 4)),
            "robot0_gripper_qpos": rng.normal(size=(t, 2)), "object": rng.normal(size=(t, 10))}


def test_chunks_pad_with_the_last_action_and_normalise_like_the_env(tmp_path):
    rng = np.random.default_rng(0)
    # actions: demo 0 is 0, 1, 2 and demo 1 is 4, 3, 2, 1, 0 on every arm dim (range [0, 4]:
    # x -> x / 2 - 1); the gripper dim is constant (maps to -1)
    a0 = np.repeat(np.arange(3.0)[:, None], 7, 1)
    a1 = np.repeat(np.arange(4.0, -1, -1)[:, None], 7, 1)
    a0[:, 6] = a1[:, 6] = 1.0
    demos = [(_low_dim_obs(rng, 3), a0), (_low_dim_obs(rng, 5), a1)]
    path = tmp_path / "tiny.hdf5"
    _write(path, demos, robot.LOW_DIM_KEYS)
    env_cfg = RobotEnvConfig(family="robot", id="lift", horizon_steps=4, act_steps=2, dataset=str(path))
    norm = robot.load_norm(env_cfg)
    obs, actions = chunk_dataset(path, env_cfg, norm)
    assert obs.shape == (8, 19) and obs.dtype == np.float32
    assert actions.shape == (8, 4, 7) and actions.dtype == np.float32
    # demo 0, t = 1: raw chunk [1, 2, 2, 2] (padded with the last action) -> [-0.5, 0, 0, 0]
    assert np.allclose(actions[1, :, 0], [-0.5, 0, 0, 0])
    # demo 1 (rows 3..7), t = 3: raw [1, 0, 0, 0] -> [-0.5, -1, -1, -1]; t = 0: [4, 3, 2, 1]
    assert np.allclose(actions[6, :, :6], np.array([-0.5, -1, -1, -1])[:, None])
    assert np.allclose(actions[3, :, 3], [1, 0.5, 0, -0.5])
    assert np.all(actions[7] == -1)                                      # the last step: all padding
    assert np.all(actions[..., 6] == -1)                                 # constant dim
    # observations: min/max of the two demos, by hand, and exactly what the env computes
    raw = [np.concatenate([d[0][k] for k in robot.LOW_DIM_KEYS], 1) for d in demos]
    lo, hi = np.concatenate(raw).min(0), np.concatenate(raw).max(0)
    assert np.allclose(obs[4], 2 * (raw[1][1] - lo) / (hi - lo) - 1, atol=1e-6)
    assert obs.min() == -1 and obs.max() == 1
    assert np.array_equal(obs[4], _env_observation(env_cfg, norm, {k: v[1] for k, v in demos[1][0].items()}))


def test_image_chunks_stack_cameras_in_config_order(tmp_path):
    rng = np.random.default_rng(1)
    demos = []
    for t in (3, 4):
        obs = _low_dim_obs(rng, t)
        for cam in ("agentview", "robot0_eye_in_hand"):
            obs[f"{cam}_image"] = rng.integers(0, 256, (t, 8, 8, 3), dtype=np.uint8)
        demos.append((obs, rng.uniform(-1, 1, (t, 7))))
    path = tmp_path / "img.hdf5"
    _write(path, demos, robot.LOW_DIM_KEYS)
    cfg = RobotEnvConfig(family="robot", id="lift", obs_mode="image", cameras=["robot0_eye_in_hand", "agentview"],
                    image_size=8, horizon_steps=2, act_steps=1, dataset=str(path))
    norm = robot.load_norm(cfg)
    obs, actions = chunk_dataset(path, cfg, norm)
    assert set(obs) == {"state", "rgb"} and actions.shape == (7, 2, 7)
    assert obs["state"].shape == (7, 9) and obs["state"].dtype == np.float32
    assert obs["rgb"].shape == (7, 6, 8, 8) and obs["rgb"].dtype == np.uint8
    d = demos[1][0]
    assert np.array_equal(obs["rgb"][5, :3], d["robot0_eye_in_hand_image"][2].transpose(2, 0, 1))
    assert np.array_equal(obs["rgb"][5, 3:], d["agentview_image"][2].transpose(2, 0, 1))
    env_obs = _env_observation(cfg, norm, {k: v[2] for k, v in d.items()})
    assert np.array_equal(obs["state"][5], env_obs["state"]) and np.array_equal(obs["rgb"][5], env_obs["rgb"])
    with pytest.raises(ConfigError, match="birdview_image"):
        chunk_dataset(path, RobotEnvConfig(family="robot", id="lift", obs_mode="image", cameras=["birdview"],
                                      image_size=8), norm)
    with pytest.raises(ConfigError, match="image_size"):
        chunk_dataset(path, RobotEnvConfig(family="robot", id="lift", obs_mode="image", image_size=84), norm)


def test_cli_demos_unknown_task_is_a_user_error(capsys):
    assert cli.main(["demos", "nosuchtask", "--episodes", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nosuchtask" in err and "lift" in err


@pytest.mark.parametrize("verb", ["demos", "pretrain"])
def test_verbs_explain_themselves(verb, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([verb, "--help"])
    assert e.value.code == 0 and f"usage: flowrl-ray {verb}" in capsys.readouterr().out
