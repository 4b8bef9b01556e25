"""Rollout strategies: how the Trainer gets experience for each algorithm kind.

The Trainer picks one at start (``rollout_strategy(algorithm class)``) and drives it without
knowing the kind:

    sample()            -> (metas, batch refs)   metas come to the driver, batches go to the learner
    publish()           -> policy version        after each update
    evaluate()          -> eval/... metrics
    worker_restarted(i)                          a replaced worker gets what it needs
    learner_restarted()                          a replaced learner group: what it lost is sampled again
    drain()                                      samples still in flight land (before a checkpoint)
    checkpoint_part()   -> extra checkpoint keys

EnvStepRollouts (EnvStepAlgorithm): every rollout worker steps its envs with a policy copy; the
learner's weights go out once per version (one ray.put, the same ref to every worker). Every
update takes one batch from each worker. In asynchronous mode a worker starts its next batch while
the learner updates, but is paced: it starts a batch only when that batch will be at most
``runtime.max_staleness`` versions old when the learner uses it, and otherwise waits for newer
weights, so no batch is thrown away (``dropped_batches`` stays 0; ``policy_lag_mean`` says how old
the used batches were). max_staleness 0 is synchronous sampling.

GroupRollouts (GroupAlgorithm): the learner generates (``generate(num_workers, mode)``: one ray.put
per chunk), every scoring worker scores one chunk; nothing is published, scorers hold no model. In
asynchronous mode the learner generates the next iteration's groups before each update and the
scorers score them while it updates, paced the same way: at most ``runtime.max_staleness``
generations ahead, so a batch is at most that many versions old when the learner uses it.
"""

from __future__ import annotations

import collections
from abc import ABC, abstractmethod

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError

from flowrl_ray.batch import BatchMeta
from flowrl_ray.config import Config, ConfigError
from flowrl_ray.envs.rollout import eval_quotas, eval_shares
from flowrl_ray.runtime.actors import RolloutWorker, ScoringWorker
from flowrl_ray.runtime.handles import EvalMedia, ResumableLearner, WorkerPool


class Rollouts(ABC):
    """The strategy's contract (see the module docstring). ``worker_class`` is the Ray actor the
    Trainer starts ``runtime.num_workers`` of. A strategy is handed narrow parts of the driver
    (``runtime/handles.py``): the worker pool (its actors, their restarts, the wait for batches),
    the learner's calls, the evaluation's media and the counters; it never sees the Trainer."""

    worker_class = None
    #: whether sampled batches stay usable when the learner is replaced (group algorithms keep
    #: what their update needs on the learner that generated them)
    batches_outlive_learner = True

    def __init__(self, cfg: Config, workers: WorkerPool, learner: ResumableLearner, media: EvalMedia, counters):
        """counters: the Trainer's ``Counters`` (iteration, learner restarts, dropped batches). The
        pool and the learner are told to report a replaced worker or learner to this strategy."""
        self.cfg, self.workers, self.learner, self.media, self.counters = cfg, workers, learner, media, counters
        workers.on_restart = self.worker_restarted
        learner.on_restart = self.learner_restarted
        learner.batches_outlive_learner = self.batches_outlive_learner

    @staticmethod
    def check_config(cfg: Config, family) -> None:
        """What this kind of run refuses before Ray starts; ConfigError naming the key."""

    @abstractmethod
    def sample(self) -> tuple[list[BatchMeta], list]:
        """See the module docstring."""

    @abstractmethod
    def publish(self) -> int:
        """See the module docstring."""

    @abstractmethod
    def evaluate(self) -> dict:
        """See the module docstring."""

    def worker_restarted(self, index: int) -> None:
        """Worker ``index`` was replaced by a fresh actor."""

    def learner_restarted(self) -> None:
        """The learner (group) was replaced and resumed from the last checkpoint."""

    def drain(self) -> None:
        """Let samples still in flight land (async mode) before the workers' state is saved."""

    def checkpoint_part(self) -> dict:
        return {}


def _by_worker(metas: list[BatchMeta], refs: list) -> tuple[list[BatchMeta], list]:
    """Arrival order varies from run to run; worker order keeps updates reproducible."""
    order = sorted(range(len(metas)), key=lambda i: metas[i].worker_id)
    return [metas[i] for i in order], [refs[i] for i in order]


