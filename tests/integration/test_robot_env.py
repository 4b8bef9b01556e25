"""Robot family on real robosuite / MuJoCo: the tasks with robomimic conventions, action chunks,
exact resume, the scripted experts, the shaped reward."""

import json

import h5py
import numpy as np
import pytest

pytest.importorskip("robosuite")

from flowrl_ray.config import ConfigError, config_from_dict                  # noqa: E402
from flowrl_ray.envs.robot.config import RobotEnvConfig                       # noqa: E402
from flowrl_ray.envs.robot import robomimic_data as rd                             # noqa: E402
from flowrl_ray.envs import robot                                            # noqa: E402
from flowrl_ray.envs.robot.experts import collect_demos                      # noqa: E402

from conftest import REPO, tiny_config                                       # noqa: E402


def _cfg(**kw) -> RobotEnvConfig:
    return RobotEnvConfig(family="robot", **{"id": "lift", **kw})


@pytest.fixture(scope="module")
def lift_demos(tmp_path_factory):
    path = tmp_path_factory.mktemp("demos") / "lift.hdf5"
    stats = collect_demos("lift", episodes=2, out_path=path, seed=0, noise=0.1)
    return path, stats


@pytest.mark.parametrize("task,dim,steps", [("lift", 19, 300), ("can", 23, 300), ("square", 23, 400)])
def test_observation_dims_per_task(task, dim, steps):
    cfg = _cfg(id=task)
    spec = robot.spec(cfg)
    assert spec.obs_shape == (dim,) and spec.action_dim == 7 and spec.max_episode_steps == steps
    env = robot.make_env(cfg)
    obs, _ = env.reset(seed=0)
    raw = env.raw_obs()
    # the fixed key order: eef_pos [3], eef_quat [4], gripper_qpos [2], object [..]
    assert obs.shape == (dim,) and obs.dtype == np.float32
    assert np.allclose(obs, np.concatenate([raw[k] for k in robot.LOW_DIM_KEYS]))
    assert env.observation_space.shape == (dim,) and env.action_space.shape == (1, 7)
    env.close()


def test_image_observations_render_on_the_cpu():
    cfg = _cfg(obs_mode="image", cameras=["agentview", "robot0_eye_in_hand"], image_size=84,
               horizon_steps=2, act_steps=2)
    assert robot.observation_shapes(cfg) == {"state": (9,), "rgb": (6, 84, 84)}
    assert robot.spec(cfg).obs_shape == (9,)
    env = robot.make_env(cfg)
    obs, _ = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    rgb = obs["rgb"]
    assert rgb.dtype == np.uint8 and rgb.shape == (6, 84, 84)
    assert rgb[:3].std() > 10 and rgb[3:].std() > 10               # real pictures, not blank
    assert not np.array_equal(rgb[:3], rgb[3:])                     # two different cameras
    chunk = np.zeros((2, 7))
    chunk[:, 2] = 1.0                                               # move up: the pictures change
    obs2, *_ = env.step(chunk)
    assert obs2["rgb"].shape == (6, 84, 84) and not np.array_equal(obs2["rgb"][3:], rgb[3:])
    env.close()


def test_seeded_resets_free_the_replaced_simulator_and_its_render_context():
    # A seeded reset rebuilds robosuite's model (a new MjSim and, with images, a new offscreen
    # render context of ~0.34 GB). The old ones sit in reference cycles; unless the env frees
    # them, an evaluating image env grows by a render context per episode.
    import gc

    from robosuite.utils.binding_utils import MjRenderContext, MjSim
    gc.collect()
    cfg = _cfg(obs_mode="image", cameras=["agentview"], image_size=32, horizon_steps=2, act_steps=2)
    env = robot.make_env(cfg)
    gc.disable()                         # only the env may free them, not Python's schedule
    try:
        for seed in range(3):
            env.reset(seed=seed)
            env.step(np.zeros((2, 7)))
            live = [o for o in gc.get_objects() if isinstance(o, (MjSim, MjRenderContext))]
            assert sum(isinstance(o, MjSim) for o in live) == 1
            assert sum(isinstance(o, MjRenderContext) for o in live) == 1
            del live
    finally:
        gc.enable()
        env.close()


