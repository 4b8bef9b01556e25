"""GAE against values computed by hand from the equations."""

import math

import numpy as np
import torch

from flowrl_ray.algorithms.advantages import explained_variance, gae, normalize


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_plain_episode_matches_hand_values():
    # one env, 3 steps, no episode end; bootstrap V(s_3) = 0.5
    r, v = _t([[1.0], [0.0], [2.0]]), _t([[0.5], [1.0], [1.5]])
    nv = _t([[1.0], [1.5], [0.5]])
    zero = torch.zeros(3, 1, dtype=torch.bool)
    g, lam = 0.9, 0.8
    d2 = 2.0 + g * 0.5 - 1.5            # 0.95
    d1 = 0.0 + g * 1.5 - 1.0            # 0.35
    d0 = 1.0 + g * 1.0 - 0.5            # 1.40
    a2 = d2
    a1 = d1 + g * lam * a2              # 0.35 + 0.72 * 0.95 = 1.034
    a0 = d0 + g * lam * a1              # 1.40 + 0.72 * 1.034 = 2.14448
    adv, ret = gae(r, v, nv, zero, zero, g, lam)
    assert torch.allclose(adv[:, 0], _t([a0, a1, a2]))
    assert torch.allclose(ret, adv + v)


def test_gae_termination_does_not_bootstrap_and_cuts_the_trace():
    r, v = _t([[1.0], [1.0], [1.0]]), _t([[2.0], [3.0], [4.0]])
    nv = _t([[3.0], [99.0], [5.0]])           # V(s') after step 1 must be ignored (terminal)
    term = torch.tensor([[False], [True], [False]])
    trunc = torch.zeros(3, 1, dtype=torch.bool)
    g, lam = 0.5, 1.0
    a2 = 1.0 + 0.5 * 5.0 - 4.0             # -0.5 (step 2 starts a new episode)
    a1 = 1.0 + 0.0 - 3.0                   # -2.0, nothing from step 2 flows back
    a0 = (1.0 + 0.5 * 3.0 - 2.0) + 0.5 * a1  # 0.5 - 1.0 = -0.5
    adv, _ = gae(r, v, nv, term, trunc, g, lam)
    assert torch.allclose(adv[:, 0], _t([a0, a1, a2]))


def test_gae_truncation_bootstraps_from_final_obs_value_but_cuts_the_trace():
    r, v = _t([[1.0], [1.0]]), _t([[2.0], [3.0]])
    nv = _t([[10.0], [7.0]])               # step 0 truncated: V(final_obs) = 10
    term = torch.zeros(2, 1, dtype=torch.bool)
    trunc = torch.tensor([[True], [False]])
    g, lam = 0.5, 0.9
    a1 = 1.0 + 0.5 * 7.0 - 3.0             # 1.5
    a0 = 1.0 + 0.5 * 10.0 - 2.0            # 4.0, and no lam-trace from step 1
    adv, _ = gae(r, v, nv, term, trunc, g, lam)
    assert torch.allclose(adv[:, 0], _t([a0, a1]))


def test_gae_envs_are_independent_columns():
    torch.manual_seed(0)
    r, v, nv = torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 3)
    term, trunc = torch.rand(5, 3) < 0.2, torch.rand(5, 3) < 0.2
    adv, _ = gae(r, v, nv, term, trunc, 0.99, 0.95)
    for j in range(3):
        col, _ = gae(r[:, j:j + 1], v[:, j:j + 1], nv[:, j:j + 1], term[:, j:j + 1], trunc[:, j:j + 1], 0.99, 0.95)
        assert torch.allclose(adv[:, j], col[:, 0])


def test_lambda_one_gives_discounted_return_minus_value():
    r = _t([[1.0], [2.0], [3.0]])
    v = _t([[0.3], [0.2], [0.1]])
    nv = _t([[0.2], [0.1], [4.0]])
    zero = torch.zeros(3, 1, dtype=torch.bool)
    adv, ret = gae(r, v, nv, zero, zero, 0.9, 1.0)
    mc = [1 + 0.9 * 2 + 0.81 * 3 + 0.729 * 4, 2 + 0.9 * 3 + 0.81 * 4, 3 + 0.9 * 4]
    assert torch.allclose(ret[:, 0], _t(mc))


