"""CMA-PPO's math by hand: mirror points, kernel weights, gradient isolation, history, order."""

import math

import pytest
import torch

from flowrl_ray.algorithms.cma_ppo import CMAPPO, cma_batch, resample_mirrored
from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.config import load_config
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.cma import CMAPolicy

from conftest import REPO

CMA_PENDULUM = REPO / "configs" / "cma_ppo" / "pendulum.yaml"


def _cfg(*overrides):
    return load_config(CMA_PENDULUM, ["runtime.num_workers=1", "runtime.envs_per_worker=2",
                                      "runtime.rollout_length=16", "algo.minibatch_size=8", "algo.epochs=2",
                                      "algo.hidden_sizes=[8, 8]", *overrides])


def test_cma_batch_hand_values():
    obs = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    a = torch.tensor([[0.5, 0.0], [0.1, 0.2], [1.0, 1.0], [0.0, -0.1]])
    mu = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.8, 1.0], [0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0, 0.0, -3.0])
    out = cma_batch(obs, a, adv, mu, kernel_std=0.1)
    # positives (A >= 0, zero counts as positive) first in input order: samples 0 and 2, untouched
    assert torch.equal(out["obs"][:2], obs[[0, 2]]) and torch.equal(out["actions"][:2], a[[0, 2]])
    assert torch.equal(out["weights"][:2], torch.tensor([2.0, 0.0]))
    # negatives mirrored: a' = 2 mu - a
    assert torch.allclose(out["actions"][2:], torch.tensor([[-0.1, -0.2], [0.0, 0.1]]))
    assert torch.equal(out["obs"][2:], obs[[1, 3]])
    # weights |A| exp(-||a - mu||^2 / (2 * 0.01)):  ||.||^2 = 0.05 and 0.01
    expected = torch.tensor([1.0 * math.exp(-0.05 / 0.02), 3.0 * math.exp(-0.01 / 0.02)])
    assert torch.allclose(out["weights"][2:], expected)


def test_cma_batch_with_per_dimension_policy_std():
    a, mu = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 0.0]])
    std = torch.tensor([[1.0, 2.0]])
    out = cma_batch(torch.zeros(1, 1), a, torch.tensor([-2.0]), mu, std)
    # exponent 1/(2*1) + 4/(2*4) = 1.0
    assert torch.allclose(out["weights"], torch.tensor([2.0 * math.exp(-1.0)]))


def test_resample_keeps_positives_and_mirrored_mass():
    batch = {"obs": torch.arange(5.0)[:, None], "actions": torch.arange(5.0)[:, None],
             "weights": torch.tensor([1.0, 2.0, 0.5, 0.0, 1.5])}
    out = resample_mirrored(batch, 2, torch.Generator().manual_seed(0))
    assert torch.equal(out["weights"][:2], batch["weights"][:2])
    assert out["weights"].shape == (4,) and out["weights"][2:].sum() == pytest.approx(2.0)
    assert set(out["obs"][2:, 0].tolist()) <= {2.0, 4.0}      # the zero-weight one is never drawn


def test_policy_log_prob_matches_torch_distributions_and_sampling():
    torch.manual_seed(0)
    pol = CMAPolicy(3, 2, [8, 8], normalize_obs=False)
    obs, act = torch.randn(4, 3), torch.randn(4, 2)
    mean, var = pol.get_mean_var(obs)
    ref = torch.distributions.Normal(mean, var.sqrt()).log_prob(act).sum(-1)
    assert torch.allclose(pol.log_prob(obs, act), ref, atol=1e-5)
    pre, squashed = pol.sample(obs, torch.Generator().manual_seed(1))
    assert torch.allclose(squashed, torch.tanh(pre))
    env_a, rec = pol.act(obs, generator=torch.Generator().manual_seed(1))
    assert torch.equal(rec["actions"], pre) and torch.allclose(rec["logp"], pol.log_prob(obs, pre), atol=1e-5)


def _batch(algo, seed, T=16, N=2):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(T, N, 3, generator=g)
    _, rec = algo.policy.act(obs.reshape(-1, 3), generator=g)
    data = {"obs": obs.numpy(), "actions": rec["actions"].reshape(T, N, 1).numpy(),
            "logp": rec["logp"].reshape(T, N).numpy(), "rewards": torch.randn(T, N, generator=g).numpy(),
            "terminated": torch.zeros(T, N, dtype=torch.bool).numpy(),
            "truncated": torch.zeros(T, N, dtype=torch.bool).numpy(),
            "final_obs": torch.zeros(T, N, 3).numpy(), "last_obs": torch.randn(N, 3, generator=g).numpy()}
    return Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=T * N))