def test_an_env_renders_its_own_scene_after_another_envs_context_is_freed():
    # Freeing a GL context (another env's replaced simulator, whenever Python collects it)
    # releases the thread's current context; an env must make its own current before rendering,
    # or its observations are garbage from then on.
    import gc
    cfg = _cfg(obs_mode="image", cameras=["agentview"], image_size=32, horizon_steps=2, act_steps=2)
    a = robot.make_env(cfg)
    obs, _ = a.reset(seed=0)
    b = robot.make_env(cfg)
    b.reset(seed=1)
    b.close()
    del b
    gc.collect()
    assert np.array_equal(a.render_camera("agentview"), obs["rgb"].transpose(1, 2, 0))
    a.close()


def test_action_normalisation_round_trip_and_env_uses_dataset_range():
    stats = rd.NormStats(("x",), np.zeros(1), np.ones(1), action_min=np.array([-0.5, 0, 1, -1, -1, -1, 2]),
                         action_max=np.array([0.5, 1, 1, 1, 1, 1, 2]))   # two constant dims
    a = np.random.default_rng(0).uniform(stats.action_min, stats.action_max, (50, 7))
    a[:, [2, 6]] = stats.action_min[[2, 6]]
    u = stats.normalize_action(a)
    assert u.min() >= -1 and u.max() <= 1
    assert np.allclose(stats.unnormalize_action(u), a, atol=1e-6)
    # the env maps the policy's [-1, 1] through the dataset's range before robosuite sees it
    env = robot.RobotEnv(_cfg(), norm=stats)
    env.reset(seed=0)
    seen = []
    step = env.raw.step
    env.raw.step = lambda act: (seen.append(np.array(act)), step(act))[1]
    env.step(np.ones((1, 7)))
    env.step(-np.ones((1, 7)))
    assert np.allclose(seen[0], stats.action_max) and np.allclose(seen[1], stats.action_min)
    env.close()


def test_chunked_step_executes_act_steps_substeps():
    env = robot.make_env(_cfg(horizon_steps=4, act_steps=3))
    env.reset(seed=0)
    assert env.action_space.shape == (4, 7)
    seen = []
    step = env.raw.step
    env.raw.step = lambda act: (seen.append(np.array(act)), step(act))[1]
    chunk = np.linspace(-0.5, 0.5, 28).reshape(4, 7)
    _, reward, terminated, truncated, info = env.step(chunk)
    assert info["substeps"] == 3 and env.steps == 3 and env.raw.timestep == 3
    assert np.allclose(np.stack(seen), chunk[:3])      # the first act_steps rows, in order
    assert reward == 0.0 and not terminated and not truncated and not info["success"]
    with pytest.raises(ValueError, match="chunk"):
        env.step(np.zeros((2, 7)))                      # shorter than act_steps
    env.close()


def test_autoreset_puts_the_last_observation_in_final_obs():
    vec = robot.make_vector_env(_cfg(horizon_steps=2, act_steps=2, max_episode_steps=5), 2)
    obs, _ = vec.reset(seed=0)
    up = np.zeros((2, 2, 7))
    up[..., 2] = 0.5                                               # move up: every step shows
    for _ in range(2):
        obs, _, term, trunc, infos = vec.step(up)
        assert not (term | trunc).any()
    last = [env.raw_obs()["robot0_eef_pos"] for env in vec.envs]
    obs, _, term, trunc, infos = vec.step(up)                      # 1 of 2 rows hits the limit
    assert trunc.all() and not term.any()
    assert all(env.steps == 0 for env in vec.envs)                 # already reset ...
    assert infos["final_info"]["substeps"].tolist() == [1, 1]
    for i in range(2):                                             # ... the episode's end is kept
        final = infos["final_obs"][i]
        assert final.shape == (19,) and not np.allclose(final, obs[i])
        assert not np.allclose(final[:3], last[i])                 # it moved on one more step
    assert not robot.episode_success(infos, term | trunc).any()
    vec.close()


