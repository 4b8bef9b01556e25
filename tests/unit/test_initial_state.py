"""How much an episode's initial state decides its outcome: the state share (ICC(1)) of
``flowrl_ray.stats`` by hand and on outcomes drawn with a known share, and the grouping of
``benchmarks/robot_initial_state.py``."""

import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from robot_initial_state import episode_keys, group_states, spearman, split_by_group  # noqa: E402

from flowrl_ray.stats import state_share, state_share_ci  # noqa: E402


def test_state_share_by_hand():
    # row means 2/3, 0, 1, 1/3, grand mean 1/2: MSB = 3/3 * (1/36 + 1/4 + 1/4 + 1/36) = 5/9,
    # MSW = (6/9 + 0 + 0 + 6/9) / (4 * 2) = 1/6, ICC = (5/9 - 1/6) / (5/9 + 2/6) = 7/16
    y = [[1, 1, 0], [0, 0, 0], [1, 1, 1], [0, 1, 0]]
    assert state_share(y) == pytest.approx(7 / 16)
    assert state_share([[1, 1], [0, 0], [1, 1], [0, 0]]) == pytest.approx(1.0)     # the state decides
    assert state_share([[1, 0], [1, 0], [1, 0]]) == pytest.approx(-1.0)           # its lower bound, -1/(R-1)
    assert np.isnan(state_share([[1, 1], [1, 1]]))                                # nothing to split


def test_state_share_recovers_a_known_share():
    rng = np.random.default_rng(0)
    # the state's success probability is 0.1 or 0.9: ICC = var(p) / (var(p) + E[p (1 - p)]) = 0.16 / 0.25
    p = rng.choice([0.1, 0.9], size=4000)
    y = (rng.random((4000, 4)) < p[:, None]).astype(float)
    assert state_share(y) == pytest.approx(0.64, abs=0.03)
    # one success probability for every state: the state says nothing
    y = (rng.random((4000, 4)) < 0.5).astype(float)
    assert state_share(y) == pytest.approx(0.0, abs=0.03)


def test_state_share_interval_covers_the_estimate_and_rejects_bad_shapes():
    rng = np.random.default_rng(1)
    p = rng.choice([0.1, 0.9], size=100)
    y = (rng.random((100, 4)) < p[:, None]).astype(float)
    ci = state_share_ci(y, n_boot=500)
    assert ci["ci_low"] < ci["share"] < ci["ci_high"] and ci["states"] == 100 and ci["repeats"] == 4
    with pytest.raises(ValueError, match="repeats >= 2"):
        state_share([[1], [0]])


def test_episode_keys_follow_the_protocols_quota():
    keys = episode_keys(100)
    assert len(keys) == 100 and keys[0] == (0, 0) and keys[-1] == (7, 11)
    assert sum(1 for i, _ in keys if i == 3) == 13 and sum(1 for i, _ in keys if i == 4) == 12
    assert episode_keys(3) == [(0, 0), (1, 0), (2, 0)]


def test_groups_and_their_split():
    groups = group_states([[0, 0], [1, 0], [1, 1], [0, 0]])
    assert groups == ["never", "sometimes", "always", "never"]
    base0 = [1, 0, 1, 0]
    variant = [[0, 1, 1, 1], [0, 0, 1, 1]]               # 2 seeds
    split = split_by_group(groups, base0, variant, n_boot=200)
    assert split["never"] == {"states": 2, "base": 0.5, "variant": 0.5, "change": 0.0,
                              "ci_low": -1.0, "ci_high": 1.0}   # per-state gains -1, +1
    assert split["sometimes"]["variant"] == 0.5 and split["sometimes"]["change"] == 0.5
    assert split["always"]["change"] == 0.0


def test_spearman_with_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [1, 1, 0, 0]) == pytest.approx(-np.sqrt(0.8))
    assert np.isnan(spearman([1, 2, 3], [1, 1, 1]))
