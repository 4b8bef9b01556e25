"""The scoring side of the ``forms`` family: settings from the config and the scorer object that
a scoring actor holds (one form server + one browser pool per actor).

Settings live in the config's ``env.kwargs`` (all optional)::

    env:
      family: forms
      id: train                  # the split the algorithm draws prompts from
      kwargs:
        forms_dir: my_forms/     # extra spec files (added to the shipped ones)
        pages: 4                 # parallel pages per actor
        action_timeout_s: 5
        rollout_timeout_s: 30
        restart_every: 200       # episodes between browser restarts (0: never)
        reward_weights: {task_completion: 0.4, field_accuracy: 0.4, execution_completeness: 0.2}
        task_seed: 0             # the seed of load_tasks (the algorithm's prompts)
        chromium: null           # Chromium executable (default: $FLOWRL_CHROMIUM, Playwright's own, PATH)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.config import check
from flowrl_ray.envs.forms.browser import BrowserPool
from flowrl_ray.envs.forms.reward import EpisodeResult, RewardWeights
from flowrl_ray.envs.forms.server import FormServer
from flowrl_ray.envs.forms.spec import FormCatalog, FormSpecError
from flowrl_ray.envs.forms.tasks import SPLITS, FormTask, task_from_id


def _config_error(key: str, msg: str):
    from flowrl_ray.config import ConfigError
    return ConfigError(f"config key 'env.{key}': {msg}")


@dataclass(frozen=True)
class FormsSettings:
    """The forms family's ``env.kwargs`` (all optional), checked by the config's schema checker."""
    forms_dir: str | None = None
    pages: int = field(default=4, metadata=check(ge=1))
    action_timeout_s: float = field(default=5.0, metadata=check(gt=0))
    rollout_timeout_s: float = field(default=30.0, metadata=check(gt=0))
    restart_every: int = field(default=200, metadata=check(ge=0))
    reward_weights: RewardWeights = field(default_factory=RewardWeights)
    task_seed: int = field(default=0, metadata=check(ge=0))
    chromium: str | None = None
    task_file: str | None = None          # training tasks in FormFactory's layout (task_file.py)

    @classmethod
    def from_env_cfg(cls, env_cfg) -> "FormsSettings":
        """Validate ``env_cfg.id`` (a split) and ``env_cfg.kwargs``; ConfigError names the key."""
        from flowrl_ray.config import build_section
        if env_cfg.id not in SPLITS:
            raise _config_error("id", f"the forms family takes a split name ({', '.join(SPLITS)}), got {env_cfg.id!r}")
        settings = build_section(cls, dict(env_cfg.kwargs or {}), "env.kwargs.")
        for k in ("forms_dir", "chromium", "task_file"):
            if getattr(settings, k) == "":
                raise _config_error(f"kwargs.{k}", "must be a path, got ''")
        if not any(vars(settings.reward_weights).values()):
            raise _config_error("kwargs.reward_weights", "at least one weight must be > 0")
        if settings.rollout_timeout_s < settings.action_timeout_s:
            raise _config_error("kwargs.rollout_timeout_s", f"{settings.rollout_timeout_s} is shorter than "
                                f"action_timeout_s ({settings.action_timeout_s})")
        return settings

    def catalog(self) -> FormCatalog:
        """The shipped forms plus ``forms_dir``; a bad spec is a ConfigError naming the key and file."""
        try:
            return FormCatalog.load(self.forms_dir)
        except FormSpecError as e:
            raise _config_error("kwargs.forms_dir", str(e)) from None

    def file_tasks(self, catalog: FormCatalog) -> list[FormTask]:
        """The tasks of ``task_file`` (none without one); a bad file is a ConfigError naming the
        key, the file, the line and the task's key."""
        if self.task_file is None:
            return []
        from flowrl_ray.envs.forms.task_file import TaskFileError, load_task_file
        try:
            return load_task_file(self.task_file, catalog)
        except TaskFileError as e:
            raise _config_error("kwargs.task_file", str(e)) from None


