"""ReinFlow's noisy flow: the Gaussian chain's log-probability by hand and against
torch.distributions, the noise bounds, the mean chain, and where the gradients go."""

import math

import pytest
import torch
from torch.distributions import Normal

from flowrl_ray.models.flow import VelocityMLP
from flowrl_ray.models.noisy_flow import NoiseStdNet, chain_entropy, chain_log_prob, noisy_flow_sample, sde_log_std


def _const(value, shape=(1, 2)):
    """A velocity that ignores its inputs: [B, *shape] of ``value``."""
    v = torch.tensor(value, dtype=torch.float32).view(1, *shape)
    return lambda x, tau, cond: v.expand(x.shape[0], *shape)


def test_one_step_log_prob_by_hand():
    # K = 1, Ta = 1, Da = 2: mu = clip(x0 + v, -1, 1) = (0.7, 0.3); x1 = (0.8, 0.1); sigma = 0.1
    x0, x1 = torch.tensor([[[0.2, -0.1]]]), torch.tensor([[[0.8, 0.1]]])
    chain = torch.stack([x0, x1], dim=1)                                         # [1, 2, 1, 2]
    velocity = _const([0.5, 0.4])
    log_std = lambda tau, cond: torch.full((1, 1, 2), math.log(0.1))
    # z = (1, -2): -(1 + 4) / 2 - 2 log 0.1 - log(2 pi)
    by_hand = -2.5 - 2 * math.log(0.1) - math.log(2 * math.pi)                   # 0.26729
    got = chain_log_prob(velocity, log_std, torch.zeros(1, 3), chain)
    assert float(got) == pytest.approx(by_hand, abs=1e-5)
    ref = Normal(torch.tensor([0.7, 0.3]), 0.1).log_prob(torch.tensor([0.8, 0.1])).sum()
    assert float(got) == pytest.approx(float(ref), abs=1e-5)
    # the mean is clipped to [-1, 1] before the noise: x0 + v = (1.5, 0.3) -> mu = (1.0, 0.3)
    far = torch.stack([torch.tensor([[[1.0, -0.1]]]), torch.tensor([[[1.1, 0.1]]])], dim=1)
    clipped = Normal(torch.tensor([1.0, 0.3]), 0.1).log_prob(torch.tensor([1.1, 0.1])).sum()
    assert float(chain_log_prob(velocity, log_std, torch.zeros(1, 3), far)) == pytest.approx(float(clipped), abs=1e-5)


@pytest.fixture
def nets():
    torch.manual_seed(0)
    velocity = VelocityMLP(cond_dim=3, horizon_steps=4, action_dim=2, hidden_sizes=[16, 16])
    noise = NoiseStdNet(cond_dim=3, horizon_steps=4, action_dim=2, hidden_sizes=[16], min_std=0.08, max_std=0.14)
    return velocity, noise


def test_chain_log_prob_matches_torch_distributions_step_by_step_with_a_row_mask(nets):
    velocity, noise = nets
    cond, x0 = torch.randn(5, 3), torch.randn(5, 4, 2)
    _, chain = noisy_flow_sample(velocity, noise, cond, x0, steps=3, generator=torch.Generator().manual_seed(1))
    assert chain.shape == (5, 4, 4, 2) and torch.equal(chain[:, 0], x0)
    mask = torch.tensor([[1, 1, 0, 0]] * 5, dtype=torch.float32)                # 2 of 4 rows executed
    expected = torch.zeros(5)
    with torch.no_grad():
        for k in range(3):
            tau = torch.full((5,), k / 3)
            mean = (chain[:, k] + velocity(chain[:, k], tau, cond) / 3).clamp(-1, 1)
            lp = Normal(mean, noise(tau, cond).exp()).log_prob(chain[:, k + 1])  # [5, 4, 2]
            expected += (lp.sum(-1) * mask).sum(-1)
        got = chain_log_prob(velocity, noise, cond, chain, mask)
    assert torch.allclose(got, expected, atol=1e-4)
    # the rows the env never executed do not count: moving them in the last state changes nothing
    moved = chain.clone()
    moved[:, -1, 2:] += 0.5
    with torch.no_grad():
        assert torch.allclose(chain_log_prob(velocity, noise, cond, moved, mask), got, atol=1e-5)
        assert not torch.allclose(chain_log_prob(velocity, noise, cond, moved), chain_log_prob(velocity, noise, cond, chain))


