"""robomimic's hdf5 demonstration layout, read and written natively with h5py.

The robomimic package itself is not a dependency: robomimic 0.3.0 imports mujoco_py (gone from
robosuite 1.5), and praxis-robomimic 0.5.0 imports torchvision, whose registry wheels are built
against CUDA torch and fail to load next to a CPU torch. The layout is small, so it is kept here:

    data/                       attrs: total (transitions in all demos), env_args (JSON string:
                                       env_name, env_version, type=1 for robosuite, env_kwargs)
    data/demo_N/                attrs: num_samples (T), model_file (MJCF xml, optional)
    data/demo_N/obs/<key>       [T, ...] e.g. robot0_eef_pos [T, 3], object [T, 14],
                                         agentview_image [T, H, W, 3] uint8
    data/demo_N/actions         [T, A] in the env's own units (robosuite: [-1, 1])
    data/demo_N/rewards         [T]
    data/demo_N/dones           [T]   1 on the last transition of a finished episode
    data/demo_N/states          [T, S] flattened MuJoCo state (time, qpos, qvel) before action t
    mask/<filter_key>           names of the demos in a split (robomimic's "train"/"valid")

A real robomimic dataset (ph/mh, low_dim or image) therefore loads through :func:`load_demos`
exactly like the demonstrations that :mod:`flowrl_ray.envs.robot.experts` writes. Files written
here also keep their normalisation statistics (min/max of the observation vector and of the
actions) in ``stats/``; for a file without them the statistics are computed from its demos.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from flowrl_ray.envs.gym import rescale_action

if TYPE_CHECKING:
    import h5py

ROBOSUITE_ENV_TYPE = 1     # robomimic's EnvType.ROBOSUITE_TYPE


def _h5py():
    """h5py, imported when a demo file is read or written: the robot family's learner-side
    code (configs, specs, policies) loads without it, as on a GPU machine that holds no h5py."""
    import h5py
    return h5py


def _demo_names(data: h5py.Group, f: h5py.File, filter_key: str | None) -> list[str]:
    """Demo names in robomimic's order (by index, not lexically: demo_10 after demo_9)."""
    if filter_key is not None:
        if f"mask/{filter_key}" not in f:
            raise KeyError(f"no filter key {filter_key!r} in the dataset (has: "
                           f"{sorted(f['mask']) if 'mask' in f else 'none'})")
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in f[f"mask/{filter_key}"][()]]
    else:
        names = list(data.keys())
    return sorted(names, key=lambda n: int(n.split("_")[-1]))


def env_args(path: str | Path) -> dict:
    """The ``data.attrs["env_args"]`` metadata (env_name, env_version, type, env_kwargs)."""
    with _h5py().File(path, "r") as f:
        return json.loads(f["data"].attrs["env_args"])


def iter_demos(path: str | Path, obs_keys: Sequence[str], filter_key: str | None = None
               ) -> Iterator[dict[str, np.ndarray]]:
    """Yield each demo as {"obs": {key: [T, ...]}, "actions": [T, A], "rewards": [T],
    "dones": [T]}, reading only the observation keys asked for."""
    with _h5py().File(path, "r") as f:
        data = f["data"]
        for name in _demo_names(data, f, filter_key):
            demo = data[name]
            missing = [k for k in obs_keys if k not in demo["obs"]]
            if missing:
                raise KeyError(f"{path}: {name} has no observation key(s) {missing} "
                               f"(has: {sorted(demo['obs'])})")
            yield {"obs": {k: demo["obs"][k][()] for k in obs_keys},
                   "actions": demo["actions"][()].astype(np.float32),
                   "rewards": demo["rewards"][()].astype(np.float32),
                   "dones": demo["dones"][()].astype(np.float32)}


def load_demos(path: str | Path, obs_keys: Sequence[str], filter_key: str | None = None
               ) -> list[dict[str, np.ndarray]]:
    """All demos (see :func:`iter_demos`), with the low-dim keys also concatenated in the given
    order as ``"state"`` [T, D] (image keys, 4-d arrays, are left out of it)."""
    demos = []
    for demo in iter_demos(path, obs_keys, filter_key):
        low_dim = [demo["obs"][k].astype(np.float32).reshape(len(demo["actions"]), -1)
                   for k in obs_keys if demo["obs"][k].ndim <= 2]
        demo["state"] = np.concatenate(low_dim, axis=1) if low_dim else None
        demos.append(demo)
    return demos


# --------------------------------------------------------------------------- normalisation

@dataclass(frozen=True)
class NormStats:
    """Per-dimension min/max of the observation vector (keys concatenated in ``obs_keys``
    order) and of the actions. Both map to [-1, 1] with ``x -> 2 (x - min) / (max - min) - 1``;
    a constant dimension (max == min) maps its value to -1 and back."""
    obs_keys: tuple[str, ...]
    obs_min: np.ndarray        # [D]
    obs_max: np.ndarray        # [D]
    action_min: np.ndarray     # [A]
    action_max: np.ndarray     # [A]

    def normalize_obs(self, obs: np.ndarray) -> np.ndarray:
        return _to_unit(obs, self.obs_min, self.obs_max)

    def normalize_action(self, action: np.ndarray) -> np.ndarray:
        return _to_unit(action, self.action_min, self.action_max)

    def unnormalize_action(self, action: np.ndarray) -> np.ndarray:
        """[-1, 1] -> the dataset's action range (inputs outside [-1, 1] are clipped first)."""
        return rescale_action(action, self.action_min, self.action_max)


