"""The env-step rollout loop on Pendulum: shapes, truncation bookkeeping, evaluation, exact state
restore, worker seeds."""

import numpy as np
import pytest
import torch

from flowrl_ray.algorithms.ppo import PPO
from flowrl_ray.envs import env_family
from flowrl_ray.envs.gym import NormalizedActions, make_env
from flowrl_ray.envs.rollout import EnvRunner

from conftest import tiny_config


def _runner(*overrides, num_envs=3, seed=0):
    cfg = tiny_config(*overrides)
    family = env_family(cfg.env.family)
    spec = family.spec(cfg.env)
    return EnvRunner(family, cfg.env, num_envs, seed, PPO.make_policy(cfg, spec)), spec


def test_batch_shapes_and_truncation_bookkeeping():
    runner, spec = _runner("env.max_episode_steps=10")
    b = runner.sample(25)
    T, N, D = 25, 3, spec.obs_dim
    assert b["obs"].shape == (T, N, D) and b["actions"].shape == (T, N, 1)
    assert b["logp"].shape == b["rewards"].shape == b["terminated"].shape == (T, N)
    assert b["last_obs"].shape == (N, D)
    # Pendulum never terminates; the 10-step time limit truncates at steps 9 and 19
    assert not b["terminated"].any()
    assert b["truncated"][[9, 19]].all() and b["truncated"].sum() == 2 * N
    # final_obs holds the episode's real last observation (not the reset one that follows)
    assert np.abs(b["final_obs"][9]).sum() > 0 and not np.allclose(b["final_obs"][9], b["obs"][10])
    assert b.meta.env_steps == T * N and len(b.meta.episode_returns) == 2 * N
    assert all(l == 10 for l in b.meta.episode_lengths)
    # episode returns are the rewards of each finished episode (env 0's are every N-th entry)
    assert np.allclose(b.meta.episode_returns[::N], [b["rewards"][:10, 0].sum(), b["rewards"][10:20, 0].sum()],
                       atol=1e-4)


def test_evaluate_runs_exactly_the_requested_episodes_and_is_reproducible():
    runner, _ = _runner("env.max_episode_steps=20")
    a = runner.evaluate(5)
    assert len(a["episode_returns"]) == 5 and all(l == 20 for l in a["episode_lengths"])
    assert a == runner.evaluate(5)      # eval envs are reseeded; the deterministic policy is the mean


def test_evaluate_noise_seed_replays_the_same_initial_states_with_other_noise():
    from flowrl_ray.envs.rollout import EVAL_SEED_OFFSET
    runner, _ = _runner("env.max_episode_steps=20")
    default = runner.evaluate(4, deterministic=False)
    assert runner.evaluate(4, deterministic=False, noise_seed=runner.seed + EVAL_SEED_OFFSET) == default
    other = runner.evaluate(4, deterministic=False, noise_seed=123)
    assert other["episode_keys"] == default["episode_keys"] and other["episode_returns"] != default["episode_returns"]
    # with the mean action the noise plays no part: the same initial states give the same episodes
    assert runner.evaluate(4, noise_seed=123) == runner.evaluate(4)


def test_evaluation_layout_by_hand():
    from flowrl_ray.envs.rollout import eval_quotas, eval_shares
    assert eval_quotas(50) == [7, 7, 6, 6, 6, 6, 6, 6]               # 50 = 2 x 7 + 6 x 6 on 8 envs
    assert eval_quotas(5) == [1, 1, 1, 1, 1] and eval_quotas(9, envs=4) == [3, 2, 2, 2]
    assert eval_shares(50, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]        # each worker its own envs (scenes)
    assert eval_shares(3, 4) == [[0], [1], [2], []]                  # a worker may get none