def test_sampled_transitions_have_the_chain_mean_and_std(nets):
    # K = 1: x1 = mu + sigma z; over 20,000 draws of one row the mean and std match
    velocity, noise = nets
    cond, x0 = torch.randn(1, 3).expand(20_000, 3), torch.randn(1, 4, 2).expand(20_000, 4, 2)
    with torch.no_grad():
        _, chain = noisy_flow_sample(velocity, noise, cond, x0, steps=1, generator=torch.Generator().manual_seed(0))
        mean = (x0 + velocity(x0, torch.zeros(20_000), cond)).clamp(-1, 1)[0]
        std = noise(torch.zeros(1), cond[:1]).exp()[0]
    assert torch.allclose(chain[:, 1].mean(0), mean, atol=0.01)                  # 3 standard errors
    assert torch.allclose(chain[:, 1].std(0), std, rtol=0.05)


def test_noise_std_stays_within_its_bounds_and_starts_at_their_geometric_mean(nets):
    _, noise = nets
    with torch.no_grad():
        noise.net[-1].bias.zero_()
        noise.net[-1].weight.zero_()
        mid = noise(torch.zeros(2), torch.randn(2, 3)).exp()
        assert torch.allclose(mid, torch.full_like(mid, math.sqrt(0.08 * 0.14)))   # tanh(0) = 0
        noise.net[-1].bias.fill_(1e3)
        assert torch.allclose(noise(torch.zeros(2), torch.randn(2, 3)).exp(), torch.tensor(0.14))
        noise.net[-1].bias.fill_(-1e3)
        assert torch.allclose(noise(torch.zeros(2), torch.randn(2, 3)).exp(), torch.tensor(0.08))
    with pytest.raises(ValueError, match="min_std"):
        NoiseStdNet(3, 4, 2, [8], min_std=0.2, max_std=0.1)


def test_without_noise_the_chain_is_the_clipped_euler_sampler(nets):
    velocity, noise = nets
    cond, x0 = torch.randn(3, 3), torch.randn(3, 4, 2)
    with torch.no_grad():
        action, chain = noisy_flow_sample(velocity, noise, cond, x0, steps=4, deterministic=True)
        x = x0
        for k in range(4):
            x = (x + velocity(x, torch.full((3,), k / 4), cond) / 4).clamp(-1, 1)
    assert torch.allclose(action, x, atol=1e-6) and torch.allclose(chain[:, -1], x, atol=1e-6)


def test_log_prob_trains_both_nets_and_the_entropy_only_the_noise_net(nets):
    velocity, noise = nets
    cond, x0 = torch.randn(4, 3), 0.1 * torch.randn(4, 4, 2)
    with torch.no_grad():
        _, chain = noisy_flow_sample(velocity, noise, cond, x0, steps=2, generator=torch.Generator().manual_seed(2))
    chain_log_prob(velocity, noise, cond, chain).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in noise.parameters())
    assert velocity.net[-1].weight.grad.abs().sum() > 0
    velocity.zero_grad(set_to_none=True)
    noise.zero_grad(set_to_none=True)
    entropy = chain_entropy(noise, cond, chain)
    # by hand: sum over 2 steps x 8 entries of log sigma + log(2 pi e) / 2
    with torch.no_grad():
        by_hand = sum((noise(torch.full((4,), k / 2), cond) + 0.5 * math.log(2 * math.pi * math.e)).sum((-1, -2))
                      for k in range(2))
    assert torch.allclose(entropy, by_hand, atol=1e-4)
    entropy.sum().backward()
    assert all(p.grad is None for p in velocity.parameters())
    assert noise.net[-1].bias.grad.abs().sum() > 0