class EnvStepRollouts(Rollouts):
    worker_class = RolloutWorker

    def __init__(self, *parts):
        super().__init__(*parts)
        self.weights_ref = None
        self.version = 0
        self._inflight: dict = {}     # meta ref -> (worker index, batch ref, None), async mode
        # async mode: each worker's batches that arrived and wait for their update, and whether
        # the batches of an update were taken and its weights are not published yet
        self._ready: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._update_pending = False

    @staticmethod
    def check_config(cfg: Config, family) -> None:
        if cfg.eval.video.episodes:
            check_video = getattr(family, "check_video", None)
            if check_video is None:
                raise ConfigError(f"config key 'eval.video': videos are rendered for robot tasks "
                                  f"(env.family robot) only, not env.family {cfg.env.family!r}")
            check_video(cfg.eval.video)

    # ------------------------------------------------------------------ weights
    def publish(self) -> int:
        """One ray.put of the new weights (by the learner); every worker gets the same ref."""
        refs, self.version = self.learner.call("publish")
        self.weights_ref = refs[0]
        self._update_pending = False
        for w in self.workers:
            w.set_weights.remote(self.weights_ref, self.version)
        return self.version

    def worker_restarted(self, index: int) -> None:
        self.workers[index].set_weights.remote(self.weights_ref, self.version)

    def checkpoint_part(self) -> dict:
        """The published weights, which ``eval``, ``serve`` and the protocol load."""
        return {"policy": self.learner.call("policy_weights")}

    # ------------------------------------------------------------------ sampling
    def _issue(self, index: int) -> None:
        meta_ref, batch_ref = self.workers[index].sample.remote()
        self._inflight[meta_ref] = (index, batch_ref, None)

    def sample(self) -> tuple[list[BatchMeta], list]:
        rt = self.cfg.runtime
        n = len(self.workers)
        if rt.mode == "sync":
            self._inflight = {}
            for i in range(n):
                self._issue(i)
            metas, refs = self.workers.collect(self._inflight, n)
            self._inflight = {}
            return _by_worker(metas, refs)
        # async: every worker samples ahead as far as pacing allows (_refill); the update takes
        # each worker's oldest batch
        self._refill()
        while self._inflight and any(not self._ready[i] for i in range(n)):
            for meta, ref in zip(*self.workers.collect(self._inflight, 1)):
                self._ready[meta.worker_id].append((meta, ref))
            self._refill()                                   # the worker samples on (or a restarted one)
        metas, refs = [], []
        for i in range(n):
            if not self._ready[i]:
                continue
            meta, ref = self._ready[i].popleft()
            if self.version - meta.policy_version > rt.max_staleness:   # pacing makes this never happen
                self.counters.dropped_batches += 1
                continue
            metas.append(meta)
            refs.append(ref)
        self._update_pending = True
        self._refill()                                       # sampling overlaps the update
        return metas, refs

    def _refill(self) -> None:
        """Start the next batch of every idle worker that pacing lets start: the batch will be
        used by the update after the one in progress (if any) and after the worker's batches that
        wait, and then be that many versions old; it may start when that is <= max_staleness."""
        busy = {index for index, _, _ in self._inflight.values()}
        for i in range(len(self.workers)):
            lag = int(self._update_pending) + len(self._ready[i])
            if i not in busy and lag <= self.cfg.runtime.max_staleness:
                self._issue(i)

    def drain(self) -> None:
        if self._inflight:
            ray.wait(list(self._inflight), num_returns=len(self._inflight),
                     timeout=self.cfg.runtime.sample_timeout_s)

    # ------------------------------------------------------------------ evaluation
    def evaluate_episodes(self, episodes: int, sampling: str, videos: int = 0) -> dict:
        """``episodes`` episodes by ``sampling``: the evaluation envs of ``flowrl-ray eval`` (seeded
        by the run's seed) shared among the workers, each running its share on eval envs of its
        own, so the result is the standalone evaluation's; the first ``videos`` episodes filmed.
        -> {"keys", "returns", "lengths", "successes" (families that report it), "videos"}, the
        episodes ordered by key (env index, episode number on that env): a key is the same
        initial state in every evaluation of the run. A worker that fails is replaced and its
        episodes are missing (fewer keys)."""
        envs = eval_shares(episodes, len(self.workers))              # env indices per worker
        quotas = eval_quotas(episodes)
        shares = [sum(quotas[i] for i in e) for e in envs]           # episodes per worker
        # Videos of the first `videos` episodes, taken from the first workers' shares.
        films = [min(s, max(0, videos - sum(shares[:i]))) for i, s in enumerate(shares)]
        refs = {self.workers[i].evaluate.remote(episodes, e, films[i], sampling): i
                for i, e in enumerate(envs) if e}
        results = []
        for ref, i in refs.items():
            try:
                results.append(ray.get(ref, timeout=self.cfg.runtime.sample_timeout_s))
            except (RayError, GetTimeoutError) as e:
                self.workers.restart(i, f"during evaluation: {type(e).__name__}")
        keyed = sorted((tuple(k), r["episode_returns"][j], r["episode_lengths"][j],
                        r["episode_successes"][j] if "episode_successes" in r else None)
                       for r in results for j, k in enumerate(r["episode_keys"]))
        out = {"keys": [list(k) for k, *_ in keyed], "returns": [x[1] for x in keyed],
               "lengths": [x[2] for x in keyed], "videos": [v for r in results for v in r.get("videos", [])]}
        if keyed and keyed[0][3] is not None:
            out["successes"] = [bool(x[3]) for x in keyed]
        return out

    def evaluate(self) -> dict:
        """``eval.episodes`` episodes by ``eval.sampling`` (:meth:`evaluate_episodes`), the first
        ``eval.video.episodes`` filmed where an evaluation is due for videos."""
        result = self.evaluate_episodes(self.cfg.eval.episodes, self.cfg.eval.sampling,
                                        self.media.video_episodes())
        if result["videos"]:
            self.media.write_videos(result["videos"])
        returns, lengths, successes = result["returns"], result["lengths"], result.get("successes")
        if not returns:
            return {}
        out = {"eval/return_mean": float(np.mean(returns)), "episode_reward": float(np.mean(returns)),
               "eval/return_std": float(np.std(returns)),
               "eval/length_mean": float(np.mean(lengths)), "eval/episodes": len(returns)}
        if successes is not None:
            out["eval/success_rate"] = float(np.mean(successes))
        return out