def test_seeded_reset_fixes_the_scene_across_env_instances():
    # robosuite draws Lift's cube size when it builds the model, from an unseeded Generator:
    # two instances reset with one seed must still see the same cube and the same trajectory.
    envs = [robot.RobotEnv(_cfg()) for _ in range(2)]
    first = [env.reset(seed=5)[0] for env in envs]
    assert np.array_equal(*first)
    assert np.array_equal(envs[0].raw.cube.size, envs[1].raw.cube.size)
    chunk = np.tile(np.array([0.3, -0.2, -0.5, 0, 0, 0, 1.0]), (16, 1))
    after = [env.step(chunk)[0] for env in envs]
    assert np.array_equal(*after)
    size = envs[0].raw.cube.size.copy()
    envs[0].reset(seed=6)
    assert not np.array_equal(envs[0].raw.cube.size, size)          # another seed, another cube
    envs[1].reset()                                                  # unseeded: the scene stays
    assert np.array_equal(envs[1].raw.cube.size, size)
    for env in envs:
        env.close()


@pytest.mark.parametrize("task", ["lift", "can"])
def test_snapshot_restore_continues_identically_through_the_rollout_runner(task):
    from flowrl_ray.algorithms.ppo import PPO
    from flowrl_ray.envs.rollout import EnvRunner
    cfg = tiny_config("env.family=robot", f"env.id={task}", "env.max_episode_steps=12")
    spec = robot.spec(cfg.env)

    def runner(seed):
        return EnvRunner(robot, cfg.env, 2, seed, PPO.make_policy(cfg, spec))

    r1 = runner(3)
    r1.sample(8)
    blob = r1.get_state()
    r2 = runner(99)                   # a different seed: everything must come from the state
    r2.set_weights(r1.policy.state_dict(), 0)
    assert r2.set_state(blob)
    b1, b2 = r1.sample(10), r2.sample(10)     # crosses an autoreset (robosuite's RNG places objects)
    assert b1["truncated"].any()
    for k in b1.data:
        assert np.array_equal(b1[k], b2[k]), k
    r1.close()
    r2.close()


