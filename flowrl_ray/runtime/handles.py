"""The driver's parts that a rollout strategy is handed (``runtime/rollouts.py``), each narrow:

    WorkerPool        the rollout or scoring actors: start, index, restart within the budget,
                      wait for batches (a failed or late worker is replaced; a chunk it was
                      scoring goes to its replacement), their states for a checkpoint
    ResumableLearner  the learner group's calls; a rank that dies is replaced by a new group
                      resumed from the run's newest checkpoint and the call made again
    EvalMedia         what an evaluation films or pictures (eval.video, eval.snapshots) and where
                      it is written

The Trainer builds them and keeps the loop, the checkpoints and the metrics; the strategy built
from them has them report to its ``worker_restarted`` and ``learner_restarted``. ``counters`` is the Trainer's
``Counters`` (plain data, the driver's part of a checkpoint): the pool and the learner count
their restarts in it, so a resumed run keeps its restart budgets.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from flowrl_ray.batch import BatchMeta
from flowrl_ray.checkpoint import load_latest
from flowrl_ray.config import Config
from flowrl_ray.envs import EnvSpec, env_family
from flowrl_ray.errors import TrainingError
from flowrl_ray.runtime.learner_group import LearnerDied, LearnerGroup


class SamplesLost(Exception):
    """The learner that generated this iteration's samples died (group algorithms keep what the
    update needs on the learner): the iteration is sampled again by the resumed learner."""


class WorkerPool:
    """``runtime.num_workers`` actors of ``worker_class``; indexable and iterable like a list."""

    def __init__(self, worker_class, cfg: Config, spec: EnvSpec, counters, log: Callable[[str], None]):
        self.worker_class, self.cfg, self.spec, self.counters, self.log = worker_class, cfg, spec, counters, log
        self.actors: list = []
        #: called with the index of a replaced worker (the strategy gives it the current weights)
        self.on_restart: Callable[[int], None] = lambda index: None

    def _new(self, index: int, restarts: int = 0):
        rt = self.cfg.runtime
        return self.worker_class.options(num_cpus=rt.num_cpus_per_worker, num_gpus=rt.num_gpus_per_worker,
                                         name=None).remote(self.cfg, self.spec, index, restarts)

    def start(self) -> None:
        self.actors = [self._new(i) for i in range(self.cfg.runtime.num_workers)]

    def __len__(self) -> int:
        return len(self.actors)

    def __getitem__(self, index: int):
        return self.actors[index]

    def __iter__(self):
        return iter(self.actors)

    def restart(self, index: int, reason: str) -> None:
        """Replace worker ``index`` (up to runtime.max_worker_restarts over the run)."""
        c, budget = self.counters, self.cfg.runtime.max_worker_restarts
        if c.worker_restarts >= budget:
            raise TrainingError(f"rollout worker {index} failed ({reason}) and the restart budget "
                                f"runtime.max_worker_restarts={budget} is spent")
        c.worker_restarts += 1
        self.log(f"rollout worker {index} failed ({reason}); restarting ({c.worker_restarts}/{budget})")
        try:
            ray.kill(self.actors[index], no_restart=True)
        except Exception:  # noqa: BLE001 - it may be gone already
            pass
        self.actors[index] = self._new(index, restarts=c.worker_restarts)
        self.on_restart(index)

    def collect(self, pending: dict, needed: int) -> tuple[list[BatchMeta], list]:
        """Wait for `needed` batches among `pending` (meta ref -> (worker index, batch ref,
        chunk ref or None)); failed or timed-out workers are restarted, and a chunk to score is
        given once more to the restarted worker. Returns (metas, batch refs)."""
        metas, batch_refs = [], []
        timeout = self.cfg.runtime.sample_timeout_s
        deadline = time.monotonic() + timeout
        while pending and len(metas) < needed:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:                                   # timed out: replace the stragglers
                for ref, (index, _, _) in list(pending.items()):
                    self.restart(index, f"no batch within {timeout}s")
                    del pending[ref]
                break
            ref = ready[0]
            index, batch_ref, chunk = pending.pop(ref)
            try:
                meta: BatchMeta = ray.get(ref)
            except (RayActorError, RayError) as e:
                self.restart(index, type(e).__name__)
                if chunk is not None:
                    meta_ref, retry_ref = self.actors[index].score.remote(chunk)
                    pending[meta_ref] = (index, retry_ref, None)
                continue
            metas.append(meta)
            batch_refs.append(batch_ref)
        return metas, batch_refs

    def states(self) -> list:
        """Every worker's state for a checkpoint (None for one that does not answer)."""
        out = []
        for w in self.actors:
            try:
                out.append(ray.get(w.get_state.remote(), timeout=self.cfg.runtime.sample_timeout_s))
            except (RayError, GetTimeoutError):
                out.append(None)
        return out

    def close(self) -> None:
        for w in self.actors:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001
                pass


