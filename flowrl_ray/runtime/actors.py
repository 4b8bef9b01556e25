"""The Ray actors: the rollout workers of the two algorithm kinds (an env-step worker holds envs
and a policy copy, a scoring worker holds a scorer) and the learner (the algorithm).
Which worker a run starts is decided by its rollout strategy (``runtime/rollouts.py``)."""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import ray
import torch

from flowrl_ray.algorithms import get_algorithm
from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.config import Config
from flowrl_ray.envs import EnvSpec, env_family
from flowrl_ray.envs.rollout import EnvRunner
from flowrl_ray.utils import default_device, seed_everything, worker_seed


class _Worker:
    """What both rollout actors share: their seed (a restarted worker gets fresh env seeds), the
    state of what they hold for an exact resume (``_resumable``: the env runner of a
    RolloutWorker, the scorer of a ScoringWorker), the process id."""

    def __init__(self, cfg: Config, worker_id: int, restarts: int):
        torch.set_num_threads(cfg.runtime.torch_threads)
        self.seed = worker_seed(cfg.seed, worker_id, restarts)
        seed_everything(self.seed)
        self.worker_id = worker_id
        self._resumable: Any = None

    def get_state(self) -> bytes | None:
        get = getattr(self._resumable, "get_state", None)
        return get() if get else None

    def set_state(self, blob: bytes | None) -> bool:
        return bool(blob is not None and hasattr(self._resumable, "set_state") and self._resumable.set_state(blob))

    def pid(self) -> int:
        return os.getpid()


@ray.remote
class RolloutWorker(_Worker):
    """An env-step rollout actor (EnvStepAlgorithm): `envs_per_worker` envs and a policy copy;
    `sample()` steps them. Returns (meta, batch): the meta goes to the driver (small), the batch
    ref to the learner."""

    def __init__(self, cfg: Config, spec: EnvSpec, worker_id: int, restarts: int = 0):
        super().__init__(cfg, worker_id, restarts)
        policy = get_algorithm(cfg.algorithm).make_policy(cfg, spec)
        self.runner = self._resumable = EnvRunner(env_family(cfg.env.family), cfg.env, cfg.runtime.envs_per_worker,
                                                  self.seed, policy, worker_id)
        self.rollout_length = cfg.runtime.rollout_length
        self.eval_sampling, self.run_seed = cfg.eval.sampling, cfg.seed
        self.video = (cfg.eval.video.camera, cfg.eval.video.size)

    def set_weights(self, state_dict: dict, version: int) -> int:
        # `state_dict` arrives resolved from the one ray.put the learner made for this version.
        self.runner.set_weights(state_dict, version)
        return version

    @ray.method(num_returns=2)
    def sample(self) -> tuple[BatchMeta, Batch]:
        batch = self.runner.sample(self.rollout_length)
        return batch.meta, batch

    def evaluate(self, episodes: int, envs: list[int], video_episodes: int = 0,
                 sampling: str | None = None) -> dict:
        """EnvRunner.evaluate's result for this worker's share ``envs`` of an evaluation of
        ``episodes`` episodes (``eval_shares``), seeded by the run's seed, not the worker's: the
        shares together are ``flowrl-ray eval``'s episodes. ``sampling``: default the config's
        ``eval.sampling``. The first `video_episodes` episodes are rendered and come back as
        ``videos`` (frames [S + 1, H, W, 3] uint8 each) for the driver to encode."""
        sampling = sampling or self.eval_sampling
        return self.runner.evaluate(episodes, deterministic=sampling == "zero",
                                    video_episodes=video_episodes, video=self.video,
                                    envs=envs, seed=self.run_seed)

    def policy_version(self) -> int:
        return self.runner.policy_version

    def policy_state(self) -> dict:
        return self.runner.policy.state_dict()


@ray.remote
class ScoringWorker(_Worker):
    """A scoring actor (GroupAlgorithm): holds the env family's scorer (a browser, a force field);
    `score(chunk)` turns the learner's samples into rewards. Returns (meta, batch) as
    RolloutWorker.sample does."""

    def __init__(self, cfg: Config, spec: EnvSpec, worker_id: int, restarts: int = 0):
        super().__init__(cfg, worker_id, restarts)
        self.scorer = self._resumable = env_family(cfg.env.family).make_scorer(cfg.env, self.seed, worker_id)

    @ray.method(num_returns=2)
    def score(self, chunk: dict) -> tuple[BatchMeta, Batch]:
        """chunk: {"policy_version", "samples"[, "snapshots"]} as made by Learner.generate;
        with snapshots N > 0 the scorer also pictures the samples whose id is below N."""
        t0 = time.perf_counter()
        n = chunk.get("snapshots", 0)
        batch = self.scorer.score(chunk["samples"], snapshots=n) if n else self.scorer.score(chunk["samples"])
        batch.meta.policy_version, batch.meta.worker_id = chunk["policy_version"], self.worker_id
        batch.meta.sample_time_s = time.perf_counter() - t0
        return batch.meta, batch


