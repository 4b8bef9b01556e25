"""FlowSAR: the self-annotation (Theorem 1), the credit weights, the mirror losses and the EMA
against numbers computed by hand from the spec's equations, and the algorithm on hand-made
rollout batches (no Ray, no simulator).

Time conventions: the package's networks take tau (0 noise, 1 data) and predict u = a - eps;
the spec writes t = 1 - tau, x_t = (1 - t) a + t eps, u_spec = eps - a and
v_spec(x, t) = -v(x, 1 - t)."""

import copy
import math

import numpy as np
import pytest
import torch

from flowrl_ray.algorithms.flowsar import (FlowSAR, centred_labels, credit_weights, ema_coefficient,
                                           episode_correlation,
                                           flowsar_loss, group_labels, mirror_energies, reconstruction_error,
                                           self_annotation, standardize_per_episode, value_labels)
from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.config import ConfigError, config_from_dict
from flowrl_ray.envs import EnvSpec

SPEC = EnvSpec(obs_shape=(19,), action_dim=7, max_episode_steps=10)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_cfg(seed: int = 0, env: dict | None = None, **hyper):
    return config_from_dict({
        "algorithm": "flowsar", "seed": seed,
        "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2, "max_episode_steps": 10,
                **(env or {})},
        "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 6},
        "algo": {"hidden_sizes": [16, 16], "flow_steps": 2, "minibatch_size": 4,
                 "lr": 1e-3, **hyper}})


# ------------------------------------------------------------------ Theorem 1: self-annotation

def test_reconstruction_error_of_a_constant_field_by_hand():
    # v == c (package convention): a_hat = x + t c with x = (1 - t) a + t eps.
    # t = .25, a = [1, 2], eps = [3, -1], c = [.5, -2]:
    #   x = [1.5, 1.25], a_hat = [1.625, .75], a - a_hat = [-.625, 1.25], e = 1.953125
    # (= t^2 ||(a - eps) - c||^2 = .0625 * 31.25)
    a = torch.tensor([[[1.0, 2.0]]])
    eps = torch.tensor([[[3.0, -1.0]]])
    c = torch.tensor([0.5, -2.0])
    e = reconstruction_error(lambda x, tau, obs: c.expand_as(x), None, a, eps, 0.25)
    assert e.shape == (1,)
    assert e.item() == pytest.approx(1.953125, abs=1e-6)


def test_reconstruction_error_calls_the_network_at_tau_one_minus_t_mid():
    # v = tau c: the error depends on the time the network is queried at. t_mid = .25 -> tau = .75:
    #   a_hat = x + .25 * .75 c = [1.59375, .875], a - a_hat = [-.59375, 1.125], e = 1.6181640625
    # and as a per-row tensor t_mid = [.25, .5] (row 2: tau = .5, x = [2, .5],
    #   a_hat = x + .25 c = [2.125, 0], a - a_hat = [-1.125, 2], e = 5.265625)
    seen = []

    def velocity(x, tau, obs):
        seen.append(tau.clone())
        return tau[:, None, None] * torch.tensor([0.5, -2.0])

    a = torch.tensor([[[1.0, 2.0]]])
    eps = torch.tensor([[[3.0, -1.0]]])
    e = reconstruction_error(velocity, None, a, eps, 0.25)
    assert seen[-1].tolist() == [0.75]
    assert e.item() == pytest.approx(1.6181640625, abs=1e-6)
    e2 = reconstruction_error(velocity, None, a.repeat(2, 1, 1), eps.repeat(2, 1, 1), torch.tensor([0.25, 0.5]))
    assert seen[-1].tolist() == [0.75, 0.5]
    torch.testing.assert_close(e2, torch.tensor([1.6181640625, 5.265625]))


def test_theorem_1_error_equals_t_squared_velocity_gap_for_a_random_mlp():
    # e = t^2 || v_spec - u_spec ||^2 with v_spec = -v(x, 1 - t), u_spec = eps - a, summed over
    # the chunk and action dims; t as a float and as a per-row tensor.
    torch.manual_seed(0)
    b, ta, da, od = 5, 3, 2, 4
    net = torch.nn.Sequential(torch.nn.Linear(ta * da + 1 + od, 32), torch.nn.Tanh(), torch.nn.Linear(32, ta * da))

    def velocity(x, tau, obs):               # package convention
        return net(torch.cat([x.flatten(1), tau[:, None], obs], -1)).view(x.shape)

    obs, a, eps = torch.randn(b, od), torch.randn(b, ta, da), torch.randn(b, ta, da)
    for t in (0.5, torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9])):
        tt = torch.as_tensor(t).expand(b)[:, None, None]
        with torch.no_grad():
            x = (1 - tt) * a + tt * eps
            v_spec = -velocity(x, 1 - tt[:, 0, 0], obs)
            expect = (tt[:, 0, 0] ** 2) * (v_spec - (eps - a)).pow(2).sum(dim=(1, 2))
            got = reconstruction_error(velocity, obs, a, eps, t)
        assert got.shape == (b,)
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ credit weights

def test_softmax_weights_by_hand_for_success_and_failure():
    # T = 2, e = [0, 2 ln 2, 2 ln 3]: success softmax(e / T) = [1, 2, 3] / 6,
    # failure softmax(-e / T) = [1, 1/2, 1/3] / (11/6) = [6, 3, 2] / 11
    e = torch.tensor([0.0, 2 * math.log(2), 2 * math.log(3)]).repeat(2, 1)
    w = credit_weights(e, torch.tensor([True, False]), 2.0)
    torch.testing.assert_close(w, torch.tensor([[1 / 6, 2 / 6, 3 / 6], [6 / 11, 3 / 11, 2 / 11]]))


def test_weights_sum_to_one_per_episode_and_masked_steps_are_exactly_zero():
    e = torch.tensor([[1.0, 2.0, 3.0, 0.5], [4.0, 5.0, 7.0, 9.0], [0.3, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    success = torch.tensor([True, False, True])
    for mode in ("softmax", "normalized", "uniform", "random", "inverse"):
        w = credit_weights(e, success, 0.5, mode, mask, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(w.sum(1), torch.ones(3), msg=mode)
        assert torch.all(w[~mask] == 0), mode
        assert torch.all(w[mask] > 0), mode
    # the softmax only runs over the real steps: episode 2 = softmax(-[4, 5] / .5) = [1, e^-2] / (1 + e^-2)
    w = credit_weights(e, success, 0.5, "softmax", mask)
    torch.testing.assert_close(w[1, :2], torch.tensor([1.0, math.exp(-2.0)]) / (1 + math.exp(-2.0)))
    assert w[2, 0].item() == 1.0


def test_success_weights_increase_and_failure_weights_decrease_with_e():
    e = torch.tensor([0.2, 1.0, 0.5, 3.0, 2.0])
    order = torch.argsort(e)
    w = credit_weights(e.repeat(2, 1), torch.tensor([True, False]), 0.5)
    assert torch.all(torch.diff(w[0, order]) > 0)          # success: high-e steps carry the credit
    assert torch.all(torch.diff(w[1, order]) < 0)          # failure: low-e steps carry the blame


def test_large_temperature_gives_uniform_and_small_gives_one_hot():
    e = torch.tensor([[0.2, 1.0, 0.5, 3.0, 2.0]]).repeat(2, 1)
    success = torch.tensor([True, False])
    w = credit_weights(e, success, 1e6)
    assert (w - 1 / 5).abs().max() < 1e-5
    w = credit_weights(e, success, 1e-3)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0, 0, 1, 0], [1.0, 0, 0, 0, 0]]), atol=1e-6, rtol=0)


def test_inverse_mode_swaps_the_success_and_failure_rules():
    # T = 2, e = [0, 2 ln 2, 2 ln 3]: inverse on a success row is the failure rule [6, 3, 2] / 11
    e = torch.tensor([[0.0, 2 * math.log(2), 2 * math.log(3)]])
    inv_success = credit_weights(e, torch.tensor([True]), 2.0, "inverse")
    torch.testing.assert_close(inv_success, torch.tensor([[6 / 11, 3 / 11, 2 / 11]]))
    torch.testing.assert_close(inv_success, credit_weights(e, torch.tensor([False]), 2.0, "softmax"))
    inv_failure = credit_weights(e, torch.tensor([False]), 2.0, "inverse")
    torch.testing.assert_close(inv_failure, torch.tensor([[1 / 6, 2 / 6, 3 / 6]]))


