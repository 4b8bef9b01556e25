"""benchmarks/flow_policy_spread.py: the spread, shift, demo error and seed agreement of a flow
policy's actions, by hand on policies whose samples are known in closed form."""

import math
import sys

import numpy as np
import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from flow_policy_spread import cross_agreement, measure, seed_agreement  # noqa: E402


class AffinePolicy:
    """a = mu + sigma * eps, the same at every state (chunk [Ta, Da])."""

    def __init__(self, mu: torch.Tensor, sigma: float):
        self.mu, self.sigma = mu, sigma

    def sample(self, obs, eps):
        return self.mu + self.sigma * eps


def test_measure_reads_spread_shift_and_demo_error_off_the_samples():
    n, k, ta, da, rows = 4, 3, 5, 2, 3
    eps = torch.tensor([-1.0, 0.0, 1.0]).view(1, k, 1, 1).expand(n, k, ta, da).clone()   # pop. std sqrt(2/3)
    obs = np.zeros((n, 6), np.float32)
    chunks = np.zeros((n, ta, da), np.float32)
    progress = np.array([0.0, 0.3, 0.6, 0.9])                 # one state per quarter
    base = AffinePolicy(torch.zeros(ta, da), 0.3)
    fig, base_mean = measure(base, obs, chunks, progress, eps, rows)
    assert fig["spread"] == pytest.approx(0.3 * math.sqrt(2 / 3), rel=1e-6)
    assert fig["spread_by_quarter"] == pytest.approx([0.3 * math.sqrt(2 / 3)] * 4, rel=1e-6)
    assert fig["demo_error"] == pytest.approx(0.0) and "shift" not in fig
    # a policy moved by +0.1 on dim 0 and -0.3 on dim 1, twice as broad; only the first 3 rows count
    mu = torch.tensor([0.1, -0.3]).expand(ta, da).clone()
    mu[rows:] = 5.0
    fig, _ = measure(AffinePolicy(mu, 0.6), obs, chunks, progress, eps, rows, base_mean)
    assert fig["spread"] == pytest.approx(0.6 * math.sqrt(2 / 3), rel=1e-6)
    assert fig["spread_gripper"] == pytest.approx(0.6 * math.sqrt(2 / 3), rel=1e-6)
    assert fig["shift"] == pytest.approx(math.sqrt((0.1 ** 2 + 0.3 ** 2) / 2), rel=1e-6)
    assert fig["shift_by_dim"] == pytest.approx([0.1, -0.3], rel=1e-6)
    assert fig["demo_error"] == pytest.approx(math.sqrt((0.1 ** 2 + 0.3 ** 2) / 2), rel=1e-6)   # zero noise: a = mu


def test_seed_agreement_is_the_mean_pairwise_cosine():
    a, b, c = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([-1.0, 0.0])
    # cos(a, b) = 1/sqrt(2), cos(a, c) = -1, cos(b, c) = -1/sqrt(2)
    assert seed_agreement([a, b, c]) == pytest.approx(-1 / 3)
    assert seed_agreement([a, 2 * a]) == pytest.approx(1.0)
    assert seed_agreement([a]) is None


def test_cross_agreement_is_the_mean_cosine_over_pairs_of_both_variants_seeds():
    a, b, c = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([-1.0, 0.0])
    # cos(a, a) = 1, cos(a, b) = 0, cos(c, a) = -1, cos(c, b) = 0
    assert cross_agreement([a, c], [a, b]) == pytest.approx(0.0)
    assert cross_agreement([a, 3 * a], [2 * a]) == pytest.approx(1.0)
    assert cross_agreement([a], [c]) == pytest.approx(-1.0)
