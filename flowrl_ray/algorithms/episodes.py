"""Complete episodes from time-major rollout fragments, for algorithms whose signal is an
episode's outcome (FlowSAR's binary success R). Pure numpy, no Ray.

Env-step batches hold ``[T, N, ...]`` fragments: an episode may start in one batch and end in
a later batch of the same worker (same env column). :class:`EpisodeAssembler` keeps each env's
unfinished tail and returns the episodes that ended, each as arrays ``[H, ...]``.
:class:`StartGroups` holds complete episodes until the whole group that started from one seeded
state (``env.start_group``, recorded per step as ``start_seed``) has ended: GRPO's groups.
"""

from __future__ import annotations

import numpy as np

from flowrl_ray.batch import Batch


class EpisodeAssembler:
    """Per (worker, env column) carry of unfinished episodes.

    ``add(batches)`` returns the episodes that ended in these batches, oldest step first:
    ``{key: [H, ...] for every per-step key, "terminated": bool, "truncated": bool,
    "return": float, "final_obs...": [...] (only when truncated)}``. Per-step keys are the
    observations ("obs" or "obs/<k>"), ``rewards`` and the policy's record (``actions``, ...).
    """

    def __init__(self, step_keys: tuple[str, ...] = ("actions",)):
        self.step_keys = step_keys            # policy-record keys kept per step
        self.tails: dict[tuple[int, int], list[dict]] = {}

    def _keys(self, data: dict) -> list[str]:
        obs = [k for k in data if k == "obs" or k.startswith("obs/")]
        return obs + ["rewards", *[k for k in self.step_keys if k in data]]

    def add(self, batches: list[Batch]) -> list[dict]:
        episodes = []
        for batch in batches:
            data = batch.data
            keys = self._keys(data)
            final_keys = [k for k in data if k == "final_obs" or k.startswith("final_obs/")]
            steps, envs = data["rewards"].shape
            for j in range(envs):
                tail = self.tails.setdefault((batch.worker_id, j), [])
                for t in range(steps):
                    # copies: a carried tail must not keep (or see changes to) the whole batch
                    tail.append({k: np.array(data[k][t, j]) for k in keys})
                    terminated, truncated = bool(data["terminated"][t, j]), bool(data["truncated"][t, j])
                    if terminated or truncated:
                        # a key the batches began to carry mid-episode (a tail from an older
                        # checkpoint) is left out of that episode
                        ep = {k: np.stack([s[k] for s in tail]) for k in keys if all(k in s for s in tail)}
                        ep.update(terminated=terminated, truncated=truncated,
                                  **{"return": float(ep["rewards"].sum())})
                        if truncated:
                            ep.update({k: np.array(data[k][t, j]) for k in final_keys})
                        episodes.append(ep)
                        tail = self.tails[(batch.worker_id, j)] = []
        return episodes

    @property
    def pending_steps(self) -> int:
        return sum(len(t) for t in self.tails.values())

    def state_dict(self) -> dict:
        return {"tails": {k: list(v) for k, v in self.tails.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.tails = {tuple(k): list(v) for k, v in state["tails"].items()}


class StartGroups:
    """Complete episodes -> whole start groups of ``size`` episodes (the K envs of an
    ``env.start_group`` that started from one seeded state; an episode's group is its first
    ``start_seed``). ``add(episodes)`` returns the episodes of the groups now complete, K
    consecutive per group, in the order the groups completed; the others wait. A group still
    incomplete after ``wait`` calls (its worker restarted with other seeds) is dropped, as is an
    episode without a known start (``start_seed`` -1 or absent); ``stats`` counts both."""

    def __init__(self, size: int, wait: int = 20):
        self.size, self.wait = size, wait
        self.pending: dict[int, dict] = {}          # start seed -> {"episodes": [...], "age": calls}
        self.stats: dict[str, float] = {"pending_group_episodes": 0.0, "dropped_group_episodes": 0.0}

    def add(self, episodes: list[dict]) -> list[dict]:
        unseeded = 0
        for ep in episodes:
            seed = int(ep["start_seed"][0]) if "start_seed" in ep else -1
            if seed < 0:
                unseeded += 1
                continue
            self.pending.setdefault(seed, {"episodes": [], "age": 0})["episodes"].append(ep)
        ready, dropped = [], 0
        for seed in list(self.pending):
            group = self.pending[seed]
            if len(group["episodes"]) >= self.size:
                ready.extend(group["episodes"][:self.size])
                del self.pending[seed]
            elif group["age"] >= self.wait:
                dropped += len(group["episodes"])
                del self.pending[seed]
            else:
                group["age"] += 1
        self.stats = {"pending_group_episodes": float(sum(len(g["episodes"]) for g in self.pending.values())),
                      "dropped_group_episodes": float(dropped + unseeded)}
        return ready

    def state_dict(self) -> dict:
        return {"pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.pending = dict(state["pending"])


def episode_obs(episodes: list[dict]):
    """The episodes' observations, one after the other: [M, ...] (M = their steps), or a dict of
    them for dict observations (``obs/<key>`` -> ``<key>``)."""
    keys = [k for k in episodes[0] if k == "obs" or k.startswith("obs/")]
    cat = {k: np.concatenate([ep[k] for ep in episodes]) for k in keys}
    return cat["obs"] if "obs" in cat else {k[4:]: v for k, v in cat.items()}


def pad_episodes(episodes: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Stack the per-step ``key`` of episodes of different lengths into ``[E, H_max, ...]``
    (zeros past each end) and the validity mask ``[E, H_max]``."""
    h_max = max(len(ep[key]) for ep in episodes)
    first = episodes[0][key]
    out = np.zeros((len(episodes), h_max, *first.shape[1:]), first.dtype)
    mask = np.zeros((len(episodes), h_max), bool)
    for i, ep in enumerate(episodes):
        out[i, :len(ep[key])] = ep[key]
        mask[i, :len(ep[key])] = True
    return out, mask
