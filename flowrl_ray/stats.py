"""Statistics of the robot evaluation protocol (``benchmarks/robot_protocol.py``): the gain of
several fine-tuned policies (one per training seed) over their base, with a paired bootstrap
confidence interval, and how much of an outcome its initial state decides (the share of the
outcome variance between initial states). NumPy only; no Ray, no torch.

Shapes: S = training seeds of one variant, E = evaluation episodes. Every policy and the base
are evaluated on the same E seeded episodes (the same initial states, in the same order), so
episode e of a policy and episode e of the base form a pair.
"""

from __future__ import annotations

import numpy as np


def _as_paired(policy: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """policy [S, E] (a single policy's [E] becomes [1, E]), base [E]; both float."""
    p = np.asarray(policy, dtype=np.float64)
    b = np.asarray(base, dtype=np.float64)
    if p.ndim == 1:
        p = p[None]
    if p.ndim != 2 or b.ndim != 1:
        raise ValueError(f"expected policy outcomes [seeds, episodes] and base outcomes [episodes], "
                         f"got shapes {p.shape} and {b.shape}")
    if p.shape[1] != b.shape[0] or b.shape[0] == 0 or p.shape[0] == 0:
        raise ValueError(f"policy and base must be evaluated on the same non-empty episodes: "
                         f"{p.shape[1]} policy episodes per seed, {b.shape[0]} base episodes")
    return p, b


def episode_gains(policy, base) -> np.ndarray:
    """[E]: per episode e, the mean over seeds s of (policy[s, e] - base[e])."""
    p, b = _as_paired(policy, base)
    return (p - b[None]).mean(axis=0)


def paired_bootstrap_gain(policy, base, n_boot: int = 10_000, level: float = 0.95,
                          seed: int = 0) -> dict:
    """Mean gain of the policies over the base with a percentile-bootstrap confidence interval,
    paired by episode.

    policy: [S, E] outcomes (success 0/1, or any per-episode score) of S policies (one per
        training seed) on the E evaluation episodes; base: [E] the base's outcomes on the same
        episodes, in the same order.

    The estimator. With d_e = (1/S) sum_s (policy[s, e] - base[e]) (:func:`episode_gains`),

        gain = (1/E) sum_e d_e              = mean over seeds of (policy success - base success).

    The interval: B = ``n_boot`` resamples of the episodes, each E indices e_1..e_E drawn
    uniformly with replacement, the same indices for every seed and for the base (the pairing);
    within resample b the gain is g_b = (1/E) sum_j d_{e_j}, the mean over seeds of the
    policies' success minus the base's success on those episodes. The interval is the
    ((1 - level)/2, (1 + level)/2) quantiles of g_1..g_B (numpy's linear interpolation).

    What it covers: the noise of the finite evaluation set (which episodes were drawn), given
    these trained policies. The seeds enter as an average; with 3 seeds the spread between them
    is reported per seed rather than resampled. Pairing removes the episodes' own difficulty
    (the part base and policy share) from the interval.

    Properties (tested): identical policies and base give gain 0 and the interval [0, 0]; a
    policy better by exactly 1 on every episode gives 1 and [1, 1].

    Returns {"gain", "ci_low", "ci_high", "level", "n_boot", "seeds", "episodes"}.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    p, _ = _as_paired(policy, base)
    d = episode_gains(policy, base)                                  # [E]
    e = d.shape[0]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, e, size=(n_boot, e))                       # [B, E] episode indices
    boot = d[idx].mean(axis=1)                                       # [B] g_b
    lo, hi = np.quantile(boot, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return {"gain": float(d.mean()), "ci_low": float(lo), "ci_high": float(hi), "level": level,
            "n_boot": int(n_boot), "seeds": int(p.shape[0]), "episodes": int(e)}


def mean_interval(values, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> dict:
    """The mean of ``values`` [N] with its percentile-bootstrap interval over the values (the
    gain of :func:`paired_bootstrap_gain` against a base of zeros) ->
    {"mean", "ci_low", "ci_high", "n"}."""
    x = np.asarray(values, dtype=np.float64)
    r = paired_bootstrap_gain(x[None], np.zeros_like(x), n_boot=n_boot, level=level, seed=seed)
    return {"mean": r["gain"], "ci_low": r["ci_low"], "ci_high": r["ci_high"], "n": int(x.shape[0])}


def state_share(outcomes) -> float:
    """The share of the outcome variance that lies between initial states: the one-way
    random-effects intra-class correlation ICC(1).

    outcomes: [E, R], R >= 2 outcomes (success 0/1, or any per-episode score) of one policy from
    each of E initial states, the R episodes of a state differing only in the sampling noise.
    With y_bar_e the mean of state e's row, y_bar the grand mean,

        MSB = R / (E - 1) * sum_e (y_bar_e - y_bar)^2                      (between states)
        MSW = 1 / (E (R - 1)) * sum_e sum_r (y_er - y_bar_e)^2              (within a state)
        ICC = (MSB - MSW) / (MSB + (R - 1) MSW).

    1: the initial state alone decides the outcome; 0: the state says nothing beyond the
    grand mean (the outcome is the sampled actions'); slightly negative values are noise around 0.
    NaN where every outcome is the same (no variance to split)."""
    y = np.asarray(outcomes, dtype=np.float64)
    if y.ndim != 2 or y.shape[0] < 2 or y.shape[1] < 2:
        raise ValueError(f"expected outcomes [states >= 2, repeats >= 2], got shape {y.shape}")
    e, r = y.shape
    row = y.mean(axis=1)
    msb = r * ((row - y.mean()) ** 2).sum() / (e - 1)
    msw = ((y - row[:, None]) ** 2).sum() / (e * (r - 1))
    denom = msb + (r - 1) * msw
    return float((msb - msw) / denom) if denom > 0 else float("nan")


def state_share_ci(outcomes, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> dict:
    """:func:`state_share` with a percentile-bootstrap interval over initial states (each
    resample draws E states with replacement, keeping each state's R outcomes together).
    Returns {"share", "ci_low", "ci_high", "level", "n_boot", "states", "repeats"}."""
    y = np.asarray(outcomes, dtype=np.float64)
    share = state_share(y)
    rng = np.random.default_rng(seed)
    boot = np.array([state_share(y[rng.integers(0, len(y), len(y))]) for _ in range(n_boot)])
    lo, hi = np.nanquantile(boot, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return {"share": share, "ci_low": float(lo), "ci_high": float(hi), "level": level,
            "n_boot": int(n_boot), "states": int(y.shape[0]), "repeats": int(y.shape[1])}
