"""Env-step rollouts: a policy copy stepping a vector of envs. No Ray here.

The Ray rollout worker wraps an :class:`EnvRunner`; the benchmarks run the same class in a
single process as the baseline, so both measure the same env and policy code.
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import torch
from torch import nn

from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.config import EnvConfig

EVAL_SEED_OFFSET = 1_000_003


class EnvRunner:
    """Steps ``num_envs`` envs of one family with a policy copy; returns time-major batches.

    Batch keys (T = rollout_length, N = num_envs):
        obs [T, N, D], actions [T, N, A], logp [T, N], rewards [T, N], terminated [T, N],
        truncated [T, N], final_obs [T, N, D] (valid where truncated), last_obs [N, D].
    """

    def __init__(self, family, env_cfg: EnvConfig, num_envs: int, seed: int, policy: nn.Module,
                 worker_id: int = 0):
        self.family, self.env_cfg, self.num_envs = family, env_cfg, num_envs
        self.seed, self.worker_id, self.policy = seed, worker_id, policy
        self.policy_version = 0
        self.envs = family.make_vector_env(env_cfg, num_envs)
        self.obs, _ = self.envs.reset(seed=seed)
        self.generator = torch.Generator().manual_seed(seed)   # action noise
        self.episode_return = np.zeros(num_envs)
        self.episode_length = np.zeros(num_envs, dtype=np.int64)
        self._eval_envs = None

    def set_weights(self, state_dict: dict, version: int) -> None:
        self.policy.load_state_dict(state_dict)
        self.policy_version = version

    def _act(self, obs: np.ndarray, deterministic: bool) -> tuple[np.ndarray, dict]:
        action, record = self.policy.act(torch.as_tensor(obs, dtype=torch.float32),
                                         deterministic=deterministic, generator=self.generator)
        return action.numpy(), record

    def sample(self, num_steps: int) -> Batch:
        start = time.perf_counter()
        n, obs_shape = self.num_envs, self.obs.shape[1:]
        buf = {"obs": np.zeros((num_steps, n, *obs_shape), np.float32),
               "rewards": np.zeros((num_steps, n), np.float32),
               "terminated": np.zeros((num_steps, n), bool),
               "truncated": np.zeros((num_steps, n), bool),
               "final_obs": np.zeros((num_steps, n, *obs_shape), np.float32)}
        returns, lengths = [], []
        for t in range(num_steps):
            buf["obs"][t] = self.obs
            action, record = self._act(self.obs, deterministic=False)
            for k, v in record.items():
                if k not in buf:
                    buf[k] = np.zeros((num_steps, *v.shape), v.numpy().dtype)
                buf[k][t] = v.numpy()
            self.obs, reward, terminated, truncated, info = self.envs.step(action)
            buf["rewards"][t], buf["terminated"][t], buf["truncated"][t] = reward, terminated, truncated
            self.episode_return += reward
            self.episode_length += 1
            done = terminated | truncated
            if done.any():
                if truncated.any():
                    # Same-step autoreset: self.obs already starts the next episode.
                    final = np.stack([np.asarray(o) if o is not None else np.zeros(obs_shape)
                                      for o in info["final_obs"]])
                    buf["final_obs"][t][truncated] = final[truncated]
                returns.extend(self.episode_return[done].tolist())
                lengths.extend(self.episode_length[done].tolist())
                self.episode_return[done] = 0.0
                self.episode_length[done] = 0
        buf["last_obs"] = np.asarray(self.obs, np.float32).copy()
        meta = BatchMeta(policy_version=self.policy_version, worker_id=self.worker_id,
                         env_steps=num_steps * n, episode_returns=returns, episode_lengths=lengths,
                         sample_time_s=time.perf_counter() - start)
        return Batch(buf, meta)

    def evaluate(self, episodes: int, deterministic: bool = True) -> dict:
        """Run `episodes` full episodes on separate, freshly seeded eval envs (training envs
        keep their state). Returns returns and lengths of each episode."""
        if self._eval_envs is None:
            self._eval_envs = self.family.make_vector_env(self.env_cfg, min(self.num_envs, episodes))
        envs = self._eval_envs
        obs, _ = envs.reset(seed=self.seed + EVAL_SEED_OFFSET)
        n = envs.num_envs
        # Each env runs a fixed quota of episodes, so short episodes are not over-represented.
        quota = np.array([episodes // n + (i < episodes % n) for i in range(n)])
        done_count = np.zeros(n, dtype=np.int64)
        ret, length = np.zeros(n), np.zeros(n, dtype=np.int64)
        returns, lengths = [], []
        eval_gen = torch.Generator().manual_seed(self.seed + EVAL_SEED_OFFSET)
        while (done_count < quota).any():
            action, _ = self.policy.act(torch.as_tensor(obs, dtype=torch.float32),
                                        deterministic=deterministic, generator=eval_gen)
            obs, reward, terminated, truncated, _ = envs.step(action.numpy())
            ret += reward
            length += 1
            done = terminated | truncated
            for i in np.flatnonzero(done & (done_count < quota)):
                returns.append(float(ret[i]))
                lengths.append(int(length[i]))
            done_count += done
            ret[done], length[done] = 0.0, 0
        return {"episode_returns": returns[:episodes], "episode_lengths": lengths[:episodes]}

    # Exact resume: the envs (simulator state and RNGs, through the family's snapshot), the
    # action-noise RNG and the running episode statistics. Envs the family cannot snapshot are
    # left freshly reset.
    def get_state(self) -> bytes:
        return pickle.dumps({"generator": self.generator.get_state(), "obs": self.obs,
                             "episode_return": self.episode_return,
                             "episode_length": self.episode_length,
                             "envs": self.family.snapshot(self.envs)})

    def set_state(self, blob: bytes) -> bool:
        """Restore; returns False when the envs could not be restored (they stay reset)."""
        state = pickle.loads(blob)
        self.generator.set_state(state["generator"])
        if state["envs"] is None:
            return False
        self.envs.close()
        self.envs = self.family.restore(state["envs"])
        self.obs = state["obs"]
        self.episode_return, self.episode_length = state["episode_return"], state["episode_length"]
        return True

    def close(self) -> None:
        self.envs.close()
        if self._eval_envs is not None:
            self._eval_envs.close()
