"""FPO++ on the real robot envs: flow-policy rollouts (state and image observations) through the
EnvRunner, the learner's prepare/update on them, and success reporting."""

import dataclasses
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flowrl_ray.algorithms.fpopp import FPOPP  # noqa: E402
from flowrl_ray.envs import env_family  # noqa: E402
from flowrl_ray.envs.rollout import EnvRunner  # noqa: E402
from unit.algorithms.test_fpopp_robot import robot_cfg  # noqa: E402


def _run(cfg):
    family = env_family("robot")
    spec = family.spec(cfg.env)
    algo = FPOPP(cfg, spec, torch.device("cpu"))
    runner = EnvRunner(family, cfg.env, 2, seed=0, policy=FPOPP.make_policy(cfg, spec))
    runner.set_weights(algo.policy_state_dict(), 1)
    try:
        batch = runner.sample(5)
        evaluation = runner.evaluate(2)
    finally:
        runner.close()
    return algo, batch, evaluation


def test_state_rollout_batch_and_update():
    cfg = robot_cfg(mode="async")                # async: the workers record the old losses
    algo, batch, evaluation = _run(cfg)
    d = batch.data
    assert d["obs"].shape == (5, 2, 19) and d["last_obs"].shape == (2, 19)
    assert d["actions"].shape == (5, 2, 4, 7) and np.abs(d["actions"]).max() <= 1.0
    assert d["taus"].shape == (5, 2, 3) and d["mc_eps"].shape == (5, 2, 3, 4, 7)
    assert d["cfm_old"].shape == (5, 2, 3, 4)                      # per row until the mask is known
    # 6 low-level steps with 2 executed per chunk step: every third chunk step truncates
    assert d["truncated"][2].all() and not d["truncated"][:2].any()
    assert (d["executed_rows"] == 2).all()
    assert np.abs(d["final_obs"][2]).sum() > 0
    assert batch.meta.extra["successes"] == [False, False]         # a random policy lifts nothing
    assert evaluation["episode_successes"] == [False, False] and evaluation["episode_lengths"] == [3, 3]
    prepared = algo.prepare([batch])
    assert prepared["actions"].shape == (10, 4, 7) and prepared["cfm_old"].shape == (10, 3)
    # on policy: the losses the worker recorded are the learner's (ratios 1 up to float rounding)
    # (sync mode computes them on the learner: see the image test)
    with torch.no_grad():
        new = algo.policy.cfm_losses(prepared["obs"], prepared["actions"], prepared["taus"], prepared["mc_eps"],
                                     row_mask=prepared["row_mask"])
    torch.testing.assert_close(new, prepared["cfm_old"], rtol=1e-5, atol=1e-5)
    metrics = algo.update(prepared)
    assert np.isfinite(metrics["pg_loss"]) and np.isfinite(metrics["v_loss"])


def test_a_huber_config_reaches_the_losses_the_workers_record():
    cfg = robot_cfg(mode="async")
    cfg.algo = dataclasses.replace(cfg.algo, cfm_huber_delta=0.5)
    algo, batch, _ = _run(cfg)
    prepared = algo.prepare([batch])
    with torch.no_grad():
        args = (prepared["obs"], prepared["actions"], prepared["taus"], prepared["mc_eps"])
        mask = prepared["row_mask"]
        huber = algo.policy.cfm_losses(*args, row_mask=mask)
        squared = algo.policy.cfm_losses(*args, huber_delta=0.0, row_mask=mask)
    torch.testing.assert_close(huber, prepared["cfm_old"], rtol=1e-5, atol=1e-5)   # ratios 1
    assert (squared > huber).all()                 # an untrained policy's errors exceed 0.5 somewhere


def test_an_episode_that_ends_inside_a_chunk_masks_the_rows_that_never_ran():
    # 5 low-level steps with 2 rows per chunk step: the third chunk step runs 1 row and truncates
    cfg = robot_cfg(mode="async", max_episode_steps=5)
    algo, batch, _ = _run(cfg)
    d = batch.data
    assert d["truncated"][2].all() and not d["truncated"][[0, 1, 3, 4]].any()
    assert d["executed_rows"].tolist() == [[2, 2], [2, 2], [1, 1], [2, 2], [2, 2]]
    # env steps are the robosuite steps that ran (2 x (2 + 2 + 1 + 2 + 2)); chunks are named as such
    assert (batch.meta.env_steps, batch.meta.chunks) == (18, 10)
    prepared = algo.prepare([batch])
    full, cut = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([1.0, 0.0, 0.0, 0.0])
    expected = torch.stack([cut if t == 2 else full for t in range(5) for _ in range(2)])
    assert torch.equal(prepared["row_mask"], expected)
    rows = torch.as_tensor(d["cfm_old"]).reshape(10, 3, 4)
    torch.testing.assert_close(prepared["cfm_old"], (rows * expected[:, None]).sum(-1))


def test_image_rollout_batch_and_update():
    cfg = robot_cfg(obs_mode="image", cameras=["agentview"], image_size=32)
    algo, batch, _ = _run(cfg)
    d = batch.data
    assert d["obs/state"].shape == (5, 2, 9) and d["obs/rgb"].shape == (5, 2, 3, 32, 32)
    assert d["obs/rgb"].dtype == np.uint8 and d["obs/rgb"].max() > 0
    assert d["last_obs/rgb"].shape == (2, 3, 32, 32) and d["final_obs/rgb"][2].max() > 0
    assert "cfm_old" not in d                    # sync: the learner computes the old losses
    prepared = algo.prepare([batch])
    assert set(prepared["obs"]) == {"state", "rgb"} and prepared["obs"]["rgb"].dtype == torch.uint8
    # one random shift per sample: whole images moved by whole pixels, most of them moved
    raw = torch.as_tensor(d["obs/rgb"]).reshape(10, 3, 32, 32)
    moved = [not torch.equal(prepared["obs"]["rgb"][i], raw[i]) for i in range(10)]
    assert sum(moved) >= 5
    # At theta = theta_old every ratio is 1: the old and new losses see the same shifted images
    # (the update's first minibatch holds the whole batch here), in every epoch.
    for _ in range(2):
        _, stats = algo._losses(prepared, torch.arange(10), torch.arange(10), True)
        assert abs(stats["ratio_min"] - 1) < 1e-6 and abs(stats["ratio_max"] - 1) < 1e-6, stats
    metrics = algo.update(prepared)
    assert np.isfinite(metrics["pg_loss"])


def test_random_sampling_evaluation_does_not_depend_on_n_mc():
    # Evaluation draws only the action noise from its generator: no Monte Carlo pairs, which
    # only a training batch needs. Otherwise the same weights evaluated under n_mc 3 and 12
    # consume the stream differently and run different episodes.
    family = env_family("robot")
    returns = []
    for n_mc in (3, 12):
        cfg = robot_cfg(reward="shaped")            # returns that depend on every action
        cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, n_mc=n_mc))
        spec = family.spec(cfg.env)
        torch.manual_seed(0)
        policy = FPOPP.make_policy(cfg, spec)
        assert policy.n_mc == n_mc
        runner = EnvRunner(family, cfg.env, 2, seed=0, policy=policy)
        try:
            returns.append(runner.evaluate(4, deterministic=False)["episode_returns"])
        finally:
            runner.close()
    assert len(returns[0]) == 4 and len(set(returns[0])) > 1
    assert returns[0] == returns[1]
