"""FPO++ on the robot family without a simulator: image augmentation with async workers is refused
before Ray starts. The rollouts on real robosuite: tests/integration/test_fpopp_robot.py."""

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest  # noqa: E402

from flowrl_ray.config import ConfigError, config_from_dict  # noqa: E402


def robot_cfg(mode="sync", **env):
    return config_from_dict({
        "algorithm": "fpopp",
        "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2, "max_episode_steps": 6, **env},
        "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 5, "mode": mode},
        "algo": {"hidden_sizes": [32], "critic_hidden_sizes": [16], "minibatch_size": 4, "n_mc": 3,
                 "flow_steps": 2, "critic_warmup_iters": 0, "feature_dim": 8}})


def test_image_augmentation_with_async_workers_is_refused_before_ray_starts():
    with pytest.raises(ConfigError, match=r"algo\.augment.*async"):
        robot_cfg(mode="async", obs_mode="image", cameras=["agentview"], image_size=32)
    robot_cfg(mode="async")                      # state observations have nothing to shift
