"""ReinFlow on real robosuite Lift: ratio = 1 at the old policy after a rollout (sync), and per-row
log-probs recorded by async workers that the learner reproduces (with either noise)."""

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from flowrl_ray.algorithms.reinflow import ReinFlow  # noqa: E402
from flowrl_ray.envs import env_family  # noqa: E402
from flowrl_ray.envs.rollout import EnvRunner  # noqa: E402
from unit.algorithms.test_reinflow import _spec, robot_cfg  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rollout(cfg, algo, steps=5):
    family = env_family("robot")
    runner = EnvRunner(family, cfg.env, 2, seed=0, policy=ReinFlow.make_policy(cfg, _spec(cfg)))
    runner.set_weights(algo.policy_state_dict(), 1)
    try:
        return runner.sample(steps), runner.evaluate(2, deterministic=False)
    finally:
        runner.close()


def test_real_lift_rollout_records_chains_and_ratios_start_at_one():
    cfg = robot_cfg()
    algo = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    batch, evaluation = _rollout(cfg, algo)
    d = batch.data
    assert d["chains"].shape == (5, 2, 3, 4, 7)                    # [T, N, K + 1, Ta, Da]
    np.testing.assert_allclose(d["actions"], np.clip(d["chains"][:, :, -1], -1, 1))
    assert "logp_old" not in d                                      # sync: the learner computes it
    assert len(evaluation["episode_successes"]) == 2
    prepared = algo.prepare([batch])
    assert prepared["logp_old"].shape == (10,) and torch.isfinite(prepared["logp_old"]).all()
    with torch.no_grad():
        new = algo.policy.chain_log_prob(prepared["obs"], prepared["chains"], prepared["row_mask"])
    # every ratio 1, up to the rounding of another batch size (prepare scores in minibatches)
    torch.testing.assert_close(new, prepared["logp_old"], rtol=0, atol=1e-5)
    metrics = algo.update(prepared)
    assert np.isfinite(metrics["pg_loss"]) and metrics["reinflow/actor_steps"] == 2 * 3


@pytest.mark.parametrize("noise", ["learned", "sde"])          # ReinFlow's noise net, πRL's Flow-SDE
def test_async_workers_record_per_row_log_probs_that_the_learner_reproduces(noise):
    cfg = robot_cfg(mode="async", noise=noise)
    algo = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    batch, _ = _rollout(cfg, algo)
    assert batch.data["logp_old"].shape == (5, 2, 4)                # per row until the mask is known
    prepared = algo.prepare([batch])
    with torch.no_grad():
        new = algo.policy.chain_log_prob(prepared["obs"], prepared["chains"], prepared["row_mask"])
    torch.testing.assert_close(new, prepared["logp_old"], rtol=1e-5, atol=1e-4)
