"""The driver: starts the actors, runs the loop, checkpoints, evaluates, logs.

Per iteration:
    rollouts.sample() -> (metas, batch refs)      metas come to the driver, batches don't
    learner.update([batch refs])                  the learner fetches the batches itself
    rollouts.publish() -> policy version          env-step: one ray.put of the weights per version
The rollout strategy (``runtime/rollouts.py``) is picked at start from the algorithm's kind:
env-step workers step envs with a policy copy, scoring workers score what the learner generated.
A worker that dies or times out is replaced (up to `max_worker_restarts`), given what its
strategy gives a new worker (the current weights), and the iteration goes on with the batches
that arrived. A learner that dies is resumed from the last checkpoint (`max_learner_restarts`).
"""

from __future__ import annotations

import collections
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray

from flowrl_ray.algorithms import get_algorithm
from flowrl_ray.algorithms.base import Algorithm
from flowrl_ray.checkpoint import latest_checkpoint, load_latest, save_checkpoint
from flowrl_ray.config import Config, save_config
from flowrl_ray.envs import EnvSpec, env_family
from flowrl_ray.errors import TrainingError, UserError
from flowrl_ray.metrics import read_metrics, truncate_metrics
from flowrl_ray.progress import Progress
from flowrl_ray.runtime.cluster import init_ray
from flowrl_ray.runtime.learner_group import LearnerGroup
from flowrl_ray.runtime.dashboard import RunGauges, metrics_endpoint
from flowrl_ray.runtime.metrics import MetricsLogger
from flowrl_ray.runtime.handles import EvalMedia, ResumableLearner, SamplesLost, WorkerPool
from flowrl_ray.runtime import start_vs_final
from flowrl_ray.runtime.rollouts import rollout_strategy
from flowrl_ray.runtime.tracking import open_trackers, preflight
from flowrl_ray.utils import atomic_write_text

RETURN_WINDOW = 100   # episode_return_mean averages the last 100 finished training episodes


@dataclass
class Counters:
    """The driver's part of a checkpoint."""
    iteration: int = 0
    env_steps: int = 0         # simulator steps
    chunks: int = 0            # action chunks (envs that execute chunks; each up to env.act_steps env steps)
    episodes: int = 0
    time_s: float = 0.0
    worker_restarts: int = 0
    learner_restarts: int = 0
    dropped_batches: int = 0
    recent_returns: list = field(default_factory=list)
    recent_successes: list = field(default_factory=list)   # families that report success
    best_eval_return: float | None = None