def test_normalize():
    x = torch.tensor([1.0, 2.0, 3.0])
    y = normalize(x)
    assert abs(float(y.mean())) < 1e-6 and abs(float(y.std()) - 1.0) < 1e-6
    assert float(normalize(torch.tensor([5.0]))) == 0.0


def test_group_advantages_by_hand():
    from flowrl_ray.algorithms.advantages import group_advantages
    r = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 10.0])
    # group 1: mean 2, population std 1 -> [-1, 1]; group 2: equal -> zeros; group 3: mean 5, std 5
    adv = group_advantages(r, 2)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-6)
    r3 = torch.tensor([0.0, 0.0, 3.0])   # mean 1, std sqrt(2) -> [-0.7071, -0.7071, 1.4142]
    assert torch.allclose(group_advantages(r3, 3), torch.tensor([-1, -1, 2]) / 2 ** 0.5, atol=1e-6)
    assert torch.allclose(group_advantages(r3, 3, adv_clip_max=1.0), torch.tensor([-0.7071, -0.7071, 1.0]), atol=1e-4)
    import pytest
    with pytest.raises(ValueError):
        group_advantages(torch.ones(5), 2)


def _one_env_batch(truncated_at: int):
    """One env, 3 steps, no rewards, the episode truncated (time limit) at ``truncated_at``."""
    from flowrl_ray.batch import Batch, BatchMeta
    trunc = np.zeros((3, 1), bool)
    trunc[truncated_at] = True
    data = {"obs": np.array([[[0.0]], [[1.0]], [[2.0]]], np.float32), "rewards": np.zeros((3, 1), np.float32),
            "terminated": np.zeros((3, 1), bool), "truncated": trunc,
            "final_obs": np.full((3, 1, 1), 9.0, np.float32), "last_obs": np.array([[3.0]], np.float32)}
    return Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=3))


def test_time_limit_as_end_of_task_bootstraps_nothing_from_the_final_obs():
    from flowrl_ray.algorithms.onpolicy import advantages_from_rollouts

    def values(obs):                                    # V(s) = 0.1 * s, so V(final obs) = 0.9
        return 0.1 * obs[..., 0]
    g, lam = 0.5, 1.0
    # truncated at step 1: steps 0-1 are one episode, step 2 starts the next
    boot = advantages_from_rollouts([_one_env_batch(1)], values, g, lam, 1.0, torch.device("cpu"))
    end = advantages_from_rollouts([_one_env_batch(1)], values, g, lam, 1.0, torch.device("cpu"),
                                   bootstrap_truncated=False)
    # by hand, bootstrapping: A_1 = 0 + 0.5 * 0.9 - 0.1 = 0.35; A_0 = (0 + 0.5 * 0.1 - 0) + 0.5 * A_1 = 0.225
    assert torch.allclose(boot["advantages"][:2], torch.tensor([0.225, 0.35]))
    # the time limit ends the task: A_1 = 0 - 0.1; A_0 = 0.05 + 0.5 * (-0.1) = 0.0; returns = rewards = 0
    assert torch.allclose(end["advantages"][:2], torch.tensor([0.0, -0.1]), atol=1e-7)
    assert torch.allclose(end["returns"][:2], torch.zeros(2), atol=1e-7)
    # the next episode (step 2) bootstraps from the rollout's last obs either way: 0.5 * 0.3 - 0.2
    assert torch.allclose(end["advantages"][2], boot["advantages"][2])
    assert torch.allclose(end["advantages"][2], torch.tensor(-0.05))


def test_explained_variance_by_hand():
    ret = torch.tensor([0.0, 1.0, 2.0, 3.0])              # Var = 5/3 (unbiased)
    assert explained_variance(ret, ret) == 1.0
    assert abs(explained_variance(ret, torch.full((4,), 7.0))) < 1e-6          # a constant critic
    # residuals [0, 1, 0, 1]: Var = 1/3, so 1 - (1/3) / (5/3) = 0.8
    assert abs(explained_variance(ret, torch.tensor([0.0, 0.0, 2.0, 2.0])) - 0.8) < 1e-6
    assert explained_variance(ret, -ret) < 0                                    # worse than a constant
    assert math.isnan(explained_variance(torch.ones(4), torch.zeros(4)))
