"""The scoring side of the ``molecules`` family: what a scoring actor holds.

Settings live in the config's ``env.kwargs`` (all optional; see
:class:`~flowrl_ray.envs.molecules.rewards.RewardSettings` for units and meaning)::

    env:
      family: molecules
      id: qm9
      kwargs:
        backend: gfn2              # or mmff
        max_iter: 250
        timeout_s: 10
        min_distance: 0.5          # Å
        force_clip: 10             # eV/Å
        energy_clip: 10            # eV/atom
        energy_only_if_stable: false
        force_only_if_stable: false
        invalid_penalty_scale: 2
        force_weight: 1            # the logged scalar reward only
        energy_weight: 1
        gate_stable_atom_fraction: 1.0   # the gates' pass mark (1.0: every atom stable)
        atom_stability_weight: 1   # stability reward = w_atom * stable fraction
        valence_under_weight: 1    #   - w_under * missing soft valence - w_over * excess (per atom)
        valence_over_weight: 1
        valence_soft_temperature: 0.02   # Å

Per scored molecule the cost is one force-field call in the actor's child process (GFN2: a few
ms on QM9) plus EDM stability and RDKit validity/SMILES here (about 1 ms). The calls for a whole
chunk (final molecules, then the shaping molecules) are submitted first, and the chemistry runs
in this process while the child computes.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.envs.molecules.chemistry import canonical_smiles, valence_report
from flowrl_ray.envs.molecules.forcefield import ForceField
from flowrl_ray.envs.molecules.rewards import RewardSettings, molecule_rewards


class MoleculeScorer:
    """Turns generated molecules into force and energy rewards (one per scoring actor).

    ``score(samples)`` takes ``{"ids": int [K], "positions": K arrays [n_i, 3] (Å), "atom_types":
    K arrays [n_i] (indices into ATOM_TYPES)}`` and optionally ``"shaping"``: per molecule a list
    of S (positions [n, 3], atom_types [n]) pairs, the predicted clean molecules at the scheduled
    diffusion steps (same S for every molecule). It returns a :class:`Batch` with, all [K]:
    ``ids``, ``force_reward`` (eV/Å), ``energy_reward`` (eV/atom), ``stability_reward``, ``reward``
    (weighted sum of force and energy, for logging), ``force_gated`` / ``energy_gated`` (0/1)
    (float32); ``energy_eV`` (total), ``formation_energy_per_atom_eV``, ``rms_force``
    (eV/Å, unclipped) (float64, NaN where the force field failed), ``ff_seconds`` (float64, the
    calculation's time; 0 when rejected before any call); ``stable``,
    ``stable_atom_fraction``, ``under_bonded`` / ``over_bonded`` (atoms whose table bond-order sum
    is below / above their valence), ``overlap`` (atoms closer than ``min_distance``), ``valid``
    (float32, 0/1 for the flags); ``smiles`` ("" when
    invalid) and ``reason`` (object arrays of str); with shaping also ``shaping_energy_reward`` and
    ``shaping_force_reward`` [K, S] (float32; gated by the final molecule's stability and validity, as its trace is in
    Elign). ``meta.env_steps`` = K,
    ``meta.episode_returns`` = ``reward``, ``meta.episode_lengths`` = atoms per molecule,
    ``meta.extra``: ``reasons`` (reason -> count), ``shaping_reasons`` (with shaping),
    ``successes`` (stable, per molecule) and ``ff_restarts`` (child restarts so far).

    ``snapshots`` > 0: the molecules whose id is below it are also returned as pictures to draw,
    ``meta.extra["snapshots"]`` (:func:`~flowrl_ray.envs.molecules.snapshots.snapshot_item`
    dicts; the driver's :func:`~flowrl_ray.envs.molecules.snapshots.save_snapshots` makes the grid).
    """

    def __init__(self, settings: RewardSettings, worker_id: int = 0):
        self.settings = settings
        self.worker_id = worker_id
        self.ff = ForceField(settings.backend, max_iter=settings.max_iter, timeout_s=settings.timeout_s,
                             min_distance=settings.min_distance)

    def score(self, samples: dict, snapshots: int = 0) -> Batch:
        s = self.settings
        ids = np.asarray(samples["ids"])
        positions, atom_types = list(samples["positions"]), list(samples["atom_types"])
        k = len(ids)
        if not (k == len(positions) == len(atom_types)):
            raise ValueError(f"samples: ids, positions and atom_types differ in length "
                             f"({k}, {len(positions)}, {len(atom_types)})")
        shaping = samples.get("shaping")
        steps = 0
        if shaping is not None:
            shaping = [list(x) for x in shaping]
            steps = len(shaping[0]) if shaping else 0
            if len(shaping) != k or any(len(x) != steps for x in shaping):
                raise ValueError(f"samples: 'shaping' needs {k} lists of the same length "
                                 f"(got lengths {[len(x) for x in shaping]})")
        molecules = list(zip(positions, atom_types))
        extra_molecules = [m for per in (shaping or []) for m in per]

        self.ff.submit(molecules + extra_molecules)     # the child computes while we do chemistry
        try:
            valence = [valence_report(p, t, s.valence_soft_temperature) for p, t in molecules]
            smiles = [canonical_smiles(p, t) for p, t in molecules]
        finally:
            results = self.ff.collect()

        rewards = [molecule_rewards(r, va, s, valid=sm is not None)
                   for r, va, sm in zip(results[:k], valence, smiles)]
        f32 = lambda key: np.array([r[key] for r in rewards], dtype=np.float32)   # noqa: E731
        f64 = lambda key: np.array([r[key] for r in rewards], dtype=np.float64)   # noqa: E731
        data = {"ids": ids, "force_reward": f32("force_reward"), "energy_reward": f32("energy_reward"),
                "stability_reward": f32("stability_reward"), "reward": f32("reward"),
                "force_gated": f32("force_gated"), "energy_gated": f32("energy_gated"),
                "energy_eV": np.array([r.energy_eV for r in results[:k]], dtype=np.float64),
                "formation_energy_per_atom_eV": f64("formation_energy_per_atom_eV"),
                "rms_force": f64("rms_force"),
                "stable": np.array([va["under_bonded"] + va["over_bonded"] == 0 and va["n"] > 0
                                    for va in valence], dtype=np.float32),
                "stable_atom_fraction": np.array([va["stable_atom_fraction"] for va in valence], dtype=np.float32),
                "under_bonded": np.array([va["under_bonded"] for va in valence], dtype=np.float32),
                "over_bonded": np.array([va["over_bonded"] for va in valence], dtype=np.float32),
                "overlap": np.array([r["reason"] == "overlap" for r in rewards], dtype=np.float32),
                "valid": np.array([sm is not None for sm in smiles], dtype=np.float32),
                "smiles": np.array([sm or "" for sm in smiles], dtype=object),
                "reason": np.array([r["reason"] for r in rewards], dtype=object),
                "ff_seconds": np.array([r.seconds for r in results[:k]], dtype=np.float64)}
        extra = {"reasons": dict(Counter(r["reason"] for r in rewards)),
                 "successes": [bool(x) for x in data["stable"]], "ff_restarts": self.ff.restarts}
        if shaping is not None:
            # The predicted molecules along a trajectory are gated by the final molecule, as in
            # Elign: a stability gate floors the whole trace (its flag multiplies the trace, so
            # with gamma = 1 the returns G_t are 0); an RDKit-invalid final molecule (penalty on)
            # has its trace zeroed and only its final reward at the penalty, so its energy
            # returns G_t = Psi_0 - 0 and its last delta column carry the penalty.
            shaped = [molecule_rewards(r, valence[j], s, valid=smiles[j] is not None)
                      for j, r in zip(np.repeat(np.arange(k), steps), results[k:])]
            zeroed = np.repeat([s.invalid_penalty_scale > 0 and sm is None for sm in smiles], steps)
            for key in ("energy_reward", "force_reward"):
                trace = np.array([0.0 if z else r[key] for r, z in zip(shaped, zeroed)], dtype=np.float32)
                data[f"shaping_{key}"] = trace.reshape(k, steps)
            extra["shaping_reasons"] = dict(Counter(r["reason"] for r in shaped))
        if snapshots:                 # the molecules with ids < snapshots, drawn by the driver
            from flowrl_ray.envs.molecules.snapshots import snapshot_item
            extra["snapshots"] = []
            for j in (j for j in range(k) if ids[j] < snapshots):
                try:
                    extra["snapshots"].append(snapshot_item(
                        int(ids[j]), positions[j], atom_types[j], bool(data["stable"][j]), smiles[j] is not None,
                        float(data["formation_energy_per_atom_eV"][j])))
                except Exception as e:  # noqa: BLE001 - a picture must never cost the molecule's score
                    extra.setdefault("snapshot_errors", []).append(f"{int(ids[j])}: {type(e).__name__}: {e}")
        meta = BatchMeta(policy_version=-1, worker_id=self.worker_id, env_steps=k,
                         episode_returns=data["reward"].tolist(),
                         episode_lengths=[len(t) for t in atom_types],
                         extra=extra)
        return Batch(data, meta)

    def close(self) -> None:
        """Stop the force-field child (idempotent)."""
        ff, self.ff = getattr(self, "ff", None), None
        if ff is not None:
            ff.close()

    def __enter__(self) -> "MoleculeScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
