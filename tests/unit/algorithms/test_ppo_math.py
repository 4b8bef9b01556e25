"""PPO's surrogate, value loss, KL estimate and update, checked by hand and by gradient direction."""

import math

import numpy as np
import pytest
import torch
from torch.distributions import Normal

from flowrl_ray.optim import optimizer_step
from flowrl_ray.algorithms.losses import approx_kl, ppo_clip_objective, value_loss
from flowrl_ray.algorithms.ppo import PPO
from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.gaussian import GaussianPolicy

from conftest import tiny_config


def test_clip_objective_hand_values():
    ratio = torch.tensor([0.5, 1.0, 1.1, 1.5, 0.5, 1.5])
    adv = torch.tensor([1.0, 2.0, 1.0, 1.0, -1.0, -1.0])
    # min(rA, clip(r, 0.8, 1.2) A)
    expected = torch.tensor([0.5, 2.0, 1.1, 1.2, -0.8, -1.5])
    assert torch.allclose(ppo_clip_objective(ratio, adv, 0.2), expected)


@pytest.mark.parametrize("r, a, grad", [
    (1.5, 1.0, 0.0),    # positive advantage above 1+eps: clipped, no push further up
    (0.5, 1.0, 1.0),    # positive advantage below 1-eps: unclipped term is the min, pushes up
    (1.1, 1.0, 1.0),    # inside the trust region: gradient is A
    (0.5, -1.0, 0.0),   # negative advantage below 1-eps: clipped
    (1.5, -1.0, -1.0),  # negative advantage above 1+eps: min picks r*A, pushes the ratio down
    (0.9, -2.0, -2.0),
])
def test_clip_objective_gradient(r, a, grad):
    ratio = torch.tensor(r, requires_grad=True)
    ppo_clip_objective(ratio, torch.tensor(a), 0.2).backward()
    assert float(ratio.grad) == pytest.approx(grad)


def test_value_loss_plain_and_clipped():
    v, ret, old = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.5])
    assert torch.allclose(value_loss(v, ret), torch.tensor([0.5, 0.5]))
    # clip 0.5: v_clipped = [0.5, 0.0]; max((2-1)^2, (0.5-1)^2)=1; max(1, 1)=1
    assert torch.allclose(value_loss(v, ret, old, 0.5), torch.tensor([0.5, 0.5]))
    v2 = torch.tensor([0.9])  # old 0 -> clipped 0.2; unclipped (0.9-1)^2=.01, clipped (0.2-1)^2=.64
    assert torch.allclose(value_loss(v2, torch.tensor([1.0]), torch.tensor([0.0]), 0.2), torch.tensor([0.32]))


def test_approx_kl_k3():
    lr = torch.tensor([0.0, math.log(2.0)])
    assert float(approx_kl(lr)) == pytest.approx(((0.0) + (1.0 - math.log(2.0))) / 2)
    assert float(approx_kl(torch.zeros(4))) == 0.0


def test_gaussian_policy_log_prob_and_act():
    torch.manual_seed(0)
    pol = GaussianPolicy(3, 2, [8], log_std_init=-0.3, normalize_obs=False)
    obs, act = torch.randn(5, 3), torch.randn(5, 2)
    mean = pol.mean_net(obs)
    ref = Normal(mean, torch.full_like(mean, math.exp(-0.3))).log_prob(act).sum(-1)
    assert torch.allclose(pol.log_prob(obs, act), ref)
    env_a, rec = pol.act(obs, generator=torch.Generator().manual_seed(1))
    assert env_a.shape == (5, 2) and rec["actions"].shape == (5, 2) and rec["logp"].shape == (5,)
    assert torch.all(env_a.abs() <= 1.0)
    assert torch.allclose(rec["logp"], pol.log_prob(obs, rec["actions"]))
    det, _ = pol.act(obs, deterministic=True)
    assert torch.allclose(det, mean.clamp(-1, 1))
    sq = GaussianPolicy(3, 2, [8], squash=True)
    a, r = sq.act(obs)
    assert torch.allclose(a, torch.tanh(r["actions"]))


def test_running_norm_matches_numpy_over_several_updates():
    from flowrl_ray.models.mlp import RunningNorm
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(300, 4))
    norm = RunningNorm(4)
    for chunk in np.split(x, [50, 170]):
        norm.update(torch.as_tensor(chunk))
    assert np.allclose(norm.mean.numpy(), x.mean(0)) and np.allclose(norm.var.numpy(), x.var(0))


def test_optimizer_step_skips_non_finite_loss():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    (norm,), stepped = optimizer_step((p * float("nan")).sum(), opt, 1.0)
    assert not stepped and torch.equal(p.data, torch.ones(2))
    (norm,), stepped = optimizer_step((p ** 2).sum(), opt, None)
    assert stepped and norm == pytest.approx(math.sqrt(8)) and torch.allclose(p.data, torch.full((2,), 0.8))


def _synthetic_batch(algo: PPO, T=16, N=4, seed=0) -> Batch:
    """A time-major batch sampled with the algorithm's own policy (so logp_old is exact)."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(T, N, 3, generator=g)
    _, rec = algo.policy.act(obs.reshape(-1, 3), generator=g)
    trunc = torch.zeros(T, N, dtype=torch.bool)
    trunc[7, 1] = True
    data = {"obs": obs.numpy(), "actions": rec["actions"].reshape(T, N, 1).numpy(),
            "logp": rec["logp"].reshape(T, N).numpy(), "rewards": torch.randn(T, N, generator=g).numpy(),
            "terminated": (torch.rand(T, N, generator=g) < 0.05).numpy(), "truncated": trunc.numpy(),
            "final_obs": torch.randn(T, N, 3, generator=g).numpy(), "last_obs": torch.randn(N, 3, generator=g).numpy()}
    return Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=T * N))


def test_first_epoch_ratio_is_one_and_update_improves_surrogate():
    cfg = tiny_config("algo.epochs=1", "algo.minibatch_size=64", "algo.normalize_obs=false")
    algo = PPO(cfg, EnvSpec((3,), 1), torch.device("cpu"))
    prepared = algo.prepare([_synthetic_batch(algo)])
    with torch.no_grad():
        logp = algo.policy.log_prob(prepared.obs, prepared.actions)
    assert torch.allclose(logp, prepared.logp_old, atol=1e-5)       # ratio exactly 1 before any step
    adv = prepared.advantages
    before = float((adv * (logp - prepared.logp_old).exp()).mean())
    metrics = algo.update(prepared)
    with torch.no_grad():
        after_ratio = (algo.policy.log_prob(prepared.obs, prepared.actions) - prepared.logp_old).exp()
    # the step moved the policy toward higher surrogate on this batch (advantages normalised per
    # minibatch, so compare signs: actions with positive advantage became more likely on average)
    pos = adv > adv.mean()
    assert float(after_ratio[pos].mean()) > float(after_ratio[~pos].mean())
    assert before == pytest.approx(float(adv.mean()), abs=1e-5)
    assert metrics["ppo/approx_kl"] > -1e-6 and metrics["ppo/epochs_run"] == 1   # k3 >= 0 up to rounding


def test_target_kl_stops_early():
    cfg = tiny_config("algo.epochs=50", "algo.minibatch_size=16", "algo.target_kl=0.0001", "algo.lr=0.01")
    algo = PPO(cfg, EnvSpec((3,), 1), torch.device("cpu"))
    metrics = algo.update(algo.prepare([_synthetic_batch(algo)]))
    assert metrics["ppo/early_stopped"] == 1.0 and metrics["ppo/epochs_run"] < 50