def test_uniform_mode_gives_one_over_the_episode_length():
    e = torch.tensor([[5.0, 1.0, 2.0], [1.0, 9.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    w = credit_weights(e, torch.tensor([True, False]), 0.5, "uniform", mask)
    torch.testing.assert_close(w, torch.tensor([[1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0]]))


def test_random_mode_is_normalised_and_reproducible_with_a_seeded_generator():
    e = torch.zeros(3, 6)
    mask = torch.arange(6)[None] < torch.tensor([[6], [4], [2]])
    success = torch.tensor([True, False, True])
    w1 = credit_weights(e, success, 0.5, "random", mask, generator=torch.Generator().manual_seed(7))
    w2 = credit_weights(e, success, 0.5, "random", mask, generator=torch.Generator().manual_seed(7))
    w3 = credit_weights(e, success, 0.5, "random", mask, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(w1.sum(1), torch.ones(3))
    assert torch.equal(w1, w2) and not torch.equal(w1, w3)
    assert torch.all(w1[~mask] == 0)
    # U(0, 1) draws normalised: the first row is the seeded draws over their sum
    u = torch.rand(3, 6, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(w1[0], u[0] / u[0].sum())


def test_normalized_mode_by_hand_inside_the_percentile_range():
    # all valid e sorted: [1, 1, 2, 2, 3, 4, 4, 4] (n = 8); linear quantiles at positions .35 and
    # 6.65 give 1 and 4, so nothing is clipped:
    #   success w = [1, 2, 3, 4] / 10,  failure w = [1, 1/2, 1/4, 1/4] / 2
    e = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 4.0, 4.0]])
    w = credit_weights(e, torch.tensor([True, False]), 0.5, "normalized")
    torch.testing.assert_close(w, torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.125, 0.125]]))


def test_normalized_mode_clips_an_outlier_to_the_95th_percentile():
    # valid e sorted: [1, 1, 2, 2, 3, 3, 4, 100]; 95th percentile at position 6.65:
    # 4 + .65 * 96 = 66.4, 5th at .35: 1. The padded 1000 is not a step and must not count.
    e = torch.tensor([[1.0, 2.0, 3.0, 4.0, 1000.0], [1.0, 2.0, 3.0, 100.0, 1000.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    w = credit_weights(e, torch.tensor([True, True]), 0.5, "normalized", mask)
    torch.testing.assert_close(w[1], torch.tensor([1.0, 2.0, 3.0, 66.4, 0.0]) / 72.4)
    torch.testing.assert_close(w[0], torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0]) / 10.0)


def test_critic_oracle_applies_the_softmax_rule_to_the_advantages():
    # e is ignored; advantages A = [0, 2 ln 2, 2 ln 3], T = 2: success [1, 2, 3] / 6, failure [6, 3, 2] / 11
    e = torch.tensor([[5.0, 0.0, 1.0], [5.0, 0.0, 1.0]])
    adv = torch.tensor([0.0, 2 * math.log(2), 2 * math.log(3)]).repeat(2, 1)
    w = credit_weights(e, torch.tensor([True, False]), 2.0, "critic_oracle", advantages=adv)
    torch.testing.assert_close(w, torch.tensor([[1 / 6, 2 / 6, 3 / 6], [6 / 11, 3 / 11, 2 / 11]]))
    with pytest.raises(ValueError, match="advantages"):
        credit_weights(e, torch.tensor([True, False]), 2.0, "critic_oracle")


def test_w_min_w_max_clip_then_renormalise_by_hand():
    # T = 1, success, e = [ln 7, 0, 0, 0]: w = [.7, .1, .1, .1]
    e = torch.tensor([[math.log(7.0), 0.0, 0.0, 0.0]])
    s = torch.tensor([True])
    torch.testing.assert_close(credit_weights(e, s, 1.0), torch.tensor([[0.7, 0.1, 0.1, 0.1]]))
    # w_max = .4: [.4, .1, .1, .1] / .7
    torch.testing.assert_close(credit_weights(e, s, 1.0, w_max=0.4), torch.tensor([[4.0, 1.0, 1.0, 1.0]]) / 7)
    # w_min = .15: [.7, .15, .15, .15] / 1.15
    torch.testing.assert_close(credit_weights(e, s, 1.0, w_min=0.15),
                               torch.tensor([[0.7, 0.15, 0.15, 0.15]]) / 1.15)
    # both: [.4, .15, .15, .15] / .85; a padded step stays 0 (w_min must not revive it)
    e5 = torch.cat([e, torch.zeros(1, 1)], 1)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    torch.testing.assert_close(credit_weights(e5, s, 1.0, mask=mask, w_min=0.15, w_max=0.4),
                               torch.tensor([[0.4, 0.15, 0.15, 0.15, 0.0]]) / 0.85)


def test_shaped_lambda_mixes_signed_errors_and_reward_differences():
    # lambda = .25, T = .5, e = [1, 2], reward_diff = [.5, -.5]
    #   success: logits = .25 [1, 2] + .75 [.5, -.5] = [.625, .125] -> /T [1.25, .25] -> w0 = sigmoid(1)
    #   failure: logits = .25 [-1, -2] + .75 [.5, -.5] = [.125, -.875] -> /T [.25, -1.75] -> w0 = sigmoid(2)
    e = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    rd = torch.tensor([[0.5, -0.5], [0.5, -0.5]])
    w = credit_weights(e, torch.tensor([True, False]), 0.5, shaped_lambda=0.25, reward_diff=rd)
    s1, s2 = 1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(-2.0))
    torch.testing.assert_close(w, torch.tensor([[s1, 1 - s1], [s2, 1 - s2]]))
    with pytest.raises(ValueError, match="reward_diff"):
        credit_weights(e, torch.tensor([True, False]), 0.5, shaped_lambda=0.25)