def test_start_groups_start_every_episode_of_a_group_from_one_seeded_state_and_resume_exactly(monkeypatch):
    # env.start_group 2, 4 training envs: columns (0, 1) and (2, 3) each share every episode's start
    # state (the same first observation, the same recorded seed), the two groups differ, and an
    # episode's seed is recorded on each of its steps (the ended one's under final_info); exact
    # resume keeps the schedule; evaluation envs are not grouped.
    from flowrl_ray.algorithms.ppo import PPO
    from flowrl_ray.envs.rollout import EnvRunner
    cfg = tiny_config("env.family=robot", "env.id=lift", "env.max_episode_steps=6", "env.start_group=2",
                      "runtime.envs_per_worker=4")
    spec = robot.spec(cfg.env)
    runner = EnvRunner(robot, cfg.env, 4, 7, PPO.make_policy(cfg, spec))
    first = runner.obs.copy()
    assert np.array_equal(first[0], first[1]) and np.array_equal(first[2], first[3])
    assert not np.array_equal(first[0], first[2])
    b = runner.sample(9)                      # episodes of 6 steps: every column ends at t = 5
    seeds = b["start_seed"]
    assert (seeds >= 0).all() and np.array_equal(seeds[:, 0], seeds[:, 1]) and np.array_equal(seeds[:, 2], seeds[:, 3])
    assert b["truncated"][5].all() and (seeds[:6] == seeds[0]).all() and (seeds[6:] == seeds[6]).all()
    assert seeds[0, 0] != seeds[6, 0] and seeds[0, 0] != seeds[0, 2]       # a new state each episode
    assert np.array_equal(b["obs"][6, 0], b["obs"][6, 1]) and not np.array_equal(b["obs"][6, 0], b["obs"][6, 2])
    assert seeds[0, 0] == robot.env.start_seed(7, 0, 0) and seeds[6, 2] == robot.env.start_seed(7, 1, 1)
    blob = runner.get_state()
    again = EnvRunner(robot, cfg.env, 4, 99, PPO.make_policy(cfg, spec))
    again.set_weights(runner.policy.state_dict(), 0)
    assert again.set_state(blob)
    b1, b2 = runner.sample(8), again.sample(8)                    # crosses the next autoreset
    for k in b1.data:
        assert np.array_equal(b1[k], b2[k]), k
    assert len(set(b1["start_seed"][-1].tolist())) == 2
    ev = runner.evaluate(4)                                       # four distinct evaluation starts
    assert len(ev["episode_returns"]) == 4 and all(env.start_group == 1 for env in runner._eval_envs.envs)
    runner.close()
    again.close()
    # a runner made only to evaluate (`flowrl-ray eval`, pretraining's check, the protocol) has one
    # training env, which a group of 2 cannot divide: it is made ungrouped and evaluates as above
    with pytest.raises(ValueError, match="start_group 2 must divide the number of envs"):
        EnvRunner(robot, cfg.env, 1, 7, PPO.make_policy(cfg, spec))
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import _robot
    evaluator = _robot.make_eval_runner(cfg, PPO.make_policy(cfg, spec))
    assert evaluator.envs.envs[0].start_group == 1
    ev1 = evaluator.evaluate(4)
    assert len(ev1["episode_returns"]) == 4 and all(env.start_group == 1 for env in evaluator._eval_envs.envs)
    evaluator.close()
    from flowrl_ray.pretrain.flow_bc import evaluate as pretrain_check          # pretraining's check, both rules
    check = pretrain_check(cfg, PPO.make_policy(cfg, spec), episodes=2)
    assert set(check) >= {"zero", "random"}
    with pytest.raises(ConfigError, match="env.start_group.*must divide runtime.envs_per_worker"):
        tiny_config("env.family=robot", "env.id=lift", "env.start_group=3", "runtime.envs_per_worker=4")


def test_lift_expert_writes_loadable_demos_and_normalised_env(lift_demos):
    path, stats = lift_demos
    assert stats.successes == 2 and stats.attempts >= 2
    args = rd.env_args(path)
    assert args["env_name"] == "Lift" and args["type"] == 1
    assert args["env_kwargs"]["control_freq"] == 20
    demos = rd.load_demos(path, robot.LOW_DIM_KEYS)
    assert len(demos) == 2
    for d in demos:
        assert d["state"].shape[1] == 19 and d["actions"].shape[1] == 7
        assert d["rewards"][-1] == 1 and d["dones"][-1] == 1 and d["rewards"][:-1].sum() == 0
    with h5py.File(path) as f:
        assert json.loads(f["stats"].attrs["obs_keys"]) == list(robot.LOW_DIM_KEYS)
        assert f["data/demo_0/states"].shape[0] == len(demos[0]["actions"])
        model_files = [f[f"data/demo_{i}"].attrs["model_file"] for i in range(2)]
    # each demo keeps the MJCF of its own episode's scene (the seeded reset draws the cube)
    env = robot.RobotEnv(_cfg())
    scenes = []
    for seed in range(stats.attempts):
        env.reset(seed=seed)
        scenes.append(env.raw.sim.model.get_xml())
    env.close()
    assert all(m in scenes for m in model_files) and model_files[0] != model_files[1]
    # an env normalised by the dataset: its first observation lies in (about) [-1, 1]
    env = robot.make_env(_cfg(dataset=str(path)))
    obs, _ = env.reset(seed=0)
    assert np.abs(obs).max() < 1.5
    env.close()


@pytest.mark.parametrize("task", ["can", "square"])
def test_scripted_experts_succeed(task, tmp_path):
    stats = collect_demos(task, episodes=1, out_path=tmp_path / f"{task}.hdf5", seed=0, noise=0.05,
                          max_attempts=3)
    assert stats.successes == 1, f"{task} expert: {stats}"
    demos = rd.load_demos(tmp_path / f"{task}.hdf5", robot.LOW_DIM_KEYS)
    assert demos[0]["state"].shape[1] == 23


