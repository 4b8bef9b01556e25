"""Out-of-distribution robot scenes (env.perturb): each change measured on real robosuite /
MuJoCo against the same seeded scene without it, exact resume with action noise, and the grasp
flag along a scripted lift."""

import numpy as np
import pytest

pytest.importorskip("robosuite")

import mujoco                                                                # noqa: E402

from flowrl_ray.envs.robot.config import PerturbConfig, RobotEnvConfig  # noqa: E402
from flowrl_ray.envs import robot                                            # noqa: E402


def _env(task="lift", obs_mode="low_dim", **changes):
    cfg = RobotEnvConfig(family="robot", id=task, obs_mode=obs_mode, horizon_steps=4, act_steps=4,
                    image_size=48, perturb=PerturbConfig(**changes))
    return robot.make_env(cfg)


def _cube_xy(env, seeds) -> np.ndarray:
    out = []
    for s in seeds:
        env.reset(seed=s)
        out.append(env.raw.sim.data.body_xpos[env.object_body_id()][:2] - env.raw.table_offset[:2])
    return np.array(out)


def test_placement_scale_widens_the_cubes_start_range_about_its_centre():
    plain, wide = _env(), _env(placement_scale=2.0)
    a, b = _cube_xy(plain, range(30)), _cube_xy(wide, range(30))
    assert np.abs(a).max() <= 0.03 + 1e-9                      # robosuite's Lift: x, y in [-0.03, 0.03]
    assert np.abs(b).max() <= 0.06 + 1e-9 and np.abs(b).max() > 0.035
    # rebuilds (every seeded reset) do not widen the kept sampler again
    assert wide.raw.placement_initializer.x_range == [-0.06, 0.06]
    plain.close(), wide.close()


def test_object_scale_enlarges_the_cube_which_then_rests_on_the_table():
    plain, big = _env(), _env(object_scale=1.3)
    for env in (plain, big):
        env.reset(seed=3)
        for _ in range(5):
            env.step(np.zeros((4, 7)))                          # let it settle
    m0, m1 = plain.raw.sim.model._model, big.raw.sim.model._model
    g = mujoco.mj_name2id(m0, mujoco.mjtObj.mjOBJ_GEOM, "cube_g0")
    np.testing.assert_allclose(m1.geom_size[g], 1.3 * m0.geom_size[g])   # same seed: same drawn cube, x 1.3
    np.testing.assert_allclose(m1.geom_rbound[g], 1.3 * m0.geom_rbound[g])
    table_top = plain.raw.table_offset[2]
    for env, m in ((plain, m0), (big, m1)):
        z = env.raw.sim.data.body_xpos[env.object_body_id()][2]
        assert z == pytest.approx(table_top + m.geom_size[g][2], abs=2e-3)   # resting, not sunk or floating
    plain.close(), big.close()


def test_table_friction_scale_is_the_friction_of_the_cube_table_contact():
    for scale in (1.0, 0.2):
        env = _env(table_friction_scale=scale)
        env.reset(seed=0)
        env.step(np.zeros((4, 7)))
        m, d = env.raw.sim.model._model, env.raw.sim.data._data
        table = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_GEOM, "table_collision")
        cube = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_GEOM, "cube_g0")
        contacts = [d.contact[i] for i in range(d.ncon) if {d.contact[i].geom1, d.contact[i].geom2} == {table, cube}]
        assert contacts, "the cube rests on the table"
        # without priority MuJoCo would take the larger of the pair (the cube's 1.0)
        assert all(c.friction[0] == pytest.approx(scale) for c in contacts)
        env.close()


def test_action_noise_is_seeded_and_survives_a_snapshot():
    plain, noisy, again = _env(), _env(action_noise_std=0.1), _env(action_noise_std=0.1)
    chunk = np.zeros((4, 7))
    chunk[:, 0] = 0.5
    obs = {}
    for name, env in (("plain", plain), ("noisy", noisy), ("again", again)):
        env.reset(seed=7)
        obs[name] = [env.step(chunk)[0] for _ in range(3)]
    assert not np.allclose(obs["plain"][-1], obs["noisy"][-1])
    np.testing.assert_array_equal(obs["noisy"][-1], obs["again"][-1])     # the same seed, the same noise
    state = noisy.get_state()
    after = [noisy.step(chunk)[0] for _ in range(2)]
    restored = _env(action_noise_std=0.1)
    restored.set_state(state)
    np.testing.assert_array_equal([restored.step(chunk)[0] for _ in range(2)], after)
    for env in (plain, noisy, again, restored):
        env.close()


def test_camera_and_light_change_the_pixels_only():
    plain = _env(obs_mode="image")
    shifted = _env(obs_mode="image", camera_shift=[0.0, 0.05, 0.03])
    dark = _env(obs_mode="image", light_scale=0.35)
    (o0, _), (o1, _), (o2, _) = (e.reset(seed=1) for e in (plain, shifted, dark))
    np.testing.assert_array_equal(o0["state"], o1["state"])
    np.testing.assert_array_equal(o0["state"], o2["state"])
    assert np.abs(o0["rgb"].astype(int) - o1["rgb"]).mean() > 2            # another view
    assert o2["rgb"].mean() < 0.8 * o0["rgb"].mean()                       # darker
    for env in (plain, shifted, dark):
        env.close()


def test_grasped_turns_on_when_the_scripted_expert_holds_the_cube_and_stays_to_the_lift():
    # FlowSAR's key steps: the env reports whether the object is in the gripper after each step
    from flowrl_ray.envs.robot.experts import EXPERTS
    env = _env()
    expert = EXPERTS["lift"](env, np.random.default_rng(0), 0.0)
    env.reset(seed=0)
    expert.reset()
    held, success = [], False
    while not success and env.steps < env.max_episode_steps:
        success = env.step_raw(expert.act())
        held.append(env.grasped())
    assert success and not held[0]                       # the episode starts with an empty gripper
    first = held.index(True)
    assert all(held[first:])                             # from the grasp to the lift it holds the cube
    env.close()