def _to_unit(x: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """The inverse of :func:`rescale_action`: [low, high] -> [-1, 1] (no clipping: a value
    outside the dataset's range stays visible to the policy)."""
    span = high - low
    span = np.where(span > 0, span, 1.0)     # a constant dimension: avoid 0/0
    return (2.0 * (np.asarray(x, np.float64) - low) / span - 1.0).astype(np.float32)


def compute_stats(path: str | Path, obs_keys: Sequence[str]) -> NormStats:
    """Min/max over every transition of every demo."""
    obs_lo = obs_hi = act_lo = act_hi = None
    for demo in iter_demos(path, obs_keys):
        t = len(demo["actions"])
        state = np.concatenate([demo["obs"][k].reshape(t, -1) for k in obs_keys], axis=1)
        lo, hi = state.min(0), state.max(0)
        alo, ahi = demo["actions"].min(0), demo["actions"].max(0)
        obs_lo = lo if obs_lo is None else np.minimum(obs_lo, lo)
        obs_hi = hi if obs_hi is None else np.maximum(obs_hi, hi)
        act_lo = alo if act_lo is None else np.minimum(act_lo, alo)
        act_hi = ahi if act_hi is None else np.maximum(act_hi, ahi)
    if obs_lo is None:
        raise ValueError(f"{path}: the dataset holds no demos")
    as64 = lambda a: np.asarray(a, np.float64)   # noqa: E731
    return NormStats(tuple(obs_keys), as64(obs_lo), as64(obs_hi), as64(act_lo), as64(act_hi))


def write_stats(path: str | Path, stats: NormStats) -> None:
    with _h5py().File(path, "a") as f:
        if "stats" in f:
            del f["stats"]
        g = f.create_group("stats")
        g.attrs["obs_keys"] = json.dumps(list(stats.obs_keys))
        for name in ("obs_min", "obs_max", "action_min", "action_max"):
            g.create_dataset(name, data=getattr(stats, name))


def read_stats(path: str | Path, obs_keys: Sequence[str]) -> NormStats:
    """The statistics stored with the dataset when they cover ``obs_keys`` in this order,
    else computed from its demos (a downloaded robomimic file has none stored)."""
    with _h5py().File(path, "r") as f:
        if "stats" in f and json.loads(f["stats"].attrs["obs_keys"]) == list(obs_keys):
            g = f["stats"]
            return NormStats(tuple(obs_keys), *(g[n][()] for n in
                                                ("obs_min", "obs_max", "action_min", "action_max")))
    return compute_stats(path, obs_keys)


# --------------------------------------------------------------------------- writing

class DemoWriter:
    """Writes demos one at a time in robomimic's layout; :meth:`close` adds the totals.

        with DemoWriter(path, env_args) as w:
            w.add(obs={"object": [T, 10], ...}, actions=[T, 7], rewards=[T], dones=[T], states=[T, S])
    """

    def __init__(self, path: str | Path, env_args: dict):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(path)
        self._file = _h5py().File(self.path, "w")
        self._data = self._file.create_group("data")
        self._data.attrs["env_args"] = json.dumps(env_args, indent=2)
        self.num_demos = 0
        self.total = 0

    def add(self, obs: dict[str, np.ndarray], actions: np.ndarray, rewards: np.ndarray,
            dones: np.ndarray, states: np.ndarray, model_file: str | None = None) -> str:
        t = len(actions)
        for name, arr in [("rewards", rewards), ("dones", dones), ("states", states),
                          *((f"obs/{k}", v) for k, v in obs.items())]:
            if len(arr) != t:
                raise ValueError(f"demo field {name} has {len(arr)} steps, actions have {t}")
        name = f"demo_{self.num_demos}"
        demo = self._data.create_group(name)
        for key, value in obs.items():
            value = np.asarray(value)
            # Images compress well and dominate the file; low-dim arrays are left plain.
            demo.create_dataset(f"obs/{key}", data=value,
                                compression="gzip" if value.ndim == 4 else None)
        demo.create_dataset("actions", data=np.asarray(actions, np.float64))
        demo.create_dataset("rewards", data=np.asarray(rewards, np.float64))
        demo.create_dataset("dones", data=np.asarray(dones, np.int64))
        demo.create_dataset("states", data=np.asarray(states, np.float64))
        demo.attrs["num_samples"] = t
        if model_file is not None:
            demo.attrs["model_file"] = model_file
        self.num_demos += 1
        self.total += t
        return name

    def close(self) -> None:
        if self._file.id.valid:
            self._data.attrs["total"] = self.total
            self._file.close()

    def __enter__(self) -> "DemoWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