def _success_summary(rows: list[dict]) -> dict:
    """First and last training success rate and last eval success rate, for families that
    report success (empty otherwise)."""
    train = [r["success_rate"] for r in rows if r.get("success_rate") is not None]
    evals = [r["eval/success_rate"] for r in rows if r.get("eval/success_rate") is not None]
    out = {}
    if train:
        out.update(first_success_rate=train[0], final_success_rate=train[-1])
    if evals:
        out.update(first_eval_success_rate=evals[0], final_eval_success_rate=evals[-1])
    return out


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | os.PathLike, resume: bool = False,
                 tune_trial: bool = False, tensorboard: bool = True, quiet: bool = False):
        self.cfg, self.run_dir, self.resume = cfg, Path(run_dir), resume
        self.tune_trial, self.tensorboard, self.quiet = tune_trial, tensorboard, quiet
        # The spec is read before Ray starts: a bad env id stops here with a clear message.
        family = env_family(cfg.env.family)
        self.spec: EnvSpec = family.spec(cfg.env)
        algorithm = get_algorithm(cfg.algorithm)
        strategy = rollout_strategy(algorithm)
        strategy.check_config(cfg, family)
        algorithm.preflight(cfg, self.spec)
        if not tune_trial:          # a trial's W&B / MLflow run belongs to Tune's callbacks
            preflight(cfg.logging)
        self.counters = Counters()
        self.strategy = strategy
        self.workers = WorkerPool(strategy.worker_class, cfg, self.spec, self.counters, self._log)
        self.version = 0
        self._started_ray = False

    # ------------------------------------------------------------------ setup
    @property
    def learners(self) -> LearnerGroup:
        """The learner group now serving (a new one after a learner restart)."""
        return self.learning.group

    @property
    def learner(self):
        """Rank 0's Learner actor (the only one unless runtime.num_learners > 1)."""
        return self.learners.actors[0]

    def setup(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._started_ray = init_ray(self.cfg)
        self.learning = ResumableLearner(self.cfg, self.spec, self.run_dir, self.counters, self._log)
        if self.learners.size > 1:
            self._log(f"learner group: {self.learners.size} ranks ({self.learners.backend}, "
                      f"{self.cfg.runtime.learner_placement} placement)")
        self.workers.start()
        # the newest checkpoint that loads whole (a damaged newer one is named and skipped)
        found = load_latest(self.run_dir, self._log) if self.resume else None
        if found is not None:
            self._restore(found[1])
        elif self.resume:            # nothing saved yet: start over, without the old rows
            truncate_metrics(self.run_dir, 0)
        # On resume this records the overrides given then (e.g. a longer train.iterations).
        save_config(self.cfg, self.run_dir / "config.yaml")
        trackers = [] if self.tune_trial else open_trackers(self.cfg, self.run_dir, self.resume)
        for tracker in trackers:
            self._log(("continuing " if self.resume else "logging to ") + tracker.where)
        self.logger = MetricsLogger(self.run_dir, self.cfg.name, tensorboard=self.tensorboard,
                                    tune=self.tune_trial, purge_step=self.counters.env_steps or None,
                                    trackers=trackers)
        # The strategy gets the driver's parts (and has them report a replaced worker or learner).
        media = EvalMedia(self.cfg, self.run_dir, self.counters, self.logger, self._log)
        self.rollouts = self.strategy(self.cfg, self.workers, self.learning, media, self.counters)
        self.version = self.rollouts.publish()
        # Tune trials share the config's name: their run tag adds the trial's directory (its id).
        run_tag = f"{self.cfg.name}/{self.run_dir.name}" if self.tune_trial else self.cfg.name
        self.gauges = RunGauges(run_tag, self.cfg.algorithm, self.cfg.env.id)
        self._log(f"Ray dashboard metrics: ray_flowrl_* gauges tagged run={run_tag} at {metrics_endpoint()}")

    def _restore(self, ckpt: dict) -> None:
        for key, value in vars(Counters(**ckpt["trainer"])).items():   # in place: the parts hold it
            setattr(self.counters, key, value)
        c = self.counters
        if "chunks" not in ckpt["trainer"] and self.cfg.env.family == "robot" and c.env_steps:
            # Written before env steps meant simulator steps: its env_steps counted chunks.
            c.chunks, c.env_steps = c.env_steps, c.env_steps * self.cfg.env.act_steps
            self._log(f"this checkpoint counted action chunks as env steps: {c.chunks:,} chunks, counted from "
                      f"here as {c.env_steps:,} env steps (every chunk's {self.cfg.env.act_steps} rows: an upper "
                      f"bound); its earlier metrics rows keep chunks")
        notes = self.learners.call("set_state", ckpt["learner"])
        states = ckpt.get("workers") or []
        try:
            ray.get([w.set_state.remote(s) for w, s in zip(self.workers, states)])
        except pickle.UnpicklingError as e:       # a worker's saved state names code: refused, not run
            raise UserError(f"cannot resume {self.run_dir}: {getattr(e, 'cause', e)}") from None
        truncate_metrics(self.run_dir, self.counters.iteration)
        self._log(f"resumed from iteration {self.counters.iteration} ({self.counters.env_steps:,} env steps)")
        # A longer (or shorter) run: the algorithm's schedules go on from where they stood.
        for note in notes:
            self._log(f"train.iterations {ckpt['config']['train']['iterations']} -> "
                      f"{self.cfg.train.iterations}: {note}")

    def _log(self, msg: str) -> None:
        if not self.quiet:
            print(f"[flowrl_ray] {msg}", flush=True)

    # ------------------------------------------------------------------ the loop
    def _learner_call(self, method: str, *args):
        """A learner method (on the group's ranks, see LearnerGroup.call), made again on a
        group resumed from the last checkpoint if a learner has died (ResumableLearner)."""
        return self.learning.call(method, *args)

    def checkpoint(self) -> Path | None:
        self.rollouts.drain()                    # async: let in-flight samples land first
        learner_state = self._learner_call("get_state")
        worker_states = self.workers.states()
        payload = {"trainer": vars(self.counters).copy(), "learner": learner_state,
                   "workers": worker_states, "config": self.cfg.to_dict(),
                   **self.rollouts.checkpoint_part()}
        try:
            return save_checkpoint(self.run_dir, self.counters.iteration, payload, self.cfg.runtime.keep_checkpoints)
        except OSError as e:                     # a full disk: the run goes on, the last checkpoint stands
            last = latest_checkpoint(self.run_dir)
            self._log(f"checkpoint of iteration {self.counters.iteration} not written ({e}); the newest stays "
                      f"{last.name if last is not None else 'none'}; trying again at the next one")
            return None

    def train(self) -> dict:
        cfg, c = self.cfg, self.counters
        total = cfg.train.iterations
        progress = Progress(total, f"{cfg.algorithm} {cfg.env.id}", c.iteration,
                            stream=open(os.devnull, "w") if self.quiet else None)
        recent = collections.deque(c.recent_returns, maxlen=RETURN_WINDOW)
        recent_success = collections.deque(c.recent_successes, maxlen=RETURN_WINDOW)
        last_saved = c.iteration
        if c.iteration == 0:
            self._start_vs_final("start")
        if cfg.eval.at_start and c.iteration == 0 and not any(r.get("iteration") == 0 for r in read_metrics(self.run_dir)):
            # The starting point of fine-tuning: the loaded (pretrained) policy, before any update.
            row = {"iteration": 0, "env_steps": 0, "time_s": 0.0, **self.rollouts.evaluate()}
            self.logger.log(row)
            self.gauges.update(row)
            self._log("initial policy: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                                                     if k.startswith("eval/") and isinstance(v, float)))
        progress.begin()
        while c.iteration < total:
            t0 = time.perf_counter()
            metas, refs = self.rollouts.sample()
            if not refs:
                raise TrainingError("no rollout batch arrived in this iteration")
            t_sampled = time.perf_counter()
            try:
                learner_metrics = self._learner_call("update", refs)
            except SamplesLost:      # the samples' generation died with its learner: sample again
                self._log(f"the samples of iteration {c.iteration + 1} died with their learner; sampling again")
                continue
            self.version = self.rollouts.publish()
            c.iteration += 1
            steps = sum(m.env_steps for m in metas)
            c.env_steps += steps
            c.chunks += sum(m.chunks for m in metas)
            finished = [r for m in metas for r in m.episode_returns]
            c.episodes += len(finished)
            recent.extend(finished)
            c.recent_returns = list(recent)
            recent_success.extend(s for m in metas for s in m.extra.get("successes", []))
            c.recent_successes = list(recent_success)
            dt = time.perf_counter() - t0
            c.time_s += dt
            row = {"iteration": c.iteration, "env_steps": c.env_steps, **({"chunks": c.chunks} if c.chunks else {}),
                   "time_s": round(c.time_s, 3),
                   "episode_return_mean": float(np.mean(recent)) if recent else None,
                   "episodes_this_iter": len(finished), "episodes": c.episodes,
                   "env_steps_per_s": steps / dt, "sample_time_s": t_sampled - t0,
                   "policy_version": self.version,
                   "policy_lag_mean": float(np.mean(lags := [self.version - 1 - m.policy_version for m in metas])),
                   "policy_lag_max": int(max(lags)),
                   "batches": len(refs), "worker_restarts": c.worker_restarts,
                   "learner_restarts": c.learner_restarts,
                   "dropped_batches": c.dropped_batches, **learner_metrics}
            if recent_success:
                row["success_rate"] = float(np.mean(recent_success))
            if cfg.eval.interval and (c.iteration % cfg.eval.interval == 0 or c.iteration == total):
                row.update(self.rollouts.evaluate())
                if row.get("eval/return_mean") is not None:
                    best = c.best_eval_return
                    c.best_eval_return = row["eval/return_mean"] if best is None else max(best, row["eval/return_mean"])
                self._write_analysis()
            self.logger.log(row)
            self.gauges.update(row)
            progress.update(row)
            interval = cfg.runtime.checkpoint_interval
            if interval and c.iteration % interval == 0 and c.iteration < total:
                if self.checkpoint() is not None:
                    last_saved = c.iteration
        if last_saved != c.iteration or latest_checkpoint(self.run_dir) is None:
            self.checkpoint()
        self._start_vs_final("final")
        return self._finish()

    def _start_vs_final(self, side: str) -> None:
        """eval.compare_episodes: the starting (before the first iteration) or the final policy on
        the same seeded episodes by both sampling rules; after the final one the paired gains are
        printed, drawn and kept (runtime/start_vs_final.py). A resumed run keeps its start."""
        n, deployed = self.cfg.eval.compare_episodes, self.cfg.eval.sampling
        if not n:
            return
        data = start_vs_final.read(self.run_dir) or {}
        if side == "start" and "start" in data:
            return
        if side == "final" and "start" not in data:
            self._log(f"no start evaluation in {start_vs_final.FILE}: the start-vs-final comparison is skipped")
            return
        evaluations = {}
        for rule in start_vs_final.rules(deployed):             # minutes on a laptop: a line per rule
            self._log(f"evaluating the {side} policy on {n} seeded episodes by {rule} sampling "
                      f"(eval.compare_episodes) ...")
            t0 = time.perf_counter()
            evaluations[rule] = self.rollouts.evaluate_episodes(n, rule)
            self._log(start_vs_final.evaluated_line(side, rule, evaluations[rule], time.perf_counter() - t0))
        data[side] = start_vs_final.record(evaluations)
        if side == "final":
            data.update(episodes=n, outcome=data["final"][deployed]["outcome"],
                        rules=start_vs_final.compare(data["start"], data["final"], deployed))
            for line in start_vs_final.lines(data):
                self._log(line)
            try:
                png = start_vs_final.plot(data, self.run_dir / "plots" / "start_vs_final.png")
                self.logger.log_media(png, self.counters.env_steps, "start_vs_final")
            except Exception as e:  # noqa: BLE001 - a plot must not fail a finished run
                self._log(f"could not draw start_vs_final.png: {e}")
        start_vs_final.write(self.run_dir, data)

    def _write_analysis(self) -> None:
        """Algorithms that describe their last update (FlowSAR's credit weights) get it saved
        as analysis/iter_<i>.npz and drawn into plots/."""
        algo_cls = get_algorithm(self.cfg.algorithm)
        if algo_cls.plot_analysis is Algorithm.plot_analysis:
            return
        try:
            data = self._learner_call("analysis")
            if not data:
                return
            out = self.run_dir / "analysis"
            out.mkdir(exist_ok=True)
            np.savez(out / f"iter_{self.counters.iteration:04d}.npz", **data)
            algo_cls.plot_analysis(data, self.run_dir / "plots", self.counters.iteration)
        except Exception as e:  # noqa: BLE001 - an analysis plot must not fail the run
            self._log(f"could not write the analysis: {e}")

    def _finish(self) -> dict:
        from flowrl_ray.plotting import plot_runs
        rows = read_metrics(self.run_dir)
        last = rows[-1] if rows else {}
        evals = [r["eval/return_mean"] for r in rows if r.get("eval/return_mean") is not None]
        summary = {"name": self.cfg.name, "algorithm": self.cfg.algorithm, "env": self.cfg.env.id,
                   "seed": self.cfg.seed, "iterations": self.counters.iteration,
                   "env_steps": self.counters.env_steps,
                   **({"chunks": self.counters.chunks} if self.counters.chunks else {}),
                   "time_s": round(self.counters.time_s, 2),
                   "first_episode_return_mean": next((r["episode_return_mean"] for r in rows
                                                      if r.get("episode_return_mean") is not None), None),
                   "final_episode_return_mean": last.get("episode_return_mean"),
                   "final_eval_return_mean": evals[-1] if evals else None,
                   "best_eval_return_mean": self.counters.best_eval_return,
                   **_success_summary(rows),
                   "worker_restarts": self.counters.worker_restarts,
                   "dropped_batches": self.counters.dropped_batches}
        compared = start_vs_final.read(self.run_dir)
        if compared and "rules" in compared:
            summary["start_vs_final"] = compared["rules"]
        import json
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        plots = [("episode_return_mean", "learning_curve.png")]
        if any(r.get("eval/success_rate") is not None for r in rows):      # robot tasks
            plots.append(("eval/success_rate", "success_rate.png"))
        plots += [(y, name) for y, name in get_algorithm(self.cfg.algorithm).extra_plots
                  if any(r.get(y) is not None for r in rows)]
        for y, name in plots:
            try:
                plot_runs([self.run_dir], self.run_dir / "plots" / name, y=y)
                self.logger.log_media(self.run_dir / "plots" / name, self.counters.env_steps, y)
            except Exception as e:  # noqa: BLE001 - a plot must not fail a finished run
                self._log(f"could not draw {name}: {e}")
        self.logger.log_final(summary, latest_checkpoint(self.run_dir))
        return summary

    def close(self) -> None:
        if hasattr(self, "logger"):
            self.logger.close()
        if hasattr(self, "gauges"):
            self.gauges.close()          # flowrl_run_active 0; the series expire (dashboard.py)
        self.workers.close()
        if hasattr(self, "learning"):
            self.learning.close()
        if self._started_ray:
            ray.shutdown()

    def __enter__(self) -> "Trainer":
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
