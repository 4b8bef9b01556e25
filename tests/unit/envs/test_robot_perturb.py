"""Out-of-distribution robot scenes (env.perturb) without a simulator: the changes a task cannot
take, the suite per task and mode, the grasped flags of a rollout batch. Each change measured on
real robosuite: tests/integration/test_robot_perturb.py."""

import numpy as np
import pytest

pytest.importorskip("robosuite")

from flowrl_ray.config import ConfigError                                      # noqa: E402
from flowrl_ray.envs.robot.config import PerturbConfig, RobotEnvConfig         # noqa: E402
from flowrl_ray.envs import robot                                            # noqa: E402
from flowrl_ray.envs.robot import perturb                                    # noqa: E402


@pytest.mark.parametrize("task,obs_mode,changes,key", [
    ("can", "low_dim", {"placement_scale": 2.0}, "placement_scale"),
    ("can", "low_dim", {"object_scale": 1.3}, "object_scale"),
    ("lift", "low_dim", {"camera_shift": [0.0, 0.1, 0.0]}, "camera_shift"),
    ("lift", "low_dim", {"light_scale": 0.5}, "light_scale"),
    ("lift", "image", {"camera_shift": [0.1, 0.0]}, "camera_shift"),
])
def test_changes_a_task_cannot_take_name_the_key(task, obs_mode, changes, key):
    cfg = RobotEnvConfig(family="robot", id=task, obs_mode=obs_mode, horizon_steps=4, act_steps=4,
                    perturb=PerturbConfig(**changes))
    with pytest.raises(ConfigError, match=rf"env\.perturb\.{key}"):
        robot.check_config(cfg)


def test_the_suite_per_task_and_mode():
    assert perturb.suite_for("lift", "low_dim") == ["placement", "object_size", "friction", "action_noise"]
    assert perturb.suite_for("can", "low_dim") == ["friction", "action_noise"]
    assert perturb.suite_for("lift", "image") == list(perturb.OOD_SUITE)
    assert perturb.preset("friction") == PerturbConfig(table_friction_scale=0.2)
    with pytest.raises(ConfigError, match="unknown perturbation 'fog'"):
        perturb.preset("fog")


def test_rollout_batches_carry_grasped_per_step_with_the_ended_episodes_last_step():
    from flowrl_ray.envs.robot import step_grasped
    infos = {"grasped": np.array([True, False, False]), "_grasped": np.array([True, True, False]),
             "final_info": {"grasped": np.array([False, False, True]), "_grasped": np.array([False, False, True])}}
    done = np.array([False, False, True])
    # env 0 and 1 from this step's info, env 2 (ended, autoreset) from its final step
    assert step_grasped(infos, done).tolist() == [True, False, True]
    assert step_grasped({}, np.zeros(2, bool)).tolist() == [False, False]