def test_standardize_per_episode_by_hand():
    # row 0: [1, 2, 3], mean 2, population std sqrt(2/3); row 1: two real steps [4, 8] -> [-1, 1];
    # row 2: one step -> 0; padded steps -> 0
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 8.0, 100.0], [7.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(standardize_per_episode(x, mask),
                               torch.tensor([[-1 / s, 0.0, 1 / s], [-1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_standardised_weights_are_invariant_to_shifting_and_scaling_e_per_episode():
    g = torch.Generator().manual_seed(0)
    e = torch.rand(3, 6, generator=g) * 30
    mask = torch.arange(6)[None] < torch.tensor([[6], [4], [5]])
    success = torch.tensor([True, False, True])
    w = credit_weights(e, success, 0.5, "softmax", mask, standardize=True)
    moved = e * torch.tensor([[3.0], [0.1], [12.0]]) + torch.tensor([[-5.0], [40.0], [2.0]])
    torch.testing.assert_close(credit_weights(moved, success, 0.5, "softmax", mask, standardize=True), w)
    # the literal rule is only shift-invariant: scaling e changes its sharpness
    lit = credit_weights(e, success, 0.5, "softmax", mask)
    assert not torch.allclose(credit_weights(e * 3, success, 0.5, "softmax", mask), lit, atol=1e-3)
    # by hand on one row: z = [-1, 1] (two steps), success softmax(z / T) with T = 1
    w2 = credit_weights(torch.tensor([[10.0, 30.0]]), torch.tensor([True]), 1.0, standardize=True)
    torch.testing.assert_close(w2, torch.tensor([[1.0, math.exp(2.0)]]) / (1 + math.exp(2.0)))


def test_mean_one_scale_multiplies_each_episode_by_its_length():
    e = torch.tensor([[1.0, 2.0, 3.0, 0.5], [4.0, 5.0, 7.0, 9.0], [0.3, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    success = torch.tensor([True, False, True])
    for mode in ("softmax", "normalized", "uniform", "random", "inverse"):
        gen = lambda: torch.Generator().manual_seed(0)   # noqa: E731
        w1 = credit_weights(e, success, 0.5, mode, mask, generator=gen())
        wm = credit_weights(e, success, 0.5, mode, mask, generator=gen(), scale="mean_one")
        torch.testing.assert_close(wm, w1 * torch.tensor([[4.0], [2.0], [1.0]]), msg=mode)
        torch.testing.assert_close(wm.sum(1), torch.tensor([4.0, 2.0, 1.0]), msg=mode)
        assert torch.all(wm[~mask] == 0), mode
    uniform = credit_weights(e, success, 0.5, "uniform", mask, scale="mean_one")
    torch.testing.assert_close(uniform, mask.float())
    with pytest.raises(ValueError, match="weight scale"):
        credit_weights(e, success, 0.5, scale="sum")


def test_episode_mean_scale_gives_every_episode_the_batch_mean_length():
    """Lengths 4, 2, 1 (mean 7/3): each row sums to 7/3 whatever its length, so a short success
    weighs what a long failure does; uniform steps get 7/3 / H_e; the total is mean_one's (7)."""
    e = torch.tensor([[1.0, 2.0, 3.0, 0.5], [4.0, 5.0, 7.0, 9.0], [0.3, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    success = torch.tensor([True, False, True])
    for mode in ("softmax", "normalized", "uniform"):
        w1 = credit_weights(e, success, 0.5, mode, mask)
        we = credit_weights(e, success, 0.5, mode, mask, scale="episode_mean")
        torch.testing.assert_close(we, w1 * 7.0 / 3.0, msg=mode)
        torch.testing.assert_close(we.sum(1), torch.full((3,), 7.0 / 3.0), msg=mode)
    uniform = credit_weights(e, success, 0.5, "uniform", mask, scale="episode_mean")
    torch.testing.assert_close(uniform[0, 0], torch.tensor(7.0 / 12.0))   # 7/3 over 4 steps
    torch.testing.assert_close(uniform[2, 0], torch.tensor(7.0 / 3.0))    # one step
    torch.testing.assert_close(uniform.sum(), credit_weights(e, success, 0.5, "uniform", mask,
                                                             scale="mean_one").sum())


def test_self_annotation_averages_the_draws_and_divides_by_t_mid_squared():
    # v = 0: a_hat = x, so e = t^2 || a - eps ||^2 for each draw (summed over chunk and action dims)
    a = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(1))
    zero_field = lambda x, tau, obs: torch.zeros_like(x)   # noqa: E731
    t = torch.tensor([0.3, 0.5, 0.7, 0.4, 0.6])
    gen = torch.Generator().manual_seed(2)
    e = self_annotation(zero_field, None, a, t, 3, torch.Generator().manual_seed(2))
    draws = [torch.randn(a.shape, generator=gen) for _ in range(3)]
    expect = sum(t ** 2 * (a - eps).pow(2).sum(dim=(1, 2)) for eps in draws) / 3
    torch.testing.assert_close(e, expect)
    per_time = self_annotation(zero_field, None, a, t, 3, torch.Generator().manual_seed(2), per_unit_time=True)
    torch.testing.assert_close(per_time, expect / t ** 2)
    # averaging lowers the draw-to-draw spread: the std of e over 64 single draws vs 16-draw means
    singles = torch.stack([self_annotation(zero_field, None, a, 0.5, 1, torch.Generator().manual_seed(s))
                           for s in range(64)])
    means = torch.stack([self_annotation(zero_field, None, a, 0.5, 16, torch.Generator().manual_seed(s))
                         for s in range(64)])
    assert (means.std(0) < 0.5 * singles.std(0)).all()


def test_episode_correlation_by_hand():
    # episode 0: y = 2x + 1 (corr 1); episode 1: y = -x on its 3 real steps (corr -1); episode 2: one step
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 5.0, 9.0], [3.0, 0.0, 0.0, 0.0]])
    y = torch.tensor([[3.0, 5.0, 7.0, 9.0], [0.0, -1.0, -5.0, 7.0], [1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert episode_correlation(x, y, mask) == pytest.approx(0.0, abs=1e-6)       # (1 + -1) / 2
    assert episode_correlation(x[:1], y[:1], mask[:1]) == pytest.approx(1.0, abs=1e-6)
    # against numpy on random rows
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    full = torch.ones(3, 7, dtype=torch.bool)
    expect = np.mean([np.corrcoef(a[i].numpy(), b[i].numpy())[0, 1] for i in range(3)])
    assert episode_correlation(a, b, full) == pytest.approx(expect, abs=1e-5)
    assert math.isnan(episode_correlation(x[2:], y[2:], mask[2:]))


def test_critic_oracle_mode_reports_the_correlation_of_e_and_the_advantages():
    algo = FlowSAR(tiny_cfg(weight_mode="critic_oracle"), SPEC, torch.device("cpu"))
    out = algo.prepare([make_batch(0, ends={(5, 0): "term", (5, 1): "term"}, rewards={(5, 0): 1.0})])
    assert -1.0 <= out["stats"]["flowsar/oracle_corr"] <= 1.0
    plain = FlowSAR(tiny_cfg(), SPEC, torch.device("cpu"))
    out = plain.prepare([make_batch(0, ends={(5, 0): "term", (5, 1): "term"}, rewards={(5, 0): 1.0})])
    assert "flowsar/oracle_corr" not in out["stats"]


def test_centred_labels_by_hand():
    # 1 success in 4: A = (R - .25) / (sqrt(3) / 4) = [sqrt(3), -1 / sqrt(3) x 3]; with DiffusionNFT's
    # c = 5 nothing is clipped: r = 1/2 + A / 10
    r = centred_labels(torch.tensor([True, False, False, False]))
    s, f = 0.5 + math.sqrt(3) / 10, 0.5 - 1 / (10 * math.sqrt(3))
    torch.testing.assert_close(r, torch.tensor([s, f, f, f]))
    torch.testing.assert_close((2 * r - 1).mean(), torch.tensor(0.0))     # pulls and pushes balance
    # 1 failure in 4: mirrored
    torch.testing.assert_close(centred_labels(torch.tensor([False, True, True, True])),
                               torch.tensor([1 - s, 1 - f, 1 - f, 1 - f]))
    # one outcome only: no contrast
    torch.testing.assert_close(centred_labels(torch.tensor([True, True])), torch.tensor([0.5, 0.5]))


def test_centred_labels_clipped_on_one_side_tilt_the_batch():
    # c = 1 clips the success's A = sqrt(3) to 1: r = [1, .5 - .289 x 3], and the labels y = 2r - 1
    # no longer average 0 but 1/4 (1 - sqrt(3)) < 0: the batch pushes away from what it did
    r = centred_labels(torch.tensor([True, False, False, False]), clip=1.0)
    f = 0.5 - 0.5 / math.sqrt(3)
    torch.testing.assert_close(r, torch.tensor([1.0, f, f, f]))
    torch.testing.assert_close((2 * r - 1).mean(), torch.tensor((1 - math.sqrt(3)) / 4))
    # 1 success in 26 is the last rate c = 5 leaves unclipped (A = 5 exactly); 1 in 27 is clipped
    for n, balanced in ((26, True), (27, False)):
        y = 2 * centred_labels(torch.arange(n) == 0) - 1
        assert (abs(float(y.mean())) < 1e-6) == balanced


def test_uniform_mean_one_mse_branch_is_diffusionnfts_loss_on_a_toy_batch():
    # DiffusionNFT (its Eq. for the policy loss): mean_i [ r_i ||v+ - u||^2 + (1 - r_i) ||v- - u||^2 ]
    # with v+ = (1 - beta) v_old + beta v, v- = (1 + beta) v_old - beta v, || . ||^2 a mean over dims.
    g = torch.Generator().manual_seed(3)
    v_old, v, u = (torch.randn(6, 4, 3, generator=g) for _ in range(3))
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    beta = 0.7
    vp, vn = (1 - beta) * v_old + beta * v, (1 + beta) * v_old - beta * v
    nft = (r * (vp - u).pow(2).mean(dim=(1, 2)) + (1 - r) * (vn - u).pow(2).mean(dim=(1, 2))).mean()
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)    # two episodes of 3 steps
    w = credit_weights(torch.rand(2, 4), torch.tensor([True, False]), 0.5, "uniform", mask,
                       scale="mean_one")[mask]
    loss = flowsar_loss(v, v_old, u, w, r, beta, loss_variant="mse_branch")
    torch.testing.assert_close(loss, nft)
    # the spec's sum-to-1 weights make the same loss 3 times weaker
    w_sum = credit_weights(torch.rand(2, 4), torch.tensor([True, False]), 0.5, "uniform", mask)[mask]
    torch.testing.assert_close(flowsar_loss(v, v_old, u, w_sum, r, beta, loss_variant="mse_branch"), nft / 3)


def test_unknown_weight_mode_raises():
    with pytest.raises(ValueError, match="weight mode"):
        credit_weights(torch.ones(1, 2), torch.tensor([True]), 0.5, "softmaxx")


# ------------------------------------------------------------------ mirror energies and the loss

def _leaf(values):
    return torch.tensor(values, requires_grad=True)


def test_mirror_energies_by_hand():
    # beta = .5, v_old = [1, 0], v = [3, 2], u = [0, 0]:
    #   v+ = .5 v_old + .5 v = [2, 1],   E+ = mean([4, 1]) = 2.5
    #   v- = 1.5 v_old - .5 v = [0, -1], E- = mean([0, 1]) = .5
    v, v_old, u = torch.tensor([[[3.0, 2.0]]]), torch.tensor([[[1.0, 0.0]]]), torch.zeros(1, 1, 2)
    e_pos, e_neg = mirror_energies(v, v_old, u, 0.5)
    assert e_pos.tolist() == [2.5] and e_neg.tolist() == [0.5]


def test_energies_and_losses_count_only_the_executed_rows():
    # Two rows, the second never executed. Row 1 as in the test above (E+ 2.5, E- .5); row 2 is
    # anything: with row_mask [1, 0] the energies are row 1's, without it the mean of both rows.
    v = torch.tensor([[[3.0, 2.0], [7.0, -4.0]]], requires_grad=True)
    v_old, u = torch.tensor([[[1.0, 0.0], [0.0, 5.0]]]), torch.zeros(1, 2, 2)
    rows = torch.tensor([[1.0, 0.0]])
    e_pos, e_neg = mirror_energies(v, v_old, u, 0.5, row_mask=rows)
    assert e_pos.tolist() == [2.5] and e_neg.tolist() == [0.5]
    # row 2 alone: v+ = [3.5, .5] -> 6.25; v- = [-3.5, 9.5] -> 51.25; all rows: the means
    assert mirror_energies(v, v_old, u, 0.5)[0].tolist() == [(2.5 + 6.25) / 2]
    for variant in ("softplus_kl", "mse_branch", "simple", "rft"):
        v.grad = None
        loss = flowsar_loss(v, v_old, u, torch.ones(1), torch.ones(1), 0.5, loss_variant=variant, row_mask=rows)
        loss.backward()
        assert v.grad[0, 1].abs().max() == 0, variant            # nothing reaches the unexecuted row
        assert v.grad[0, 0].abs().max() > 0, variant
    # the KL term by hand over row 1: mean((v - v_old)^2) = (4 + 4) / 2 = 4
    kl_only = flowsar_loss(v, v_old, u, torch.zeros(1), torch.ones(1), 0.5, kl_coeff=1.0, row_mask=rows)
    assert kl_only.item() == pytest.approx(4.0)
    # a chunk that ran no row (never happens in a rollout) gives 0, not NaN
    assert mirror_energies(v, v_old, u, 0.5, row_mask=torch.zeros(1, 2))[0].tolist() == [0.0]


def test_reconstruction_error_sums_only_the_executed_rows():
    # the constant field of the first test on row 1 (e = 1.953125); row 2 differs, masked out
    a = torch.tensor([[[1.0, 2.0], [9.0, 9.0]]])
    eps = torch.tensor([[[3.0, -1.0], [0.0, 0.0]]])
    c = torch.tensor([0.5, -2.0])
    field = lambda x, tau, obs: c.expand_as(x)   # noqa: E731
    e = reconstruction_error(field, None, a, eps, 0.25, row_mask=torch.tensor([[1.0, 0.0]]))
    assert e.item() == pytest.approx(1.953125, abs=1e-6)
    # row 2 alone: t^2 ||(a - eps) - c||^2 = .0625 * (8.5^2 + 11^2)
    assert reconstruction_error(field, None, a, eps, 0.25).item() == pytest.approx(
        1.953125 + 0.0625 * (8.5 ** 2 + 11 ** 2), abs=1e-5)


def test_sde_energies_are_divided_by_two_t_clamped_at_1e_3():
    v = torch.tensor([[[3.0, 2.0]], [[3.0, 2.0]]])
    v_old = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])
    u = torch.zeros(2, 1, 2)
    e_pos, e_neg = mirror_energies(v, v_old, u, 0.5, "sde", flow_t=torch.tensor([0.25, 0.0]))
    # mse energies are [2.5, 2.5] and [.5, .5]; t = .25 -> x 2 exactly, t = 0 -> x 1 / .002 = 500
    assert e_pos[0].item() == 5.0 and e_neg[0].item() == 1.0
    assert e_pos[1].item() == pytest.approx(1250.0, rel=1e-5)
    assert e_neg[1].item() == pytest.approx(250.0, rel=1e-5)
    with pytest.raises(ValueError, match="flow_t"):
        mirror_energies(v, v_old, u, 0.5, "sde")


def test_mse_branch_failure_pushes_v_to_the_mirror_point():
    # R = 0, beta = 1: loss = w E- = w mean((2 v_old - v - u)^2), minimised at v = 2 v_old - u.
    v_old = torch.tensor([[[0.5, -1.25], [2.0, 0.25]]])
    u = torch.tensor([[[1.5, 0.75], [-0.5, 0.5]]])
    mirror = 2 * v_old - u                                         # dyadic: exact in float32
    v = (v_old + 0.25).clone().requires_grad_(True)
    w, r = torch.tensor([1.0]), torch.tensor([0.0])
    dists = [float((v.detach() - mirror).norm())]
    for _ in range(10):
        loss = flowsar_loss(v, v_old, u, w, r, 1.0, loss_variant="mse_branch")
        (g,) = torch.autograd.grad(loss, v)
        with torch.no_grad():
            v -= 0.5 * g
        dists.append(float((v.detach() - mirror).norm()))
    assert all(b < a for a, b in zip(dists, dists[1:])), dists
    assert dists[-1] < 0.2 * dists[0]
    at = mirror.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(flowsar_loss(at, v_old, u, w, r, 1.0, loss_variant="mse_branch"), at)
    assert torch.all(g == 0)


def test_mse_branch_success_pushes_v_to_the_target():
    v_old = torch.tensor([[[0.5, -1.25], [2.0, 0.25]]])
    u = torch.tensor([[[1.5, 0.75], [-0.5, 0.5]]])
    v = v_old.clone().requires_grad_(True)
    w, r = torch.tensor([1.0]), torch.tensor([1.0])
    # beta = 1: E+ = mean((v - u)^2); one step of lr 1 on grad 2 (v - u) / 4 halves the gap
    loss = flowsar_loss(v, v_old, u, w, r, 1.0, loss_variant="mse_branch")
    assert loss.item() == pytest.approx(float((v_old - u).pow(2).mean()))
    (g,) = torch.autograd.grad(loss, v)
    torch.testing.assert_close(g, 2 * (v_old - u) / 4)
    at = u.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(flowsar_loss(at, v_old, u, w, r, 1.0, loss_variant="mse_branch"), at)
    assert torch.all(g == 0)


def test_mse_branch_value_by_hand():
    # two samples, beta = .5, v_old = [1, 0], v = [3, 2], u = [0, 0]: E+ = 2.5, E- = .5
    # sample 1 success w = .2: .2 * 2.5 = .5; sample 2 failure w = .6: .6 * .5 = .3; mean = .4
    v = torch.tensor([[[3.0, 2.0]], [[3.0, 2.0]]])
    v_old = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])
    loss = flowsar_loss(v, v_old, torch.zeros(2, 1, 2), torch.tensor([0.2, 0.6]), torch.tensor([1.0, 0.0]),
                        0.5, loss_variant="mse_branch")
    assert loss.item() == pytest.approx(0.4)


def test_softplus_kl_gradient_at_v_old_matches_the_hand_formula():
    # At v = v_old: E+ = E-, softplus' = sigmoid(0) = 1/2, and per sample
    #   d/dv = w * 1/2 * 1/2 * y * (dE+/dv - dE-/dv) / B
    #   dE+/dv = 2 beta (v+ - u) / n,  dE-/dv = -2 beta (v- - u) / n,  v+ = v- = v_old
    # (the KL term has zero gradient there). y = +1: gradient ~ +(v_old - u), so descent moves v
    # toward u; y = -1: away from u.
    beta, n, b = 0.5, 4, 2
    v_old = torch.tensor([[[0.5, -1.0], [2.0, 0.0]], [[0.5, -1.0], [2.0, 0.0]]])
    u = torch.tensor([[[1.0, 1.0], [-1.0, 0.5]], [[1.0, 1.0], [-1.0, 0.5]]])
    w = torch.tensor([0.3, 0.7])
    y = torch.tensor([1.0, -1.0])
    v = v_old.clone().requires_grad_(True)
    loss = flowsar_loss(v, v_old, u, w, (y + 1) / 2, beta, kl_coeff=1.0)
    (g,) = torch.autograd.grad(loss, v)
    de_pos = 2 * beta * (v_old - u) / n
    de_neg = -2 * beta * (v_old - u) / n
    expect = (w * 0.5 * 0.5 * y)[:, None, None] * (de_pos - de_neg) / b
    torch.testing.assert_close(g, expect)
    step = v.detach() - 0.1 * g
    assert (step[0] - u[0]).norm() < (v_old[0] - u[0]).norm()    # success: toward u
    assert (step[1] - u[1]).norm() > (v_old[1] - u[1]).norm()    # failure: away from u


def test_softplus_kl_value_and_unweighted_kl_term_by_hand():
    # beta = 1, v_old = [0, 0], v = [1, 0], u = [1, 1], R = 1, kl_coeff = 2:
    #   v+ = [1, 0], E+ = mean([0, 1]) = .5;  v- = [-1, 0], E- = mean([4, 1]) = 2.5
    #   softplus(.5 * (.5 - 2.5)) = ln(1 + e^-1);  KL = mean([1, 0]) = .5 -> 2 * .5 = 1
    v, v_old, u = torch.tensor([[[1.0, 0.0]]]), torch.zeros(1, 1, 2), torch.tensor([[[1.0, 1.0]]])
    r = torch.tensor([1.0])
    loss = flowsar_loss(v, v_old, u, torch.tensor([0.5]), r, 1.0, kl_coeff=2.0)
    assert loss.item() == pytest.approx(0.5 * math.log(1 + math.exp(-1.0)) + 1.0, rel=1e-6)
    # weight 0 removes the softplus part only: the KL term is not weighted
    assert flowsar_loss(v, v_old, u, torch.tensor([0.0]), r, 1.0, kl_coeff=2.0).item() == pytest.approx(1.0)
    assert flowsar_loss(v, v_old, u, torch.tensor([1.0]), r, 1.0, kl_coeff=0.0).item() == \
        pytest.approx(math.log(1 + math.exp(-1.0)), rel=1e-6)


@pytest.mark.parametrize("variant", ["softplus_kl", "mse_branch", "simple", "rft"])
@pytest.mark.parametrize("energy", ["mse", "sde"])
def test_no_gradient_reaches_v_old(variant, energy):
    torch.manual_seed(0)
    v_old = torch.randn(3, 2, 2, requires_grad=True)
    v = torch.randn(3, 2, 2, requires_grad=True)
    loss = flowsar_loss(v, v_old, torch.randn(3, 2, 2), torch.rand(3), torch.tensor([1.0, 0.0, 1.0]), 0.7,
                        energy, variant, kl_coeff=1.0, flow_t=torch.tensor([0.2, 0.5, 0.8]))
    loss.backward()
    assert v_old.grad is None
    assert v.grad is not None and v.grad.abs().sum() > 0


@pytest.mark.parametrize("variant", ["softplus_kl", "mse_branch"])
def test_loss_is_invariant_to_flipping_the_time_convention(variant):
    # the package's (v, u) and the spec's (-v, -u) give the same loss: every term is a squared norm
    torch.manual_seed(1)
    v, v_old, u = torch.randn(4, 3, 2), torch.randn(4, 3, 2), torch.randn(4, 3, 2)
    w, r, t = torch.rand(4), torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.rand(4)
    for energy in ("mse", "sde"):
        a = flowsar_loss(v, v_old, u, w, r, 0.8, energy, variant, 0.5, flow_t=t)
        b = flowsar_loss(-v, -v_old, -u, w, r, 0.8, energy, variant, 0.5, flow_t=t)
        assert a.item() > 0
        torch.testing.assert_close(a, b)


def test_simple_variant_value_and_gradient_by_hand():
    # FlowSAR-simple: w y mean (v - u)^2 + kl mean (v - v_old)^2, y = 2R - 1.
    # v = [1, 0], u = [1, 1], v_old = [0, 0]: FM = .5, KL = .5.
    v, v_old, u = torch.tensor([[[1.0, 0.0]]]), torch.zeros(1, 1, 2), torch.tensor([[[1.0, 1.0]]])
    for r, y in ((1.0, 1.0), (0.0, -1.0)):
        loss = flowsar_loss(v, v_old, u, torch.tensor([2.0]), torch.tensor([r]), 1.0, loss_variant="simple",
                            kl_coeff=3.0)
        assert loss.item() == pytest.approx(2.0 * y * 0.5 + 3.0 * 0.5)
    # at v = v_old the KL gradient is 0: success descends toward u (FM), failure away (anti-FM)
    u = torch.tensor([[[1.0, -2.0]], [[1.0, -2.0]]])
    at = torch.zeros(2, 1, 2, requires_grad=True)
    loss = flowsar_loss(at, torch.zeros(2, 1, 2), u, torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0]), 1.0,
                        loss_variant="simple")
    (g,) = torch.autograd.grad(loss, at)
    # d/dv of w y mean((v - u)^2) / B = w y 2 (v - u) / n / B with n = 2, B = 2
    torch.testing.assert_close(g, torch.stack([1.0 * 2 * (0 - u[0]) / 2 / 2, -1.0 * 2 * (0 - u[1]) / 2 / 2]))


def test_rft_variant_is_flow_matching_on_the_successes_only():
    # R = 1: w mean (v - u)^2 (+ kl); R = 0: only the KL term, whose gradient is 0 at v = v_old
    g = torch.Generator().manual_seed(4)
    v_old, u = torch.randn(4, 3, 2, generator=g), torch.randn(4, 3, 2, generator=g)
    r, w = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 2.0, 1.0])
    v = v_old.clone().requires_grad_(True)
    loss = flowsar_loss(v, v_old, u, w, r, 1.0, loss_variant="rft", kl_coeff=5.0)
    fm = (v_old - u).pow(2).mean(dim=(1, 2))
    assert loss.item() == pytest.approx(((w * r * fm).sum() / 4).item(), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, v)
    assert torch.all(grad[[1, 3]] == 0)                                    # failures: no gradient
    torch.testing.assert_close(grad[0], 2 * (v_old[0] - u[0]) / 6 / 4)    # success: toward u
    # without KL it is the CFM loss of the successful samples (behaviour cloning on them)
    v2 = torch.randn(4, 3, 2, generator=g)
    bc = ((v2 - u).pow(2).mean(dim=(1, 2)) * r).mean()
    torch.testing.assert_close(flowsar_loss(v2, v_old, u, torch.ones(4), r, 1.0, loss_variant="rft", kl_coeff=0.0), bc)


def test_invalid_energy_type_and_loss_variant_raise():
    x = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError, match="energy type"):
        flowsar_loss(x, x, x, torch.ones(1), torch.ones(1), 1.0, energy_type="ode")
    with pytest.raises(ValueError, match="loss variant"):
        flowsar_loss(x, x, x, torch.ones(1), torch.ones(1), 1.0, loss_variant="hinge")