class ResumableLearner:
    """The learner group behind one ``call``: if a rank has died, a new group resumes from the
    newest checkpoint of ``run_dir`` (up to runtime.max_learner_restarts) and the call is made
    again (batch refs stay valid)."""

    def __init__(self, cfg: Config, spec: EnvSpec, run_dir: Path, counters, log: Callable[[str], None]):
        self.cfg, self.spec, self.run_dir, self.counters, self.log = cfg, spec, run_dir, counters, log
        self.group = LearnerGroup(cfg, spec)
        #: called after a new group was resumed (the strategy forgets what the old one held)
        self.on_restart: Callable[[], None] = lambda: None
        #: False where the samples of an update live on the learner that generated them: an
        #: ``update`` that meets a dead learner then raises SamplesLost instead of being made again
        self.batches_outlive_learner = True

    def call(self, method: str, *args):
        try:
            return self.group.call(method, *args)
        except LearnerDied:
            c, found = self.counters, load_latest(self.run_dir, self.log)
            if found is None or c.learner_restarts >= self.cfg.runtime.max_learner_restarts:
                raise TrainingError("the learner died and " + ("there is no checkpoint to resume it from"
                                    if found is None else "runtime.max_learner_restarts is spent")) from None
            c.learner_restarts += 1
            self.log(f"learner died during {method}; resuming it from {found[0].name}")
            self.group.close()
            self.group = LearnerGroup(self.cfg, self.spec)
            self.group.call("set_state", found[1]["learner"])
            self.on_restart()
            if method == "update" and not self.batches_outlive_learner:
                raise SamplesLost from None
            return self.group.call(method, *args)

    def close(self) -> None:
        self.group.close()


def media_due(cfg: Config, media, iteration: int) -> bool:
    """Whether the evaluation at `iteration` takes the pictures `media` (eval.video or
    eval.snapshots) asks for: at every `every`-th evaluation (the one at start, iteration 0, counts
    as the 0th; the one at iteration i as the (i // eval.interval)-th) and at the last iteration's."""
    if not media.episodes:
        return False
    number = iteration // cfg.eval.interval if cfg.eval.interval else 0
    return number % media.every == 0 or iteration == cfg.train.iterations


def snapshots_due(cfg: Config, iteration: int) -> bool:
    """eval.snapshots at the evaluation of `iteration` (see media_due)."""
    return media_due(cfg, cfg.eval.snapshots, iteration)


class EvalMedia:
    """Videos (robot envs) and pictures (scorers' snapshots) of the evaluation at the counters'
    iteration: whether they are due, and writing them under the run directory and to the metric
    sinks. A picture or a video never fails the run."""

    def __init__(self, cfg: Config, run_dir: Path, counters, logger, log: Callable[[str], None]):
        self.cfg, self.run_dir, self.counters, self.logger, self.log = cfg, run_dir, counters, logger, log

    def video_episodes(self) -> int:
        """Episodes to film at this evaluation: eval.video.episodes at the evaluations numbered
        0 (eval.at_start), every, 2 * every, ... (number = iteration // eval.interval) and at
        the last iteration; 0 otherwise."""
        video = self.cfg.eval.video
        return video.episodes if media_due(self.cfg, video, self.counters.iteration) else 0

    def snapshots(self) -> int:
        """Samples to picture at this evaluation (eval.snapshots.episodes when due, else 0)."""
        return self.cfg.eval.snapshots.episodes if snapshots_due(self.cfg, self.counters.iteration) else 0

    def write_videos(self, videos: list[dict]) -> None:
        """runs/<name>/videos/iter_<i>_<k>_<success|failure>.mp4, each also to the media sinks."""
        from flowrl_ray.video import save_videos, video_caption
        c = self.counters
        try:
            paths = save_videos(videos, self.run_dir / "videos", c.iteration)
            for path, v in zip(paths, videos):
                self.logger.log_media(path, c.env_steps, video_caption(c.iteration, v))
        except Exception as e:  # noqa: BLE001 - a video must not fail the run
            self.log(f"could not write the evaluation videos: {e}")
            return
        self.log(f"videos: {', '.join(str(p.relative_to(self.run_dir)) for p in paths)}")

    def save_snapshots(self, metas: list[BatchMeta]) -> None:
        """Pictures the scorers made at this evaluation (in their metas): the env family writes
        them under media/, each goes to the metrics sinks."""
        c = self.counters
        items = [item for m in metas for item in m.extra.get("snapshots", [])]
        for error in (e for m in metas for e in m.extra.get("snapshot_errors", [])):
            self.log(f"a scorer could not picture {error}")
        try:
            written = env_family(self.cfg.env.family).save_snapshots(items, self.run_dir / "media",
                                                                     f"iter_{c.iteration:04d}")
            for path, caption in written:
                self.logger.log_media(path, c.env_steps, caption)
            if written:
                self.log(f"evaluation pictures: {len(written)} PNG(s) in "
                         f"{written[0][0].parent.relative_to(self.run_dir)}/ ({len(items)} samples pictured)")
        except Exception as e:  # noqa: BLE001 - a picture must not fail the run
            self.log(f"could not write the evaluation pictures: {type(e).__name__}: {e}")
