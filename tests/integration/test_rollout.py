"""The rollout loop on the other env families of the PPO configs (MuJoCo HalfCheetah, Box2D
BipedalWalker): they step, and the MuJoCo state survives a snapshot."""

import numpy as np
import pytest

from unit.envs.test_rollout import _runner


@pytest.mark.parametrize("env_id", ["HalfCheetah-v5", "BipedalWalker-v3"])
def test_other_families_of_the_ppo_configs_step(env_id):
    runner, spec = _runner(f"env.id={env_id}", num_envs=2)
    b = runner.sample(5)
    assert b["obs"].shape == (5, 2, spec.obs_dim) and np.isfinite(b["rewards"]).all()
    if env_id == "HalfCheetah-v5":          # MuJoCo state survives the snapshot
        r2, _ = _runner(f"env.id={env_id}", num_envs=2, seed=7)
        r2.set_weights(runner.policy.state_dict(), 0)
        assert r2.set_state(runner.get_state())
        assert np.array_equal(runner.sample(5)["obs"], r2.sample(5)["obs"])
    else:                                    # Box2D worlds do not pickle: reported, env kept fresh
        assert runner.get_state() and not _runner(f"env.id={env_id}", num_envs=2)[0].set_state(runner.get_state())
