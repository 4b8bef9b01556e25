"""ReinFlow's noisy flow: the Gaussian chain's log-probability by hand and against
torch.distributions, the noise bounds, the mean chain, and where the gradients go."""

import math

import pytest
import torch
from torch.distributions import Normal

from flowrl_ray.models.flow import VelocityMLP
from flowrl_ray.models.noisy_flow import NoiseStdNet, chain_entropy, chain_log_prob, noisy_flow_sample


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