def _lift_potential_by_hand(obs: np.ndarray, grasping: bool = False) -> float:
    """Lift's phi off the lifted state: (1 - tanh(10 d) + 0.25 [grasp]) / 2.25, d the distance
    from the grip site to the cube (the last three raw observation entries, eef - cube)."""
    d = float(np.linalg.norm(obs[-3:]))
    return (1.0 - np.tanh(10.0 * d) + 0.25 * grasping) / 2.25


def test_shaped_reward_is_the_potential_difference_by_hand():
    gamma = 0.9
    env = robot.make_env(_cfg(horizon_steps=4, act_steps=4, reward="shaped", shaping_gamma=gamma))
    obs0, _ = env.reset(seed=0)
    phi0 = _lift_potential_by_hand(obs0)
    assert env.potential() == pytest.approx(phi0, abs=1e-6)      # obs are float32
    chunk = np.zeros((4, 7))
    chunk[:, 2] = -0.6                                  # down towards the cube, gripper open
    obs1, reward, terminated, _, info = env.step(chunk)
    phi1 = _lift_potential_by_hand(obs1)
    assert np.linalg.norm(obs1[-3:]) < np.linalg.norm(obs0[-3:])     # it did move closer
    assert not terminated and info["sparse_reward"] == 0.0
    assert reward == pytest.approx(gamma * phi1 - phi0, abs=1e-6)
    assert reward > 0                                   # moving towards the cube is progress
    env.close()


def test_shaped_return_telescopes_to_the_sparse_return_minus_the_first_potential():
    """Potential-based shaping with phi(terminal) = 0: the discounted shaped return of a whole
    episode is the discounted sparse return minus phi(s_0), so the optimal policy is kept; a
    scripted success ends the episode with reward 1 - phi(s_{T-1})."""
    from flowrl_ray.envs.robot.experts import EXPERTS
    gamma = 0.97
    env = robot.make_env(_cfg(reward="shaped", shaping_gamma=gamma))
    obs, _ = env.reset(seed=3)
    phi0 = env.potential()
    assert phi0 == pytest.approx(_lift_potential_by_hand(obs), abs=1e-6)
    expert = EXPERTS["lift"](env, np.random.default_rng(0), noise=0.0)
    expert.reset()
    shaped, sparse, phis, terminated, t = 0.0, 0.0, [phi0], False, 0
    while not terminated and env.steps < env.max_episode_steps:
        _, reward, terminated, _, info = env.step(expert.act()[None])
        shaped += gamma ** t * reward
        sparse += gamma ** t * info["sparse_reward"]
        phis.append(env.potential())
        t += 1
    assert terminated and sparse == pytest.approx(gamma ** (t - 1))   # solved at the last step
    assert max(phis[:-1]) > phi0 + 0.2                  # the reach/grasp terms did rise on the way
    assert reward == pytest.approx(1.0 - phis[-2], abs=1e-9)
    assert shaped == pytest.approx(sparse - phi0, abs=1e-9)
    env.close()


def test_shaped_reward_takes_the_algorithms_gamma_and_names_its_keys():
    cfg = config_from_dict({"algorithm": "fpopp", "algo": {"gamma": 0.95},
                            "env": {"family": "robot", "id": "lift", "horizon_steps": 4,
                                    "act_steps": 2, "reward": "shaped"}})
    assert cfg.env.shaping_gamma == 0.95
    with pytest.raises(ConfigError, match=r"env\.reward"):
        config_from_dict({"env": {"family": "gym", "id": "Pendulum-v1", "reward": "shaped"}})
    with pytest.raises(ConfigError, match=r"env\.reward"):
        config_from_dict({"env": {"family": "robot", "id": "lift", "reward": "dense"}})
    with pytest.raises(ConfigError, match=r"env\.shaping_gamma"):
        robot.make_env(_cfg(reward="shaped"))           # built without a config file: no gamma