def _params(module):
    return [p.detach().clone() for p in module.parameters()]


def test_update_order_and_that_each_step_touches_only_its_network():
    algo = CMAPPO(_cfg("algo.normalize_obs=false"), EnvSpec((3,), 1), torch.device("cpu"))
    p = algo.policy
    calls = []
    originals = {"var": algo._var_loss, "mean": algo._mean_loss, "value": algo._value_loss}
    state_at_start = {}

    def spy(name):
        def loss(mb):
            if name not in state_at_start:   # first minibatch of this step: record what has moved so far
                state_at_start[name] = {"var": _params(p.var_net), "mean": _params(p.mean_net), "value": _params(p.vf)}
                calls.append(name)
            return originals[name](mb)
        return loss

    algo._var_loss, algo._mean_loss, algo._value_loss = spy("var"), spy("mean"), spy("value")
    init = {"var": _params(p.var_net), "mean": _params(p.mean_net), "value": _params(p.vf)}
    metrics = algo.update(algo.prepare([_batch(algo, 0)]))
    assert calls == ["var", "mean", "value"]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    # when the mean step starts, only the variance network has moved
    at_mean = state_at_start["mean"]
    assert not same(at_mean["var"], init["var"]) and same(at_mean["mean"], init["mean"]) and same(at_mean["value"], init["value"])
    # when the value step starts, the mean has moved and the variance has not moved again
    at_value = state_at_start["value"]
    assert not same(at_value["mean"], init["mean"]) and same(at_value["var"], at_mean["var"])
    assert same(at_value["value"], init["value"]) and not same(_params(p.vf), init["value"])
    for key in ("cma_ppo/mean_loss", "cma_ppo/var_loss", "cma_ppo/value_loss", "cma_ppo/advantage_mean",
                "cma_ppo/advantage_std", "policy/weight_l2_norm", "policy/weight_l2_distance_from_init",
                "policy/param_mean", "policy/param_std"):
        assert key in metrics and math.isfinite(metrics[key]), key


def test_variance_loss_has_no_gradient_on_the_mean_and_vice_versa():
    algo = CMAPPO(_cfg(), EnvSpec((3,), 1), torch.device("cpu"))
    mb = {"obs": torch.randn(6, 3), "actions": torch.randn(6, 1), "weights": torch.rand(6)}
    algo._var_loss(mb).backward()
    assert all(q.grad is None for q in algo.policy.mean_net.parameters())
    assert any(q.grad is not None and q.grad.abs().sum() > 0 for q in algo.policy.var_net.parameters())
    algo.policy.zero_grad(set_to_none=True)
    algo._mean_loss(mb).backward()
    assert all(q.grad is None for q in algo.policy.var_net.parameters())
    assert any(q.grad is not None and q.grad.abs().sum() > 0 for q in algo.policy.mean_net.parameters())


def test_mean_step_moves_the_mean_toward_positive_and_mirrored_samples():
    algo = CMAPPO(_cfg("algo.normalize_obs=false", "algo.lr_mean=0.01", "algo.epochs=20"), EnvSpec((3,), 1),
                  torch.device("cpu"))
    obs = torch.zeros(4, 3)
    with torch.no_grad():
        mu0, _ = algo.policy.get_mean_var(obs)
    # a bad action below the mean: its mirror lies above, so the mean must go up
    entry = {"obs": obs, "actions": mu0 - 0.05, "advantages": torch.full((4,), -1.0), "returns": torch.zeros(4)}
    batch = algo._cma_batch(entry)
    algo._epochs(batch, algo._mean_loss, algo.opt_mean)
    with torch.no_grad():
        mu1, _ = algo.policy.get_mean_var(obs)
    assert float((mu1 - mu0).mean()) > 0


def test_history_is_bounded_and_checkpointed():
    cfg = _cfg("algo.history_size=3")
    algo = CMAPPO(cfg, EnvSpec((3,), 1), torch.device("cpu"))
    for seed in range(5):
        algo.update(algo.prepare([_batch(algo, seed)]))
    assert len(algo.history) == 3
    import io
    buf = io.BytesIO()
    torch.save(algo.state_dict(), buf)
    buf.seek(0)
    other = CMAPPO(cfg, EnvSpec((3,), 1), torch.device("cpu"))
    other.load_state_dict(torch.load(buf, weights_only=False))
    assert len(other.history) == 3 and other.history.maxlen == 3
    batch = _batch(algo, 99)
    ma, mb = algo.update(algo.prepare([batch])), other.update(other.prepare([batch]))
    assert ma == mb