@pytest.mark.parametrize("deterministic", [True, False])
def test_shares_of_an_evaluation_are_the_one_process_evaluation(deterministic):
    """Two runners with other training envs and seeds, each running its share of the layout
    seeded by the first runner's seed, play exactly its episodes: same keys, same returns."""
    from flowrl_ray.envs.rollout import eval_shares
    whole, _ = _runner("env.max_episode_steps=15", num_envs=1, seed=4)
    a = whole.evaluate(11, deterministic=deterministic)
    parts = [_runner("env.max_episode_steps=15", num_envs=n, seed=s)[0] for n, s in ((2, 9), (5, 1))]
    for part in parts:
        part.policy.load_state_dict(whole.policy.state_dict())
    got = {}
    for part, share in zip(parts, eval_shares(11, 2)):
        r = part.evaluate(11, deterministic=deterministic, envs=share, seed=4)
        assert {k[0] for k in r["episode_keys"]} == set(share)
        got.update(zip(map(tuple, r["episode_keys"]), r["episode_returns"]))
    want = dict(zip(map(tuple, a["episode_keys"]), a["episode_returns"]))
    assert len(want) == 11 and got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k], rel=1e-6) for k in want)
    with pytest.raises(ValueError, match="not a share"):
        parts[0].evaluate(11, envs=[8])


def test_randn_with_one_generator_per_row():
    from flowrl_ray.utils import randn
    rows = randn((3, 2, 4), [torch.Generator().manual_seed(s) for s in (5, 6, 7)])
    assert torch.equal(rows[1], torch.randn((2, 4), generator=torch.Generator().manual_seed(6)))
    # one generator: torch.randn itself
    assert torch.equal(randn((3, 2), torch.Generator().manual_seed(1)),
                       torch.randn((3, 2), generator=torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match="2 generators for 3 rows"):
        randn((3, 2), [torch.Generator(), torch.Generator()])


def test_state_round_trip_continues_identically():
    r1, _ = _runner(seed=3)
    r1.sample(30)
    blob = r1.get_state()
    r2, _ = _runner(seed=99)               # different seed: everything must come from the state
    r2.set_weights(r1.policy.state_dict(), 0)
    assert r2.set_state(blob)
    b1, b2 = r1.sample(40), r2.sample(40)
    for k in b1.data:
        assert np.array_equal(b1[k], b2[k]), k


def test_normalized_actions_map_to_env_bounds():
    cfg = tiny_config()
    env = make_env(cfg.env)
    assert isinstance(env, NormalizedActions)
    assert np.allclose(env.action(np.array([-1.0])), env.unwrapped.action_space.low)
    assert np.allclose(env.action(np.array([1.0])), env.unwrapped.action_space.high)
    assert np.allclose(env.action(np.array([5.0])), env.unwrapped.action_space.high)   # clipped


def test_worker_seeds_give_every_worker_of_every_run_its_own_envs():
    # A worker seeds its env i with its seed + i (evaluation envs: + EVAL_SEED_OFFSET + i). No
    # two workers of runs seeded 0-4 (4 workers, 16 envs each, restarted twice) share an env seed:
    # with seed + worker_id, run 1's worker 0 was run 0's worker 1.
    from flowrl_ray.envs.rollout import EVAL_SEED_OFFSET
    from flowrl_ray.utils import worker_seed
    seeds = [worker_seed(s, w, r) for s in range(5) for w in range(4) for r in range(3)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**30 for s in seeds)
    envs = [s + off + i for s in seeds for off in (0, EVAL_SEED_OFFSET) for i in range(16)]
    assert len(set(envs)) == len(envs)
    assert worker_seed(3, 1, 0) == worker_seed(3, 1, 0)            # a function of its arguments
    # two workers' rollouts differ from the first step (their envs start from other scenes)
    cfg = tiny_config()
    family = env_family(cfg.env.family)
    obs = [EnvRunner(family, cfg.env, 2, worker_seed(s, w), PPO.make_policy(cfg, family.spec(cfg.env))).obs
           for s, w in ((0, 1), (1, 0))]
    assert not np.allclose(obs[0], obs[1])
