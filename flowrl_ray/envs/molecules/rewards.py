"""Force and energy rewards of one generated molecule, and the settings that shape them.

FED-GRPO (Elign, ``liyy2/Elign``: ``docs/fed_grpo.md``, ``elign/worker/reward/README.md``)
normalises a force reward and an energy reward *separately* within each group and only then
mixes the two advantages with the algorithm's weights, so the scorer hands both back unmixed.
Following ``UMAForceReward`` (``elign/worker/reward/force.py``) and the paper config
(``elign/trainer/config/fed_grpo_qm9_paper_pbrs.yaml``: RMS aggregation, formation energy per atom):

* **force reward** = ``-RMS_a |F_a|`` in eV/Å, where each atom's force vector is first scaled
  down to norm at most ``force_clip`` (Elign's ``force_clip_threshold``: per-atom clipping before
  aggregation), so the reward lies in ``[-force_clip, 0]``.
* **energy reward** = ``-clip(E_form / n, -energy_clip, +energy_clip)`` in eV/atom, E_form the
  formation energy (total energy minus the isolated atoms' GFN2 energies; the total MMFF energy
  for ``backend: mmff``). Elign's ``energy_transform_clip`` clamps the same way; offset 0 and
  scale 1 as in its paper config. GFN2 gives -4.4 to -7.6 eV/atom on QM9's DFT geometries.

Gating and failures. Elign multiplies a gated reward by 0. Our force reward is <= 0, so a 0
would make an unstable molecule the best of its group; a gated channel here gets the worst value
a scored molecule can have instead (``-force_clip`` / ``-energy_clip``): ``force_only_if_stable``
/ ``energy_only_if_stable`` gate unstable molecules (reason ``unstable_gated``). Elign's
``filters.invalid_penalty_scale`` puts RDKit-invalid molecules ``scale`` below the worst valid
reward of the batch in every channel (only when scale > 0); with per-molecule scoring the worst
valid reward is bounded by the clip, so an invalid molecule (when scale > 0; reason
``rdkit_invalid``) and any molecule the force field could not score (always) get
``-clip - invalid_penalty_scale`` in both channels.

``force_weight`` / ``energy_weight`` (Elign's raw weights, 1 and 1) only form the scalar
``reward`` that is logged as the episode return; FED-GRPO's per-channel normalisation cancels
them (its mixing weights are the algorithm's).

Stability. Elign keeps stability with dense terms from EDM's bond perception (its
``atom_stability_weight`` and soft valence penalties, ``UMAForceReward``), which it adds to the
force reward before the group normalisation. Here they form a third reward, normalised in its
group like force and energy and mixed with FED-GRPO's ``stability_adv_weight``, so that its
weight does not depend on the force reward's spread:

* **stability reward** = ``atom_stability_weight * f_stable - valence_under_weight * m -
  valence_over_weight * x``, with f_stable the fraction of stable atoms and m / x the per-atom
  means of the missing / excess soft valence (:func:`~flowrl_ray.envs.molecules.chemistry.valence_report`,
  sigmoid bond orders at ``valence_soft_temperature`` Å).

It is computed from the geometry alone, so every molecule has one, RDKit-invalid or not (with
94 % of a weak base's samples invalid, a floor value there would leave the channel constant).
The gates read the fraction of stable atoms: a molecule passes when it is at least
``gate_stable_atom_fraction`` (1.0, the default: every atom stable, i.e. EDM's molecule
stability, Elign's gate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from flowrl_ray.config import check
from flowrl_ray.envs.molecules.forcefield import BACKENDS, FFResult

#: every reason a scored molecule can carry: "ok", gating, then force-field failures
REASONS = ("ok", "unstable_gated", "rdkit_invalid", "overlap", "timeout", "scf_failed", "nan_coordinates",
           "invalid_atom_type", "bond_perception_failed", "mmff_setup_failed", "nonfinite_output")
DATASETS = ("qm9",)


def _config_error(key: str, msg: str):
    from flowrl_ray.config import ConfigError
    return ConfigError(f"config key 'env.{key}': {msg}")


@dataclass(frozen=True)
class RewardSettings:
    """The molecules family's ``env.kwargs`` (all optional). Units: Å, eV/Å, eV/atom, seconds."""
    backend: Literal[BACKENDS] = "gfn2"   # "gfn2" (GFN2-xTB via tblite) | "mmff" (RDKit MMFF94)
    max_iter: int = field(default=250, metadata=check(ge=1))            # SCF cycles before scf_failed
    timeout_s: float = field(default=10.0, metadata=check(gt=0))        # wall-clock cap per molecule
    min_distance: float = field(default=0.5, metadata=check(ge=0))      # Å; closer pairs are "overlap"
    force_clip: float = field(default=10.0, metadata=check(gt=0))       # eV/Å per-atom force cap; reward in [-clip, 0]
    energy_clip: float = field(default=10.0, metadata=check(gt=0))      # eV/atom; reward in [-clip, clip]
    energy_only_if_stable: bool = False
    force_only_if_stable: bool = False
    # >0: RDKit-invalid molecules get -clip - scale (Elign's scripts: 2)
    invalid_penalty_scale: float = field(default=2.0, metadata=check(ge=0))
    force_weight: float = field(default=1.0, metadata=check(ge=0))      # the logged scalar reward only
    energy_weight: float = field(default=1.0, metadata=check(ge=0))
    # the gates pass a molecule with at least this stable-atom fraction
    gate_stable_atom_fraction: float = field(default=1.0, metadata=check(ge=0, le=1))
    atom_stability_weight: float = field(default=1.0, metadata=check(ge=0))   # the stability reward's terms
    valence_under_weight: float = field(default=1.0, metadata=check(ge=0))
    valence_over_weight: float = field(default=1.0, metadata=check(ge=0))
    valence_soft_temperature: float = field(default=0.02, metadata=check(gt=0))   # Å

    @classmethod
    def from_env_cfg(cls, env_cfg) -> "RewardSettings":
        """Validate ``env_cfg.id`` (the dataset) and ``env_cfg.kwargs`` (the config's schema
        checker); ConfigError names the key."""
        from flowrl_ray.config import build_section
        if getattr(env_cfg, "id", None) not in DATASETS:
            raise _config_error("id", f"the molecules family takes a dataset name ({', '.join(DATASETS)}), "
                                f"got {getattr(env_cfg, 'id', None)!r}")
        return build_section(cls, dict(getattr(env_cfg, "kwargs", None) or {}), "env.kwargs.")


