"""The molecules family (``env.family: molecules``): QM9 data, chemistry checks and force-field
reward actors for equivariant diffusion models of 3D molecules.

A scoring family for group rollouts (``flowrl_ray.envs``): the learner samples molecules
(positions in Å + atom types H, C, N, O, F) and a scoring actor turns them into a force reward
and an energy reward (:mod:`~flowrl_ray.envs.molecules.rewards`) with GFN2-xTB or MMFF94
(:mod:`~flowrl_ray.envs.molecules.forcefield`), plus EDM stability and RDKit validity
(:mod:`~flowrl_ray.envs.molecules.chemistry`).

- :func:`spec` validates the config (before any actor starts) and returns ``EnvSpec((1,), 1)``;
- :func:`make_scorer` gives a scoring actor its :class:`MoleculeScorer` (``score(samples) ->
  Batch``, ``close()``);
- :func:`save_snapshots` draws the molecules a scorer was asked to picture (``score(samples,
  snapshots=N)``) into one grid, ``media/molecules/<label>.png``.
"""

from __future__ import annotations

from flowrl_ray.envs import EnvSpec
from flowrl_ray.envs.molecules.forcefield import FFResult, ForceField
from flowrl_ray.envs.molecules.rewards import REASONS, RewardSettings, molecule_rewards
from flowrl_ray.envs.molecules.scorer import MoleculeScorer
from flowrl_ray.envs.molecules.snapshots import save_snapshots

__all__ = ["FFResult", "ForceField", "MoleculeScorer", "REASONS", "RewardSettings", "make_scorer",
           "molecule_rewards", "save_snapshots", "spec"]


def spec(env_cfg) -> EnvSpec:
    """Validate ``env.id`` (qm9) and ``env.kwargs`` (ConfigError naming the key) and return the
    trivial env spec: the policy's samples are molecules, not arrays of a fixed shape."""
    RewardSettings.from_env_cfg(env_cfg)
    return EnvSpec(obs_shape=(1,), action_dim=1)


def make_scorer(env_cfg, seed: int, worker_id: int) -> MoleculeScorer:
    """A scorer with its own force-field child process. ``seed`` is unused: scoring is
    deterministic given the molecules."""
    return MoleculeScorer(RewardSettings.from_env_cfg(env_cfg), worker_id)