@ray.remote
class Learner:
    """Runs the algorithm's prepare + update on batches it fetches itself (never via the driver)
    and publishes each new policy version with one ray.put.

    One rank of a learner group (``runtime/learner_group.py``) when ``runtime.num_learners`` > 1:
    every rank builds the algorithm from the same seed (the same initial weights), fetches the
    whole batch, and updates on its share of each minibatch; the optimiser step sums the
    gradients over the ranks (``flowrl_ray.optim``), so the weights stay the same on every rank."""

    def __init__(self, cfg: Config, spec: EnvSpec, rank: int = 0):
        torch.set_num_threads(cfg.runtime.torch_threads)
        seed_everything(cfg.seed)
        self.cfg, self.rank = cfg, rank
        self.device = default_device()
        self.algo = get_algorithm(cfg.algorithm)(cfg, spec, self.device)
        self.version = 0
        # group algorithms: what each "train" generation kept (the algorithm's ``pending``), oldest
        # first, until the update on its scored samples (async mode generates ahead of the update)
        self.generated: collections.deque = collections.deque()

    # the learner group's process group (torch.distributed)
    def rendezvous_address(self) -> str:
        """host:port where this rank (0) hosts the group's rendezvous: a free port on its node."""
        import socket
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, address: str, world_size: int, timeout_s: float) -> str:
        """Join the group's process group (gloo on CPUs, NCCL on GPUs) at rank 0's ``address``.
        A collective that waits longer than ``timeout_s`` (a dead rank) fails this rank too.
        Returns the backend."""
        import datetime

        import torch.distributed as dist
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=self.rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        return backend

    def policy_version(self) -> int:
        return self.version

    # EnvStepAlgorithm: the weights rollout workers load
    def publish(self) -> tuple[list, int]:
        """([ref to the policy weights], version). The ref is wrapped in a list so the driver
        receives the reference, not the weights."""
        return [ray.put(self.algo.policy_state_dict())], self.version

    def policy_weights(self) -> dict:
        """The published weights themselves, for the checkpoint's "policy"."""
        return self.algo.policy_state_dict()

    # GroupAlgorithm: sampling on the learner

    def generate(self, num_chunks: int, mode: str = "train", snapshots: int = 0) -> list:
        """Group algorithms: sample on the learner's device; returns refs (one ray.put per
        chunk) of {"policy_version", "samples"} for the scoring workers (plus "snapshots": the
        scorers picture the samples with ids below it). What the update needs (trajectories,
        behaviour log-probs) stays here, in the algorithm."""
        chunks = self.algo.generate(num_chunks, mode)
        if mode == "train":
            self.generated.append(self.algo.pending)
        extra = {"snapshots": snapshots} if snapshots else {}
        return [ray.put({"policy_version": self.version, "samples": c, **extra}) for c in chunks]

    def eval_metrics(self, batch_refs: list) -> dict[str, float]:
        return self.algo.eval_metrics(ray.get(batch_refs))

    def update(self, batch_refs: list) -> dict[str, Any]:
        t0 = time.perf_counter()
        batches: list[Batch] = ray.get(batch_refs)
        fetched = time.perf_counter()
        if self.algo.rollout_kind == "group":
            if not self.generated:
                raise RuntimeError("update: these scored samples were generated by another learner "
                                   "(it died); sample them again")
            # the generation these batches scored (async mode: older than the last one)
            prepared = self.algo.prepare(batches, self.generated.popleft())
        else:
            prepared = self.algo.prepare(batches)
        metrics = self.algo.update(prepared)
        self.version += 1
        metrics.update({"learner/update_time_s": time.perf_counter() - fetched,
                        "learner/fetch_time_s": fetched - t0,
                        "learner/device": str(self.device)})
        return metrics

    def analysis(self) -> dict | None:
        return self.algo.analysis()

    def get_state(self) -> dict[str, Any]:
        return {"algorithm": self.algo.state_dict(), "version": self.version,
                "torch_rng": torch.get_rng_state()}

    def pid(self) -> int:
        return os.getpid()

    def set_state(self, state: dict[str, Any]) -> list[str]:
        """Load a checkpoint's learner state; returns what the algorithm changed to fit the
        config (schedules extended to a new train.iterations), one line each."""
        self.algo.load_state_dict(state["algorithm"])
        self.version = state["version"]
        torch.set_rng_state(state["torch_rng"])
        return list(self.algo.resume_notes)