def stability_reward(valence: dict, settings: RewardSettings) -> float:
    """The stability reward of one molecule from its :func:`~flowrl_ray.envs.molecules.chemistry.valence_report`:
    w_atom * stable_atom_fraction - w_under * soft_missing - w_over * soft_excess."""
    s = settings
    return (s.atom_stability_weight * valence["stable_atom_fraction"]
            - s.valence_under_weight * valence["soft_missing"] - s.valence_over_weight * valence["soft_excess"])


def molecule_rewards(result: FFResult, valence: dict, settings: RewardSettings, valid: bool = True) -> dict:
    """The rewards of one molecule from its force-field result, its valence report
    (:func:`~flowrl_ray.envs.molecules.chemistry.valence_report`: EDM stability, atom by atom) and its
    RDKit validity. Returns ``force_reward`` (eV/Å, <= 0), ``energy_reward`` (eV/atom),
    ``stability_reward`` (see :func:`stability_reward`; never gated), ``reward`` (the weighted sum of
    force and energy, for logging), ``force_gated`` / ``energy_gated`` (the channel got its floor
    value instead of its physics), ``reason`` (one of REASONS), ``rms_force`` (unclipped, eV/Å)
    and ``formation_energy_per_atom_eV`` (NaN when the force field failed)."""
    s = settings
    f_floor, e_floor = -s.force_clip, -s.energy_clip
    r_stab = stability_reward(valence, s)
    if not result.ok:
        f = f_floor - s.invalid_penalty_scale
        e = e_floor - s.invalid_penalty_scale
        return {"force_reward": f, "energy_reward": e, "stability_reward": r_stab,
                "reward": s.force_weight * f + s.energy_weight * e,
                "force_gated": True, "energy_gated": True, "reason": result.reason,
                "rms_force": math.nan, "formation_energy_per_atom_eV": math.nan}
    passes = valence["stable_atom_fraction"] >= s.gate_stable_atom_fraction
    norms2 = np.einsum("ij,ij->i", result.forces, result.forces)         # |F_a|^2, [n]
    rms = math.sqrt(norms2.mean())
    e_atom = result.formation_energy_eV / max(result.n_atoms, 1)
    if s.invalid_penalty_scale > 0 and not valid:
        f, e = f_floor - s.invalid_penalty_scale, e_floor - s.invalid_penalty_scale
        f_gated = e_gated = True
        reason = "rdkit_invalid"
    else:
        f = -math.sqrt(np.minimum(norms2, s.force_clip ** 2).mean())      # each |F_a| capped at the clip
        e = -min(max(e_atom, -s.energy_clip), s.energy_clip)
        f_gated = s.force_only_if_stable and not passes
        e_gated = s.energy_only_if_stable and not passes
        f, e = (f_floor if f_gated else f), (e_floor if e_gated else e)
        reason = "unstable_gated" if (f_gated or e_gated) else "ok"
    return {"force_reward": f, "energy_reward": e, "stability_reward": r_stab,
            "reward": s.force_weight * f + s.energy_weight * e, "force_gated": f_gated, "energy_gated": e_gated, "reason": reason,
            "rms_force": rms, "formation_energy_per_atom_eV": e_atom}