# ------------------------------------------------------------------ EMA

def test_linear_and_fixed_ema_coefficients():
    got = [ema_coefficient(i, "linear", eta_rate=0.001, eta_max=0.5) for i in (0, 100, 500, 1000)]
    assert got == pytest.approx([0.0, 0.1, 0.5, 0.5])
    assert ema_coefficient(0, "fixed", ema_beta=0.995) == 0.995
    assert ema_coefficient(10_000, "fixed", ema_beta=0.9) == 0.9
    with pytest.raises(ValueError, match="ema schedule"):
        ema_coefficient(0, "cosine")


# ------------------------------------------------------------------ the algorithm on batches

def make_batch(worker_id: int, ends: dict | None = None, rewards: dict | None = None, t: int = 6, n: int = 2,
               seed: int = 0, executed: dict | None = None, start_seeds: np.ndarray | None = None) -> Batch:
    """A time-major batch as the EnvRunner writes it. ``ends`` {(t, j): "term" | "trunc"},
    ``rewards`` {(t, j): r} (0 elsewhere); ``executed`` {(t, j): rows}: the batch carries
    ``executed_rows`` (act_steps 2 elsewhere), as the robot family's runner writes it."""
    rng = np.random.default_rng(seed)
    term, trunc = np.zeros((t, n), bool), np.zeros((t, n), bool)
    for (i, j), kind in (ends or {}).items():
        (term if kind == "term" else trunc)[i, j] = True
    r = np.zeros((t, n), np.float32)
    for (i, j), value in (rewards or {}).items():
        r[i, j] = value
    data = {"obs": rng.standard_normal((t, n, 19)).astype(np.float32),
            "actions": rng.uniform(-1, 1, (t, n, 4, 7)).astype(np.float32),
            "rewards": r, "terminated": term, "truncated": trunc,
            "final_obs": rng.standard_normal((t, n, 19)).astype(np.float32),
            "last_obs": rng.standard_normal((n, 19)).astype(np.float32)}
    if start_seeds is not None:                                   # [t, n]: each step's episode's start
        data["start_seed"] = np.asarray(start_seeds, np.int64)
    if executed is not None:
        data["executed_rows"] = np.full((t, n), 2, np.int64)
        for (i, j), rows in executed.items():
            data["executed_rows"][i, j] = rows
    return Batch(data, BatchMeta(policy_version=0, worker_id=worker_id, env_steps=t * n))