def test_flow_sde_two_steps_by_hand():
    # K = 2, a = 0.5, v = 0.2 everywhere, one entry. Step 0 (tau = 0, sigma at the next grid time):
    # sigma_0 = 0.5 sqrt(1 / 0.5) = 0.7071, mu_0 = x0 + (v - sigma^2 / 2 (x0 - 0) / 1) / 2
    #   x0 = 0.2: mu_0 = 0.2 + (0.2 - 0.25 * 0.2) / 2 = 0.275, std = sigma_0 sqrt(1/2) = 0.5
    # step 1 (tau = 0.5): sigma_1 = 0.5, mu_1 = x1 + (v - 0.125 (x1 - 0.5 v) / 0.5) / 2
    #   x1 = 0.3: mu_1 = 0.3 + (0.2 - 0.25 * 0.2) / 2 = 0.375, std = 0.5 sqrt(1/2) = 0.35355
    chain = torch.tensor([0.2, 0.3, 0.5]).view(1, 3, 1, 1)
    velocity = _const([0.2], shape=(1, 1))
    by_hand = float(Normal(0.275, 0.5).log_prob(torch.tensor(0.3)) + Normal(0.375, 0.5 * math.sqrt(0.5)).log_prob(torch.tensor(0.5)))
    got = chain_log_prob(velocity, None, torch.zeros(1, 3), chain, sde_level=0.5)
    assert float(got) == pytest.approx(by_hand, abs=1e-5)
    # the entropy: sum over the steps of log std + log(2 pi e) / 2
    # (the policy's log_std under Flow-SDE: the step's std, whatever the condition)
    ent = chain_entropy(lambda tau, cond: sde_log_std(tau, 2, 0.5), torch.zeros(1, 3), chain)
    assert float(ent) == pytest.approx(math.log(0.5) + math.log(0.5 * math.sqrt(0.5)) + math.log(2 * math.pi * math.e), abs=1e-5)


def test_flow_sde_keeps_the_flows_marginals_and_without_its_drift_term_does_not():
    # a 1-D Gaussian target a ~ N(0.3, 0.2^2) and its exact velocity on x = tau a + (1 - tau) eps:
    # v(x, tau) = E[a - eps | x] = m + (tau s^2 - (1 - tau)) (x - tau m) / (tau^2 s^2 + (1 - tau)^2)
    m, s, steps, n = 0.3, 0.2, 100, 40000

    def velocity(x, tau, cond):
        t = tau.view(-1, 1, 1)
        return m + (t * s ** 2 - (1 - t)) * (x - t * m) / (t ** 2 * s ** 2 + (1 - t) ** 2)

    for level in (0.5, 1.0):
        g = torch.Generator().manual_seed(0)
        x0 = torch.randn(n, 1, 1, generator=g)
        _, chain = noisy_flow_sample(velocity, None, None, x0, steps, generator=g, sde_level=level)
        end = chain[:, -1].flatten()
        assert abs(float(end.mean()) - m) < 0.01 and abs(float(end.std()) - s) < 0.01, (level, end.mean(), end.std())
    # the same noise without the score term -sigma^2 / 2 (x - tau v) / (1 - tau): far too wide
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 1, generator=g)
    for k in range(steps):
        tau = torch.full((n,), k / steps)
        sigma = 1.0 * math.sqrt((1 - k / steps) / max(k / steps, 1 / steps))
        x = x + velocity(x, tau, None) / steps + sigma * math.sqrt(1 / steps) * torch.randn(x.shape, generator=g)
    assert float(x.std()) > 0.3


def test_flow_sde_mean_chain_is_the_unclipped_euler_sampler(nets):
    velocity, _ = nets
    cond, x0 = torch.randn(5, 3), 2.0 * torch.randn(5, 4, 2)
    _, chain = noisy_flow_sample(velocity, None, cond, x0, steps=3, deterministic=True, sde_level=0.5)
    x = x0
    with torch.no_grad():
        for k in range(3):
            x = x + velocity(x, torch.full((5,), k / 3), cond) / 3
    assert torch.allclose(chain[:, -1], x, atol=1e-6)