class FormsScorer:
    """Turns generated action texts into rewards in a real browser (one per scoring actor).

    ``score(samples)`` takes ``{"ids": int [K], "task_ids": list[str] (K), "texts": list[str] (K)}``
    and returns a :class:`Batch` with, all ``[K]``: ``ids``, ``rewards`` (float32),
    ``task_completion``, ``field_accuracy``, ``execution_completeness`` (float32),
    ``unparseable_lines`` (int64), ``reason`` (str, '' when the episode was judged normally) and
    ``valid`` (bool: False for a crash, timeout, load or page error, ``reward.INVALID_REASONS``);
    ``meta.episode_returns`` are the rewards, ``meta.episode_lengths`` the parsed actions per episode,
    ``meta.extra`` holds ``reasons`` (reason -> count), ``successes`` (accepted with every field
    right, per episode: the trainer's success rate), ``accepted`` and ``unparseable_lines`` (totals).

    ``snapshots`` > 0: the episodes whose id is below it are also pictured, ``meta.extra
    ["snapshots"]``: one :func:`~flowrl_ray.envs.forms.snapshots.snapshot_item` each (a PNG of
    the filled page beside the task, the script, the fields right/wrong and the reward).
    """

    def __init__(self, settings: FormsSettings, worker_id: int = 0, catalog: FormCatalog | None = None):
        self.settings = settings
        self.worker_id = worker_id
        self.catalog = catalog if catalog is not None else settings.catalog()
        # a task file's tasks cannot be rebuilt from their ids: read them here
        self._tasks: dict[str, FormTask | None] = {t.task_id: t for t in settings.file_tasks(self.catalog)}
        self.server = FormServer(self.catalog).start()
        try:
            self.pool = BrowserPool(self.server, pages=settings.pages, action_timeout_s=settings.action_timeout_s,
                                    rollout_timeout_s=settings.rollout_timeout_s,
                                    restart_every=settings.restart_every, weights=settings.reward_weights,
                                    chromium=settings.chromium).start()
        except BaseException:
            self.server.stop()
            raise

    def task(self, tid: str) -> FormTask | None:
        """The task an id names (rebuilt from the id, cached), or None if it names none."""
        if tid not in self._tasks:
            try:
                self._tasks[tid] = task_from_id(tid, self.catalog)
            except (ValueError, KeyError):
                self._tasks[tid] = None
        return self._tasks[tid]

    def run(self, task_ids: list[str], texts: list[str], screenshots: list[int] = ()) -> list[EpisodeResult]:
        """Episodes for (task id, action text) pairs; an unknown task id scores 0 (unknown_task).
        The episodes at the positions in ``screenshots`` carry a PNG of the filled page."""
        episodes = []
        for tid, text in zip(task_ids, texts):
            task = self.task(str(tid))
            # An unknown id goes in as a form id the catalog lacks: the pool gates it (unknown_task).
            episodes.append((task if task is not None else f"<unknown task {tid}>", text))
        results = self.pool.execute(episodes, screenshots=screenshots)
        for tid, r in zip(task_ids, results):
            r.task_id = str(tid)
        return results

    def score(self, samples: dict, snapshots: int = 0) -> Batch:
        ids = np.asarray(samples["ids"])
        task_ids, texts = list(samples["task_ids"]), list(samples["texts"])
        if not (len(ids) == len(task_ids) == len(texts)):
            raise ValueError(f"samples: ids, task_ids and texts differ in length "
                             f"({len(ids)}, {len(task_ids)}, {len(texts)})")
        pictured = [j for j in range(len(ids)) if ids[j] < snapshots]
        results = self.run(task_ids, texts, screenshots=pictured)
        rewards = np.array([r.reward for r in results], dtype=np.float32)
        col = lambda name: np.array([getattr(r, name) or 0.0 for r in results], dtype=np.float32)  # noqa: E731
        data = {"ids": ids, "rewards": rewards, "task_completion": col("task_completion"),
                "field_accuracy": col("field_accuracy"), "execution_completeness": col("execution_completeness"),
                "unparseable_lines": np.array([r.unparseable_lines for r in results], dtype=np.int64),
                "reason": np.array([r.reason for r in results], dtype=str),
                "valid": np.array([r.valid for r in results], dtype=bool)}
        reasons = Counter(r.reason for r in results if r.reason)
        meta = BatchMeta(policy_version=-1, worker_id=self.worker_id, env_steps=len(results),
                         episode_returns=rewards.tolist(), episode_lengths=[r.actions for r in results],
                         extra={"reasons": dict(reasons), "successes": [r.success for r in results],
                                "accepted": sum(r.accepted for r in results),
                                "unparseable_lines": int(data["unparseable_lines"].sum())})
        if snapshots:                  # composed here, where the episode's details are; written by the driver
            from flowrl_ray.envs.forms.snapshots import snapshot_item
            meta.extra["snapshots"] = []
            for j in pictured:
                try:
                    meta.extra["snapshots"].append(snapshot_item(
                        int(ids[j]), results[j].screenshot, self.task(str(task_ids[j])), texts[j], results[j],
                        self.catalog.forms.get(results[j].form_id), self.settings.reward_weights))
                except Exception as e:  # noqa: BLE001 - a picture must never cost the episode's score
                    meta.extra.setdefault("snapshot_errors", []).append(f"{task_ids[j]}: {type(e).__name__}: {e}")
        for r in results:
            r.screenshot = None
        return Batch(data, meta)

    def close(self) -> None:
        """Stop the browser, then the server (idempotent)."""
        pool, self.pool = getattr(self, "pool", None), None
        if pool is not None:
            pool.close()
        if self.server is not None:
            self.server.stop()

    def __enter__(self) -> "FormsScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