def test_episode_spanning_two_batches_is_counted_once_it_ends():
    algo = FlowSAR(tiny_cfg(), SPEC, torch.device("cpu"))
    b1 = make_batch(0, seed=1)
    assert algo.prepare([b1]) is None                             # no episode ended yet
    assert algo.update(None) == {"flowsar/pending_steps": 12.0}
    # env 0 succeeds at t = 1 of the second batch (8 steps); env 1 is truncated at t = 5 (12 steps)
    b2 = make_batch(0, ends={(1, 0): "term", (5, 1): "trunc"}, rewards={(1, 0): 1.0}, seed=2)
    out = algo.prepare([b2])
    assert out["actions"].shape == (20, 4, 7) and out["obs"].shape == (20, 19)
    expect_actions = np.concatenate([b1["actions"][:, 0], b2["actions"][:2, 0], b1["actions"][:, 1], b2["actions"][:, 1]])
    assert np.array_equal(out["actions"].numpy(), expect_actions)
    assert out["weights"].shape == (20,)
    # the default episode_mean: each episode's weights sum to the mean length (8 + 12) / 2
    torch.testing.assert_close(out["weights"][:8].sum(), torch.tensor(10.0))
    torch.testing.assert_close(out["weights"][8:].sum(), torch.tensor(10.0))
    assert out["rewards"].tolist() == [1.0] * 8 + [0.0] * 12
    assert out["stats"]["flowsar/episodes"] == 2.0
    assert algo.assembler.pending_steps == 4                     # env 0, t = 2..5 of batch 2
    assert algo.update(out)["flowsar/pending_steps"] == 4.0


