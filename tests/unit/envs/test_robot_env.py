"""Robot family without a simulator: the family's registration, the robomimic hdf5 layout, the
config checks. The robosuite tasks: tests/integration/test_robot_env.py."""

import h5py
import numpy as np
import pytest

pytest.importorskip("robosuite")

from flowrl_ray.config import ConfigError, config_from_dict  # noqa: E402
from flowrl_ray.envs import env_family                                       # noqa: E402
from flowrl_ray.envs.robot import robomimic_data as rd                             # noqa: E402
from flowrl_ray.envs import robot                                            # noqa: E402


def test_family_is_registered():
    assert env_family("robot") is robot


def test_robomimic_hdf5_round_trip(tmp_path):
    path = tmp_path / "d.hdf5"
    rng = np.random.default_rng(0)
    demos = []
    args = {"env_name": "Lift", "env_version": "1.5.2", "type": 1, "env_kwargs": {"control_freq": 20}}
    with rd.DemoWriter(path, args) as w:
        for t in (5, 7):
            obs = {"robot0_eef_pos": rng.normal(size=(t, 3)), "robot0_eef_quat": rng.normal(size=(t, 4)),
                   "robot0_gripper_qpos": rng.normal(size=(t, 2)), "object": rng.normal(size=(t, 10)),
                   "agentview_image": rng.integers(0, 255, (t, 8, 8, 3), dtype=np.uint8)}
            demo = dict(obs=obs, actions=rng.uniform(-1, 1, (t, 7)), rewards=np.eye(t)[-1],
                        dones=np.eye(t)[-1], states=rng.normal(size=(t, 32)))
            w.add(**demo)
            demos.append(demo)
    with h5py.File(path, "a") as f:            # robomimic's train/valid split keys
        f.create_dataset("mask/valid", data=np.array([b"demo_1"]))
        assert f["data"].attrs["total"] == 12
        assert [f[f"data/demo_{i}"].attrs["num_samples"] for i in (0, 1)] == [5, 7]
        assert f["data/demo_1/obs/agentview_image"].dtype == np.uint8
    assert rd.env_args(path) == args
    keys = list(robot.LOW_DIM_KEYS) + ["agentview_image"]
    loaded = rd.load_demos(path, keys)
    for demo, back in zip(demos, loaded):
        for k in keys:
            assert np.array_equal(back["obs"][k], demo["obs"][k])
        assert np.allclose(back["actions"], demo["actions"]) and np.allclose(back["dones"], demo["dones"])
        assert back["state"].shape == (len(demo["actions"]), 19)      # low-dim keys concatenated in order
        assert np.allclose(back["state"][:, :3], demo["obs"]["robot0_eef_pos"])
    assert [len(d["actions"]) for d in rd.load_demos(path, keys, filter_key="valid")] == [7]
    with pytest.raises(KeyError, match="nope"):
        rd.load_demos(path, ["nope"])
    # statistics: computed from the demos, stored, read back; other keys are recomputed
    stats = rd.compute_stats(path, robot.LOW_DIM_KEYS)
    all_state = np.concatenate([d["state"] for d in loaded])
    assert np.allclose(stats.obs_min, all_state.min(0)) and np.allclose(stats.obs_max, all_state.max(0))
    rd.write_stats(path, stats)
    again = rd.read_stats(path, robot.LOW_DIM_KEYS)
    assert np.array_equal(again.obs_min, stats.obs_min) and np.array_equal(again.action_max, stats.action_max)
    assert rd.read_stats(path, robot.PROPRIO_KEYS).obs_min.shape == (9,)


@pytest.mark.parametrize("key,value,match", [
    ("id", "Pendulum-v1", "env.id"),
    ("act_steps", 5, "env.act_steps"),
    ("obs_mode", "pixels", "env.obs_mode"),
    ("cameras", ["agentview", "nocam"], "env.cameras"),
    ("dataset", "/nonexistent/demos.hdf5", "env.dataset"),
    ("horizon", 4, "env.horizon"),                 # unknown key (a close match is suggested)
    ("image_size", 0, "env.image_size"),
])
def test_bad_config_keys_name_the_key(key, value, match):
    env = {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2, "obs_mode": "image", key: value}
    with pytest.raises(ConfigError, match=match.replace(".", r"\.")):
        cfg = config_from_dict({"env": env})      # schema errors (types, bounds, unknown keys) ...
        robot.spec(cfg.env)                       # ... and the family's own checks