class GroupRollouts(Rollouts):
    worker_class = ScoringWorker
    batches_outlive_learner = False

    def __init__(self, *parts):
        super().__init__(*parts)
        # async mode: generations whose scoring is in flight, oldest first (each
        # (meta ref -> (worker index, batch ref, chunk ref), chunks)), made before the update they feed
        self._ahead: collections.deque = collections.deque()

    @staticmethod
    def check_config(cfg: Config, family) -> None:
        if cfg.eval.video.episodes:
            raise ConfigError(f"config key 'eval.video': videos are rendered for robot tasks "
                              f"(env.family robot) only, not env.family {cfg.env.family!r}")
        if cfg.eval.compare_episodes:
            raise ConfigError("config key 'eval.compare_episodes': the start-vs-final comparison is made "
                              "for env-step runs; a group run's evaluation already scores fixed held-out "
                              "tasks at every eval.interval")
        if cfg.eval.snapshots.episodes and not hasattr(family, "save_snapshots"):
            raise ConfigError(f"config key 'eval.snapshots.episodes': env family {cfg.env.family!r} "
                              f"makes no pictures (it has no save_snapshots)")

    def publish(self) -> int:
        """Scorers hold no model: only the learner's version is read."""
        return self.learner.call("policy_version")

    def _start(self, mode: str, snapshots: int = 0) -> tuple[dict, int]:
        """The learner samples, the workers start scoring one chunk each (and picturing the
        samples with ids below `snapshots`, returned in their metas); -> (the scoring calls in
        flight, the number of chunks), for ``WorkerPool.collect``, which replaces a scorer that
        fails and has its chunk scored again by the new one."""
        chunk_refs = self.learner.call("generate", len(self.workers), mode, snapshots)
        pending = {}
        for i, chunk in enumerate(chunk_refs):
            index = i % len(self.workers)
            meta_ref, batch_ref = self.workers[index].score.remote(chunk)
            pending[meta_ref] = (index, batch_ref, chunk)
        return pending, len(chunk_refs)

    def _score(self, mode: str, snapshots: int = 0) -> tuple[list[BatchMeta], list]:
        return _by_worker(*self.workers.collect(*self._start(mode, snapshots)))

    def sample(self) -> tuple[list[BatchMeta], list]:
        if self.cfg.runtime.mode == "sync":
            return self._score("train")
        # async: this update takes the oldest generation; the next ones are generated now, with
        # the weights of this update's start, and scored while it runs (none past the last update)
        c = self.counters
        while True:
            if not self._ahead:
                self._generate_ahead()
            (pending, chunks), learner = self._ahead.popleft()
            metas, refs = _by_worker(*self.workers.collect(pending, chunks))
            updates_left = self.cfg.train.iterations - c.iteration - 1
            while len(self._ahead) < min(self.cfg.runtime.max_staleness, updates_left):
                self._generate_ahead()
            if learner == c.learner_restarts:
                return metas, refs
            # the learner that generated these samples died since (it kept what their update
            # needs): learner_restarted() emptied the queue; sample again from the new one

    def _generate_ahead(self) -> None:
        started = self._start("train")
        self._ahead.append((started, self.counters.learner_restarts))   # which learner holds it

    def learner_restarted(self) -> None:
        """A new learner holds none of the generations in flight: they are sampled again."""
        self._ahead.clear()

    def drain(self) -> None:
        calls = [ref for (pending, _), _ in self._ahead for ref in pending]
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=self.cfg.runtime.sample_timeout_s)

    def evaluate(self) -> dict:
        snapshots = self.media.snapshots()
        metas, refs = self._score("eval", snapshots)
        if snapshots:
            self.media.save_snapshots(metas)
        return self.learner.call("eval_metrics", refs) if refs else {}


def rollout_strategy(algorithm_cls: type) -> type[Rollouts]:
    """The strategy for an algorithm class (by its kind, see ``algorithms/base.py``)."""
    return {"env_step": EnvStepRollouts, "group": GroupRollouts}[algorithm_cls.rollout_kind]