def test_any_positive_return_marks_every_step_a_success():
    # a reward in the middle of the episode (not at its end) still makes R = 1 for all its steps
    algo = FlowSAR(tiny_cfg(), SPEC, torch.device("cpu"))
    b = make_batch(0, ends={(3, 0): "term", (2, 1): "term"}, rewards={(1, 0): 0.5})
    out = algo.prepare([b])
    assert out["rewards"].tolist() == [1.0] * 4 + [0.0] * 3


def _errors_by_hand(algo, out, gen, draws: int, executed: int = 2) -> torch.Tensor:
    """e of the prepared steps under theta_old at t_mid = .5, averaged over ``draws`` eps drawn
    from ``gen`` (a copy of the algorithm's generator before prepare), from the equations, summed
    over the first ``executed`` rows of each chunk (tiny_cfg: act_steps 2 of horizon 4)."""
    a = out["actions"]
    total = torch.zeros(a.shape[0])
    with torch.no_grad():
        for _ in range(draws):
            eps = torch.randn(a.shape, generator=gen)
            x = 0.5 * a + 0.5 * eps
            v = algo.old.velocity(x, torch.full((a.shape[0],), 0.5), out["obs"])
            total += (a - (x + 0.5 * v))[:, :executed].pow(2).sum(dim=(1, 2))
    return total / draws


def test_a_chunk_cut_by_the_episodes_end_is_annotated_on_its_executed_rows_only():
    # Episode 0 ends at t = 3 after 1 row of its last chunk; every other chunk ran act_steps = 2
    # of its 4 rows. The row mask, and the errors (hence the weights) summed over those rows only.
    algo = FlowSAR(tiny_cfg(temperature=0.5, n_annotation_samples=1, error_scale="literal",
                            weight_scale="sum_one"), SPEC, torch.device("cpu"))
    b = make_batch(0, ends={(3, 0): "term", (5, 1): "term"}, rewards={(3, 0): 1.0}, seed=3,
                   executed={(3, 0): 1, (5, 1): 2})
    gen = torch.Generator()
    gen.set_state(algo.generator.get_state())
    out = algo.prepare([b])
    expect = torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 10)
    expect[3] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert torch.equal(out["row_mask"], expect)
    a, total = out["actions"], torch.zeros(10)
    with torch.no_grad():                                  # the equations, row by row
        eps = torch.randn(a.shape, generator=gen)
        x = 0.5 * a + 0.5 * eps
        v = algo.old.velocity(x, torch.full((10,), 0.5), out["obs"])
        sq = (a - (x + 0.5 * v)).pow(2).sum(-1)                                    # [10, 4]
        for i in range(10):
            total[i] = sq[i, :int(expect[i].sum())].sum()
    torch.testing.assert_close(out["weights"][:4], torch.softmax(total[:4] / 0.5, 0))
    torch.testing.assert_close(out["weights"][4:], torch.softmax(-total[4:] / 0.5, 0))
    stats = algo.update(out)
    assert math.isfinite(stats["flowsar/loss"]) and math.isfinite(stats["flowsar/kl"])


def test_grid_annotation_averages_e_over_t_mid_squared_across_the_grid():
    # tau_mid_sampling grid: for each t_mid of the grid (in order) n draws of eps, e / t_mid^2,
    # averaged over the grid (literal weights: the softmax of that average, as with one t_mid)
    algo = FlowSAR(tiny_cfg(tau_mid_sampling="grid", tau_mid_grid=[0.3, 0.6], n_annotation_samples=2,
                            error_scale="literal", weight_scale="sum_one", temperature=0.5),
                   SPEC, torch.device("cpu"))
    b = make_batch(0, ends={(3, 0): "term", (5, 1): "term"}, rewards={(3, 0): 1.0}, seed=3)
    gen = torch.Generator()
    gen.set_state(algo.generator.get_state())
    out = algo.prepare([b])
    a, total = out["actions"], torch.zeros(10)
    with torch.no_grad():
        for t in (0.3, 0.6):
            for _ in range(2):
                eps = torch.randn(a.shape, generator=gen)
                x = (1 - t) * a + t * eps
                v = algo.old.velocity(x, torch.full((10,), 1 - t), out["obs"])
                total += (a - (x + t * v))[:, :2].pow(2).sum(dim=(1, 2)) / 2 / t ** 2
    e = total / 2
    torch.testing.assert_close(out["weights"][:4], torch.softmax(e[:4] / 0.5, 0))
    torch.testing.assert_close(out["weights"][4:], torch.softmax(-e[4:] / 0.5, 0))


def test_the_anchor_adds_the_cfm_distance_to_the_base_and_survives_a_resume():
    # Two copies of the same run, anchor_coeff 0 and 2, both moved off the base by one update:
    # the loss of the same minibatch (same t and eps) differs by 2 * mean over the executed rows
    # of (v - v_base)^2, computed here from the equations; the anchor stays the base's weights.
    batch = make_batch(0, ends={(5, 0): "term", (5, 1): "term"}, rewards={(5, 0): 1.0})
    plain, anchored = (FlowSAR(tiny_cfg(anchor_coeff=k), SPEC, torch.device("cpu")) for k in (0.0, 2.0))
    base = _params(anchored.policy)
    assert plain.anchor is None and all(torch.equal(v, base[k]) for k, v in anchored.anchor.state_dict().items())
    out = plain.prepare([batch])
    anchored.prepare([batch])
    plain.update(out)
    anchored.load_state_dict({**copy.deepcopy(plain.state_dict()), "anchor": base})
    assert any(not torch.equal(v, base[k]) for k, v in anchored.policy.state_dict().items())
    mb = torch.arange(8)
    gen = torch.Generator()
    gen.set_state(plain.generator.get_state())
    loss0, _ = plain._minibatch_loss(out, mb, slice(None))
    loss2, stats = anchored._minibatch_loss(out, mb, slice(None))
    t = anchored.h.t_min + (anchored.h.t_max - anchored.h.t_min) * torch.rand(8, generator=gen)
    eps = torch.randn((8, 4, 7), generator=gen)
    a = out["actions"][:8]
    x = (1 - t)[:, None, None] * a + t[:, None, None] * eps
    with torch.no_grad():
        gap = (anchored.policy.velocity(x, 1 - t, out["obs"][:8]) - anchored.anchor.velocity(x, 1 - t, out["obs"][:8]))
    by_hand = gap[:, :2].pow(2).mean(dim=(1, 2)).mean()                   # act_steps 2 of 4 rows
    assert by_hand > 0
    assert (loss2 - loss0).item() == pytest.approx(2 * by_hand.item(), abs=1e-6)     # float32 loss ~1
    assert stats["flowsar/anchor"].item() == pytest.approx(by_hand.item(), rel=1e-4)
    anchored.update(out)
    again = FlowSAR(tiny_cfg(seed=3, anchor_coeff=2.0), SPEC, torch.device("cpu"))
    again.load_state_dict(copy.deepcopy(anchored.state_dict()))
    assert all(torch.equal(v, base[k]) for k, v in again.anchor.state_dict().items())


