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

from flowrl_ray.batch import Batch, BatchMeta, flatten_obs, map_obs
from flowrl_ray.config import EnvConfig
from flowrl_ray.utils import restricted_loads

EVAL_SEED_OFFSET = 1_000_003
EVAL_ENVS = 8      # an evaluation of E episodes runs on min(E, EVAL_ENVS) envs, wherever it runs


def eval_quotas(episodes: int, envs: int = EVAL_ENVS) -> list[int]:
    """The episodes each evaluation env runs: E episodes on min(E, envs) envs, env i taking
    E // n of them and one more while i < E % n (a fixed quota: short episodes are not
    over-represented)."""
    n = min(episodes, envs)
    return [episodes // n + (i < episodes % n) for i in range(n)]


def eval_shares(episodes: int, workers: int, envs: int = EVAL_ENVS) -> list[list[int]]:
    """The evaluation envs each of ``workers`` runs: env i goes to worker i % workers. Together
    they are the layout of a one-process evaluation (``flowrl-ray eval``), so the periodic
    evaluation and a standalone one play the same episodes (each worker its own scenes)."""
    return [list(range(len(eval_quotas(episodes, envs))))[w::workers] for w in range(workers)]


def _noise_seed(base: int, env: int) -> int:
    """Evaluation env ``env``'s action-noise seed (numpy's SeedSequence of both)."""
    return int(np.random.SeedSequence([base, env]).generate_state(1)[0])


def _to_tensor(x: np.ndarray) -> torch.Tensor:
    """float32 for the policy; images stay uint8 (the encoder scales them)."""
    x = np.asarray(x)
    return torch.as_tensor(x) if x.dtype == np.uint8 else torch.as_tensor(x, dtype=torch.float32)


class EnvRunner:
    """Steps ``num_envs`` envs of one family with a policy copy; returns time-major batches.

    Batch keys (T = rollout_length, N = num_envs):
        obs [T, N, D], rewards [T, N], terminated [T, N], truncated [T, N],
        final_obs [T, N, D] (valid where truncated), last_obs [N, D], and the policy's record
        of each step (a Gaussian policy's actions [T, N, A] and logp [T, N]; a flow policy's
        action chunks and Monte Carlo pairs). Dict observations are stored as "obs/<key>".
    Families with ``episode_success(infos, done)`` also report each finished episode's success
    in ``meta.extra["successes"]``; families with ``executed_rows(infos, done)`` (action chunks)
    add ``executed_rows`` [T, N] int64: the rows of each step's chunk the env ran (fewer than
    ``act_steps`` where the episode ended inside the chunk); families with ``step_grasped(infos,
    done)`` (robot tasks) add ``grasped`` [T, N] bool: whether the gripper held the object after
    the step; families with ``start_seeds(infos, done)`` add ``start_seed`` [T, N] int64: the seed
    the step's episode started from (-1: none known), which names the groups of env.start_group.
    """

    def __init__(self, family, env_cfg: EnvConfig, num_envs: int, seed: int, policy: nn.Module,
                 worker_id: int = 0, start_group: int | None = None):
        self.family, self.env_cfg, self.num_envs = family, env_cfg, num_envs
        self.seed, self.worker_id, self.policy = seed, worker_id, policy
        self.policy_version = 0
        # training envs only: groups of env.start_group start each episode from one seeded state;
        # start_group=1: a runner made to evaluate (its training envs are never stepped)
        group = getattr(env_cfg, "start_group", 1) if start_group is None else start_group
        self.envs = family.make_vector_env(env_cfg, num_envs, start_group=group) if group > 1 else \
            family.make_vector_env(env_cfg, num_envs)
        self.obs, _ = self.envs.reset(seed=seed)
        self.generator = torch.Generator().manual_seed(seed)   # action noise
        self.episode_return = np.zeros(num_envs)
        self.episode_length = np.zeros(num_envs, dtype=np.int64)
        self._eval_envs = None

    def set_weights(self, state_dict: dict, version: int) -> None:
        self.policy.load_state_dict(state_dict)
        self.policy_version = version

    def _act(self, obs, deterministic: bool, generator: torch.Generator,
             record: bool = True) -> tuple[np.ndarray, dict]:
        action, rec = self.policy.act(map_obs(_to_tensor, obs), deterministic=deterministic,
                                      generator=generator, record=record)
        return action.numpy(), rec

    def _successes(self, infos: dict, done: np.ndarray) -> list[bool] | None:
        """Success of each episode that ended this step, for families that define it."""
        fn = getattr(self.family, "episode_success", None)
        return None if fn is None else fn(infos, done)[done].tolist()

    def sample(self, num_steps: int) -> Batch:
        start = time.perf_counter()
        n = self.num_envs
        buf = {"rewards": np.zeros((num_steps, n), np.float32),
               "terminated": np.zeros((num_steps, n), bool),
               "truncated": np.zeros((num_steps, n), bool)}
        for name in ("obs", "final_obs"):            # [T, N, ...] per observation array
            for k, v in flatten_obs(name, self.obs).items():
                buf[k] = np.zeros((num_steps, *v.shape), v.dtype if v.dtype == np.uint8 else np.float32)
        returns, lengths, successes = [], [], []
        for t in range(num_steps):
            for k, v in flatten_obs("obs", self.obs).items():
                buf[k][t] = v
            action, record = self._act(self.obs, False, self.generator)
            for k, v in record.items():
                if k not in buf:
                    buf[k] = np.zeros((num_steps, *v.shape), v.numpy().dtype)
                buf[k][t] = v.numpy()
            self.obs, reward, terminated, truncated, info = self.envs.step(action)
            buf["rewards"][t], buf["terminated"][t], buf["truncated"][t] = reward, terminated, truncated
            if hasattr(self.family, "executed_rows"):
                buf.setdefault("executed_rows", np.zeros((num_steps, n), np.int64))[t] = \
                    self.family.executed_rows(info, terminated | truncated)
            if hasattr(self.family, "start_seeds"):
                buf.setdefault("start_seed", np.zeros((num_steps, n), np.int64))[t] = \
                    self.family.start_seeds(info, terminated | truncated)
            if hasattr(self.family, "step_grasped"):
                buf.setdefault("grasped", np.zeros((num_steps, n), bool))[t] = \
                    self.family.step_grasped(info, terminated | truncated)
            self.episode_return += reward
            self.episode_length += 1
            done = terminated | truncated
            if done.any():
                if truncated.any():
                    # Same-step autoreset: self.obs already starts the next episode.
                    for i in np.flatnonzero(truncated):
                        for k, v in flatten_obs("final_obs", info["final_obs"][i]).items():
                            buf[k][t, i] = v
                returns.extend(self.episode_return[done].tolist())
                lengths.extend(self.episode_length[done].tolist())
                successes.extend(self._successes(info, done) or [])
                self.episode_return[done] = 0.0
                self.episode_length[done] = 0
        for k, v in flatten_obs("last_obs", self.obs).items():
            buf[k] = np.array(v, v.dtype if v.dtype == np.uint8 else np.float32)
        # env steps are simulator steps: a chunk counts the rows the env executed
        chunked = "executed_rows" in buf
        meta = BatchMeta(policy_version=self.policy_version, worker_id=self.worker_id,
                         env_steps=int(buf["executed_rows"].sum()) if chunked else num_steps * n,
                         chunks=num_steps * n if chunked else 0,
                         episode_returns=returns, episode_lengths=lengths,
                         sample_time_s=time.perf_counter() - start)
        if successes:
            meta.extra["successes"] = successes
        return Batch(buf, meta)

    def evaluate(self, episodes: int, deterministic: bool = True, video_episodes: int = 0,
                 video: tuple[str, int] = ("agentview", 256), on_episodes=None,
                 noise_seed: int | None = None, envs: list[int] | None = None,
                 seed: int | None = None) -> dict:
        """Run `episodes` full episodes on separate, freshly seeded eval envs (training envs
        keep their state). Returns returns and lengths of each episode (and, for families that
        report success, ``episode_successes``) in the order they finished, and ``episode_keys``:
        each episode's (env index, episode number on that env). The episodes run on
        min(episodes, EVAL_ENVS) envs with :func:`eval_quotas`, whatever this runner's training
        env count; env i is reset with seed
        ``seed + EVAL_SEED_OFFSET + i`` (``seed``: default this runner's) and its later episodes
        start from its own autoresets, so a key names the same initial state for every policy
        evaluated with the same seed and episode count (the pairing of
        ``flowrl_ray.stats.paired_bootstrap_gain``). Each env draws its action noise from its own
        generator, so an env's episodes do not depend on the others.

        envs: run only these envs of the layout (indices), each with its quota: a share of the
        evaluation (:func:`eval_shares`), whose episodes are the one-process evaluation's.

        video_episodes: families that render (robot: ``video = (camera, size)``) record the
        first ``video_episodes`` episodes that start, and only those, returned as ``videos``:
        [{"frames": [S + 1, H, W, 3] uint8 (the reset frame and one per low-level step),
        "fps" (the env's ``control_freq``: real time), "return", "length" (env steps),
        "success" (None where the family reports none)}].
        on_episodes(done, total): called after every env step in which episodes finished.
        noise_seed: the base of the envs' action-noise seeds (default ``seed + EVAL_SEED_OFFSET``,
        as the envs): another value replays the same initial states with other sampling noise.
        """
        if video_episodes and not hasattr(self.family, "check_video"):
            raise ValueError("this env family renders no videos")
        layout = eval_quotas(episodes)
        ids = list(range(len(layout))) if envs is None else list(envs)
        if not ids or not set(ids) <= set(range(len(layout))):
            raise ValueError(f"envs {ids}: not a share of the {len(layout)} evaluation envs")
        seed = self.seed if seed is None else seed
        if self._eval_envs is None or self._eval_envs.num_envs != len(ids):
            if self._eval_envs is not None:
                self._eval_envs.close()
            self._eval_envs = self.family.make_vector_env(self.env_cfg, len(ids))
        vec = self._eval_envs
        n = vec.num_envs
        quota = np.array([layout[i] for i in ids])
        episodes = int(quota.sum())
        # Rendering is slow: envs record only while a wanted video is running on them. The first
        # min(video_episodes, n) envs start recording; one that finishes a video goes on recording
        # its next episode while more videos are wanted.
        recording = [i < min(video_episodes, episodes) and quota[i] > 0 for i in range(n)]
        started_videos = sum(recording)
        if video_episodes:
            vec.set_attr("video", [video if r else None for r in recording])
        obs, _ = vec.reset(seed=[seed + EVAL_SEED_OFFSET + i for i in ids])
        done_count = np.zeros(n, dtype=np.int64)
        ret, length = np.zeros(n), np.zeros(n, dtype=np.int64)
        returns, lengths, successes, videos, keys = [], [], [], [], []
        noise_base = seed + EVAL_SEED_OFFSET if noise_seed is None else noise_seed
        eval_gens = [torch.Generator().manual_seed(_noise_seed(noise_base, i)) for i in ids]   # one per env
        while (done_count < quota).any():
            action, _ = self._act(obs, deterministic, eval_gens, record=False)
            obs, reward, terminated, truncated, info = vec.step(action)
            ret += reward
            length += 1
            done = terminated | truncated
            counted = done & (done_count < quota)
            success = self._successes(info, counted) if counted.any() else None
            if success is not None:
                successes.extend(success)
            for j, i in enumerate(np.flatnonzero(counted)):
                returns.append(float(ret[i]))
                lengths.append(int(length[i]))
                keys.append((ids[i], int(done_count[i])))
                if recording[i]:
                    frames = vec.get_attr("finished_frames")[i]   # the episode's, moved at reset
                    videos.append({"frames": np.stack(frames),
                                   "fps": vec.get_attr("control_freq")[i], "return": float(ret[i]),
                                   "length": int(length[i]),
                                   "success": None if success is None else bool(success[j])})
                    recording[i] = started_videos < video_episodes and done_count[i] + 1 < quota[i]
                    started_videos += recording[i]
                    if not recording[i]:
                        vec.set_attr("video", [None if k == i else v
                                                for k, v in enumerate(vec.get_attr("video"))])
            done_count += done
            ret[done], length[done] = 0.0, 0
            if on_episodes is not None and counted.any():
                on_episodes(min(int(np.minimum(done_count, quota).sum()), episodes), episodes)
        if video_episodes:               # frames stay out of later evaluations' memory
            vec.set_attr("video", [None] * n)
            vec.set_attr("frames", [[] for _ in range(n)])
            vec.set_attr("finished_frames", [[] for _ in range(n)])
        out = {"episode_returns": returns[:episodes], "episode_lengths": lengths[:episodes],
               "episode_keys": keys[:episodes]}
        if hasattr(self.family, "episode_success"):
            out["episode_successes"] = successes[:episodes]
        if video_episodes:
            out["videos"] = videos[:video_episodes]
        return out

    # Exact resume: the envs (simulator state and RNGs, through the family's snapshot), the
    # action-noise RNG and the running episode statistics. Envs the family cannot snapshot are
    # left freshly reset.
    def get_state(self) -> bytes:
        return pickle.dumps({"generator": self.generator.get_state().numpy(), "obs": self.obs,
                             "episode_return": self.episode_return,
                             "episode_length": self.episode_length,
                             "envs": self.family.snapshot(self.envs)})

    def set_state(self, blob: bytes) -> bool:
        """Restore; returns False when the envs could not be restored (they stay reset). The
        state is plain data (arrays, numbers, the family's snapshot as bytes): a blob that names
        anything else is refused naming it, and nothing in it runs."""
        state = restricted_loads(blob, "the rollout worker's state")
        self.generator.set_state(torch.as_tensor(state["generator"]))   # older states: a tensor
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