def test_value_labels_by_hand():
    # R = [1, 1, 0, 0], V = [.75, .25, .75, .25]: d = [.25, .75, -.75, -.25], mean 0, population std
    # sqrt(.3125); A = d / .5590 = [.4472, 1.3416, -1.3416, -.4472]; c = 5: r = .5 + A / 10
    r = value_labels(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0.75, 0.25, 0.75, 0.25]), clip=5.0)
    torch.testing.assert_close(r, torch.tensor([0.54472, 0.63416, 0.36584, 0.45528]), atol=1e-5, rtol=0)
    # c = 1 clips the two far steps: A = [.4472, 1, -1, -.4472] -> r = .5 + A / 2
    r = value_labels(torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0.75, 0.25, 0.75, 0.25]), clip=1.0)
    torch.testing.assert_close(r, torch.tensor([0.72361, 1.0, 0.0, 0.27639]), atol=1e-5, rtol=0)
    # the same success is worth more from a state that usually fails (V = .25) than from one that
    # usually succeeds (V = .75), and every step at its baseline gets r = 1/2
    assert r[1] > r[0] and r[2] < r[3]
    flat = value_labels(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]))
    assert flat.tolist() == [0.5, 0.5]


def test_value_baseline_labels_each_step_against_v_and_trains_v_on_the_outcomes():
    algo = FlowSAR(tiny_cfg(label_baseline="value"), SPEC, torch.device("cpu"))
    b = make_batch(0, ends={(3, 0): "term", (5, 1): "term"}, rewards={(3, 0): 1.0}, seed=3)
    with torch.no_grad():
        v = algo.critic(torch.as_tensor(np.concatenate([b["obs"][:4, 0], b["obs"][:, 1]])))
    out = algo.prepare([b])
    outcome = torch.tensor([1.0] * 4 + [0.0] * 6)
    torch.testing.assert_close(out["returns"], outcome)
    torch.testing.assert_close(out["rewards"], value_labels(outcome, v, 5.0))
    assert out["stats"]["flowsar/baseline_mean"] == pytest.approx(float(v.mean()), abs=1e-6)
    before = (v - outcome).pow(2).mean()
    for _ in range(30):                                              # the critic learns P(success | s)
        algo.update(out)
    with torch.no_grad():
        after = (algo.critic(out["obs"]) - outcome).pow(2).mean()
    assert after < 0.5 * before


def test_group_labels_by_hand():
    # K = 4: group 1 R = [1, 0, 0, 0] (mean .25, population std .4330): A = [1.7321, -.5774 x 3],
    # r = .5 + A / 10; group 2 all successes: no contrast, r = 1/2
    r = group_labels(torch.tensor([1, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool), 4, clip=5.0)
    torch.testing.assert_close(r, torch.tensor([0.67321, 0.44226, 0.44226, 0.44226, 0.5, 0.5, 0.5, 0.5]),
                               atol=1e-5, rtol=0)


def test_group_baseline_waits_for_the_start_group_then_labels_it_against_its_own_mean():
    # env.start_group 2: both env columns start each episode from one seed. Column 0 succeeds at
    # t = 3 of the first batch (seed 11), column 1 fails at t = 1 of the second (seed 11): the
    # first prepare holds the lone episode; the second releases the group, labels .5 +- .1.
    cfg = tiny_cfg(env={"start_group": 2}, label_baseline="group")
    algo = FlowSAR(cfg, SPEC, torch.device("cpu"))
    seeds1 = np.array([[11, 11]] * 4 + [[12, 11]] * 2)
    b1 = make_batch(0, ends={(3, 0): "term"}, rewards={(3, 0): 1.0}, start_seeds=seeds1, seed=1)
    assert algo.prepare([b1]) is None
    assert algo.update(None)["flowsar/pending_group_episodes"] == 1.0
    state = copy.deepcopy(algo.state_dict())
    seeds2 = np.array([[12, 11]] * 2 + [[12, 12]] * 4)
    b2 = make_batch(0, ends={(1, 1): "term"}, start_seeds=seeds2, seed=2)
    out = algo.prepare([b2])
    assert out["actions"].shape[0] == 4 + 8                  # column 0: 4 steps; column 1: 6 + 2
    torch.testing.assert_close(out["rewards"], torch.tensor([0.6] * 4 + [0.4] * 8))
    assert out["stats"]["flowsar/groups"] == 1.0 and out["stats"]["flowsar/groups_mixed"] == 1.0
    assert out["stats"]["flowsar/pending_group_episodes"] == 0.0
    resumed = FlowSAR(cfg, SPEC, torch.device("cpu"))        # the waiting episode survives a resume
    resumed.load_state_dict(state)
    again = resumed.prepare([b2])
    torch.testing.assert_close(again["rewards"], out["rewards"])
    torch.testing.assert_close(again["actions"], out["actions"])


def test_prepared_weights_literal_spec_are_the_softmax_of_the_old_policys_errors():
    # The spec's rule read literally: one eps draw, softmax(+-e / T) per episode, sum to 1.
    algo = FlowSAR(tiny_cfg(temperature=0.5, n_annotation_samples=1, error_scale="literal",
                            weight_scale="sum_one"), SPEC, torch.device("cpu"))
    b = make_batch(0, ends={(3, 0): "term", (5, 1): "term"}, rewards={(3, 0): 1.0}, seed=3)
    gen = torch.Generator()
    gen.set_state(algo.generator.get_state())
    out = algo.prepare([b])
    e = _errors_by_hand(algo, out, gen, draws=1)
    torch.testing.assert_close(out["weights"][:4], torch.softmax(e[:4] / 0.5, 0))
    torch.testing.assert_close(out["weights"][4:], torch.softmax(-e[4:] / 0.5, 0))
    assert out["rewards"].tolist() == [1.0] * 4 + [0.0] * 6


def test_prepared_weights_by_default_standardise_three_draws_and_sum_to_the_mean_length():
    # The default: e averaged over 3 eps draws, standardised per episode (population std),
    # softmax(+-z / T), times the batch's mean episode length (4 + 6) / 2 = 5.
    algo = FlowSAR(tiny_cfg(temperature=0.5), SPEC, torch.device("cpu"))
    b = make_batch(0, ends={(3, 0): "term", (5, 1): "term"}, rewards={(3, 0): 1.0}, seed=3)
    gen = torch.Generator()
    gen.set_state(algo.generator.get_state())
    out = algo.prepare([b])
    e = _errors_by_hand(algo, out, gen, draws=3)
    z = lambda x: (x - x.mean()) / (x.std(unbiased=False) + 1e-8)   # noqa: E731
    torch.testing.assert_close(out["weights"][:4], 5 * torch.softmax(z(e[:4]) / 0.5, 0))
    torch.testing.assert_close(out["weights"][4:], 5 * torch.softmax(-z(e[4:]) / 0.5, 0))
    torch.testing.assert_close(out["weights"].sum(), torch.tensor(10.0))    # the batch's steps


def test_batch_label_baseline_gives_the_centred_labels_to_every_step():
    algo = FlowSAR(tiny_cfg(label_baseline="batch"), SPEC, torch.device("cpu"))
    # 4 episodes, 1 success: R - mean = [.75, -.25, -.25, -.25], std = sqrt(3) / 4
    b = make_batch(0, ends={(1, 0): "term", (2, 1): "term", (3, 2): "term", (5, 3): "term"},
                   rewards={(1, 0): 1.0}, n=4, seed=3)
    out = algo.prepare([b])
    r_win, r_fail = 0.5 + math.sqrt(3) / 10, 0.5 - 1 / (10 * math.sqrt(3))     # r = 1/2 + A / (2 c), c = 5
    lengths = [2, 3, 4, 6]
    expect = torch.tensor([r_win] * 2 + [r_fail] * (3 + 4 + 6))
    assert out["weights"].shape[0] == sum(lengths)
    torch.testing.assert_close(out["rewards"], expect)
    assert out["stats"]["flowsar/label_mean"] == pytest.approx(0.5)
    clipped = FlowSAR(tiny_cfg(label_baseline="batch", label_clip=1.0), SPEC, torch.device("cpu"))
    out = clipped.prepare([b])
    torch.testing.assert_close(out["rewards"][:2], torch.tensor([1.0, 1.0]))


def test_label_shuffle_permutes_the_outcomes_that_labels_and_weights_read():
    # 4 episodes (2, 3, 4, 6 steps), episode 0 the only success. The control draws one
    # permutation of the 4 outcomes from the algorithm's generator before the annotation's
    # eps; labels and softmax signs follow the permuted outcomes, the logged success rate the
    # true ones.
    ends = {(1, 0): "term", (2, 1): "term", (3, 2): "term", (5, 3): "term"}
    lengths = [2, 3, 4, 6]
    winners = set()
    for seed in range(6):
        algo = FlowSAR(tiny_cfg(seed=seed, label_baseline="batch", temperature=0.5, label_shuffle=True),
                       SPEC, torch.device("cpu"))
        b = make_batch(0, ends=ends, rewards={(1, 0): 1.0}, n=4, seed=3)
        gen = torch.Generator()
        gen.set_state(algo.generator.get_state())
        perm = torch.randperm(4, generator=gen)
        outcome = torch.tensor([True, False, False, False])[perm]
        out = algo.prepare([b])
        r_win, r_fail = 0.5 + math.sqrt(3) / 10, 0.5 - 1 / (10 * math.sqrt(3))
        expect = torch.cat([torch.full((n,), r_win if won else r_fail) for n, won in zip(lengths, outcome.tolist())])
        torch.testing.assert_close(out["rewards"], expect)
        e = _errors_by_hand(algo, out, gen, draws=3)
        z = lambda x: (x - x.mean()) / (x.std(unbiased=False) + 1e-8)   # noqa: E731
        start = 0
        for n, won in zip(lengths, outcome.tolist()):
            sign = 1.0 if won else -1.0
            torch.testing.assert_close(out["weights"][start:start + n],
                                       3.75 * torch.softmax(sign * z(e[start:start + n]) / 0.5, 0))
            start += n
        assert out["stats"]["flowsar/episode_success"] == pytest.approx(0.25)
        winners.add(int(torch.nonzero(outcome)))
    assert len(winners) > 1                    # the success label moves between episodes


def _params(module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_first_update_publishes_the_trained_policy_then_the_ema_mix():
    algo = FlowSAR(tiny_cfg(), SPEC, torch.device("cpu"))
    init = _params(algo.policy)
    out = algo.prepare([make_batch(0, ends={(5, 0): "term", (5, 1): "term"}, rewards={(5, 0): 1.0})])
    m = algo.update(out)
    assert m["flowsar/ema_coefficient"] == 0.0 and algo.iteration == 1
    trained = _params(algo.policy)
    assert any(not torch.equal(init[k], trained[k]) for k in init)       # the update moved theta
    published = algo.policy_state_dict()
    assert published.keys() == trained.keys()
    assert all(torch.equal(published[k], trained[k]) for k in trained)   # b = 0: theta_old = theta
    # later: b = min(.001 i, .5) = .3 at i = 300
    algo.iteration = 300
    old_before = _params(algo.old)
    m = algo.update(out)
    assert m["flowsar/ema_coefficient"] == pytest.approx(0.3)
    trained = _params(algo.policy)
    published = algo.policy_state_dict()
    for k in trained:
        torch.testing.assert_close(published[k], 0.3 * old_before[k] + 0.7 * trained[k])
    assert any(not torch.equal(published[k], trained[k]) for k in trained)


def test_state_dict_round_trip_restores_policies_and_carried_tails():
    a = FlowSAR(tiny_cfg(), SPEC, torch.device("cpu"))
    # env 0 ends at t = 2 (3 steps), env 1 carries 6 steps and env 0 carries 3
    a.update(a.prepare([make_batch(0, ends={(2, 0): "term"}, rewards={(2, 0): 1.0}, seed=4)]))
    a.update(a.prepare([make_batch(0, ends={(1, 0): "term"}, seed=5)]))      # b = .001: old != policy
    assert a.assembler.pending_steps == 4 + 12
    state = copy.deepcopy(a.state_dict())
    b = FlowSAR(tiny_cfg(seed=1), SPEC, torch.device("cpu"))                 # different init
    assert any(not torch.equal(v, b.policy.state_dict()[k]) for k, v in a.policy.state_dict().items())
    b.load_state_dict(state)
    for mine, theirs in ((a.policy, b.policy), (a.old, b.old)):
        assert all(torch.equal(v, theirs.state_dict()[k]) for k, v in mine.state_dict().items())
    assert b.iteration == a.iteration == 2
    assert b.assembler.pending_steps == a.assembler.pending_steps
    assert set(b.assembler.tails) == set(a.assembler.tails)
    # both go on identically: the carried tails end up in the same episodes, the same weights
    nxt = make_batch(0, ends={(0, 0): "term", (3, 1): "trunc"}, rewards={(0, 1): 1.0}, seed=6)
    pa, pb = a.prepare([nxt]), b.prepare([nxt])
    assert pa["actions"].shape[0] == 4 + 1 + 12 + 4
    for k in ("actions", "obs", "weights", "rewards"):
        assert torch.equal(pa[k], pb[k]), k
    ma, mb = a.update(pa), b.update(pb)
    assert ma["flowsar/loss"] == mb["flowsar/loss"]


def test_lr_warm_up_is_linear_over_its_iterations_and_survives_a_resume():
    a = FlowSAR(tiny_cfg(lr_warmup_iters=3), SPEC, torch.device("cpu"))
    batch = make_batch(0, ends={(5, 0): "term", (5, 1): "term"}, rewards={(5, 0): 1.0})
    lrs = [a.update(a.prepare([batch]))["flowsar/lr"] for _ in range(2)]
    b = FlowSAR(tiny_cfg(lr_warmup_iters=3), SPEC, torch.device("cpu"))
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    lrs += [b.update(b.prepare([batch]))["flowsar/lr"] for _ in range(2)]
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])


@pytest.mark.parametrize("overrides, pattern", [
    ({"t_min": 0.8, "t_max": 0.8}, r"algo\.t_min"),
    ({"t_min": 0.9, "t_max": 0.5}, r"algo\.t_min"),
    ({"betta": 1.0}, r"algo\.betta.*algo\.beta'"),
    ({"weight_mode": "foo"}, r"algo\.weight_mode.*foo"),
    ({"w_min": 0.5, "w_max": 0.2}, r"algo\.w_min"),
    ({"tau_mid": 1.0}, r"algo\.tau_mid"),
    ({"error_scale": "zscore"}, r"algo\.error_scale.*zscore"),
    ({"weight_scale": "sum"}, r"algo\.weight_scale.*sum"),
    ({"label_baseline": "groups"}, r"algo\.label_baseline.*groups"),
    ({"label_clip": 0.0}, r"algo\.label_clip"),
    ({"label_shuffle": True, "weight_mode": "critic_oracle"}, r"algo\.label_shuffle"),
    ({"label_shuffle": True, "shaped_lambda": 0.5}, r"algo\.label_shuffle"),
    ({"n_annotation_samples": 0}, r"algo\.n_annotation_samples"),
    ({"tau_mid_sampling": "grid", "tau_mid_grid": [0.5, 1.0]}, r"algo\.tau_mid_grid"),
    ({"tau_mid_sampling": "grid", "tau_mid_grid": []}, r"algo\.tau_mid_grid"),
    ({"anchor_coeff": -1.0}, r"algo\.anchor_coeff"),
    ({"label_baseline": "value", "weight_mode": "critic_oracle"}, r"algo\.label_baseline.*one critic"),
    ({"label_baseline": "group"}, r"algo\.label_baseline.*env\.start_group"),
])
def test_config_mistakes_name_the_key(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        tiny_cfg(**overrides)


def test_gym_env_family_is_rejected_naming_env_family():
    with pytest.raises(ConfigError, match=r"env\.family"):
        config_from_dict({"algorithm": "flowsar", "env": {"family": "gym", "id": "Pendulum-v1"},
                          "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 6},
                          "algo": {"minibatch_size": 4}})


def test_analysis_marks_the_grasp_and_success_steps(tmp_path, monkeypatch):
    # the per-step error plot draws a dashed line at the first held step and a dotted one at a
    # success's last step; the marker positions are read off matplotlib's axvline calls
    import matplotlib.axes
    from flowrl_ray.plotting import plot_credit_analysis
    lines = []
    real = matplotlib.axes.Axes.axvline
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline",
                        lambda self, x=0, *a, **k: (lines.append((k.get("label"), x)), real(self, x, *a, **k))[1])
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    data = {"errors": np.ones((2, 5)), "weights": np.ones((2, 5)), "mask": mask, "success": np.array([True, False]),
            "grasped": np.array([[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]], bool)}
    paths = plot_credit_analysis(data, tmp_path, 3)
    assert sorted(lines) == [("grasp", 1), ("grasp", 2), ("success", 4)]
    assert all(p.stat().st_size > 0 for p in paths)


def test_prepare_keeps_the_grasped_flags_for_the_analysis():
    algo = FlowSAR(tiny_cfg(), SPEC, torch.device("cpu"))
    b = make_batch(0, ends={(3, 0): "term", (5, 1): "term"}, rewards={(3, 0): 1.0}, seed=3)
    b.data["grasped"] = np.zeros((6, 2), bool)
    b.data["grasped"][2:4, 0] = True
    algo.prepare([b])
    a = algo.analysis()
    assert a["grasped"].shape == a["errors"].shape and a["grasped"][0, :4].tolist() == [False, False, True, True]
