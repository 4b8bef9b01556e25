"""Ray Tune integration: sweep config keys (grid or random) over several seeds.

Each trial is a full :class:`flowrl_ray.runtime.trainer.Trainer` run inside a function
trainable. The trial reserves one placement group::

    [{"CPU": 0.01}]                  the trial's own driver (the function trainable)
    + [{"CPU": learner_num_cpus, "GPU": learner gpus}] * num_learners
    + [{"CPU": num_cpus_per_worker, "GPU": num_gpus_per_worker}] * num_workers

and the Trainer's learner ranks and rollout actors land inside it, because Tune starts trials with
``placement_group_capture_child_tasks=True`` (each trial records where its actors went in
``placement.json``); a learner group then uses the trial's bundles instead of a placement group of
its own (``runtime.learner_placement`` does not apply inside a trial). Per-iteration metrics reach Tune through the Trainer's MetricsLogger
(``tune_trial=True``). With a `logging.wandb` / `logging.mlflow` section, Tune's own W&B and
MLflow callbacks make each trial one tracked run (steps: training iterations); the trials'
Trainers open no run of their own.

Layout of the output directory::

    out_dir/tune/            Tune's experiment directory (out_dir/tune/<trial id>: Tune's results)
    out_dir/trials/<id>/     each trial's run directory (config.yaml, metrics.jsonl, checkpoints)
    out_dir/results.csv      one row per trial
    out_dir/best_config.yaml the best trial's resolved config (same format as a run's config.yaml)

On a multi-node cluster ``out_dir`` must be on storage every node sees (NFS, /mnt/shared_storage),
as Tune requires for a local ``storage_path``.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import itertools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from flowrl_ray.config import (Config, ConfigError, apply_overrides, config_from_dict, load_config,
                               parse_override, read_yaml, save_config)
from flowrl_ray.errors import TrainingError

TRIAL_DRIVER_CPU = 0.01          # the function trainable itself only waits on actors
SWEEP_FLAGS = ("grid", "choice", "uniform", "loguniform")


# --------------------------------------------------------------------------- search space

def _split_values(text: str) -> list[str]:
    """Split `V1,V2,...` on commas outside brackets, so list values like `[64,64],[256,256]`
    stay whole."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.strip() for p in parts]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_key(base: dict, key: str, value: Any, flag: str, text: str) -> None:
    """Apply `key=value` to the base config dict and build a Config: an unknown key, a wrong
    type or an out-of-range value raises ConfigError here, before Ray starts."""
    data = _with_params(base, {key: value})
    try:
        config_from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"--{flag} {text!r}: {e}") from None


def parse_search_space(grid: list[str], choice: list[str], uniform: list[str],
                       loguniform: list[str], base: Config) -> dict:
    """Parse the CLI's sweep flags into {dotted key: ray.tune search object}.

    grid/choice take `KEY=V1,V2,...`; uniform/loguniform take `KEY=LO,HI`. Values are read like
    YAML scalars (`1e-3` is a float, `[64,64]` a list). Every value (for the ranges: both ends and
    the middle) is applied to `base` and validated, so a typo or an impossible value raises
    ConfigError naming the key before any Ray process starts.
    """
    base_dict = base.to_dict()
    parsed: dict[str, tuple[str, list]] = {}
    for flag, entries in zip(SWEEP_FLAGS, (grid, choice, uniform, loguniform)):
        for text in entries or []:
            if "=" not in text:
                raise ConfigError(f"--{flag} {text!r}: expected KEY=V1,V2")
            key, raw = (s.strip() for s in text.split("=", 1))
            if not key:
                raise ConfigError(f"--{flag} {text!r}: empty key")
            if key == "seed":
                raise ConfigError(f"--{flag} {text!r}: use --seeds N to repeat over seeds")
            if key in parsed:
                raise ConfigError(f"--{flag} {text!r}: config key '{key}' is swept twice")
            raws = _split_values(raw)
            if any(r == "" for r in raws):
                raise ConfigError(f"--{flag} {text!r}: empty value")
            # The same YAML reading as `key=value` overrides.
            values = [parse_override(f"{key}={r}")[1] for r in raws]
            if flag in ("uniform", "loguniform"):
                if len(values) != 2 or not all(_is_number(v) for v in values):
                    raise ConfigError(f"--{flag} {text!r}: expected KEY=LO,HI with two numbers")
                lo, hi = float(values[0]), float(values[1])
                if not lo < hi:
                    raise ConfigError(f"--{flag} {text!r}: LO must be smaller than HI")
                if flag == "loguniform" and lo <= 0:
                    raise ConfigError(f"--{flag} {text!r}: LO must be > 0 for a log-uniform range")
                mid = math.sqrt(lo * hi) if flag == "loguniform" else (lo + hi) / 2
                # floats, as Tune samples them: an int-typed key fails here, not in trial 7
                for v in (lo, hi, mid):
                    _check_key(base_dict, key, v, flag, text)
                values = [lo, hi]
            else:
                for v in values:
                    _check_key(base_dict, key, v, flag, text)
            parsed[key] = (flag, values)

    from ray import tune     # after validation: a typo costs no Ray import
    space = {}
    for key, (flag, values) in parsed.items():
        if flag == "grid":
            space[key] = tune.grid_search(values)
        elif flag == "choice":
            space[key] = tune.choice(values)
        elif flag == "uniform":
            space[key] = tune.uniform(*values)
        else:
            space[key] = tune.loguniform(*values)
    return space


# --------------------------------------------------------------------------- trial configs

def _plain(value: Any) -> Any:
    """numpy scalars (from samplers) -> Python scalars, so the typed config accepts them."""
    return value.item() if hasattr(value, "item") and not isinstance(value, (list, dict)) else value


def _with_params(data: dict, params: dict) -> dict:
    """A copy of a config dict with dotted `params` set (values already parsed)."""
    data = copy.deepcopy(data)
    for key, value in params.items():
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"config key '{key}': '{part}' is not a section")
            node = child
        node[parts[-1]] = _plain(value)
    return data


def trial_config(config_path: str | os.PathLike, overrides: list[str], params: dict) -> Config:
    """The resolved Config of one trial: YAML file + fixed overrides + the trial's sampled
    values (`params`: dotted key -> value, including `seed`)."""
    data = apply_overrides(read_yaml(config_path), list(overrides or []))
    return config_from_dict(_with_params(data, params))


def _format_override(key: str, value: Any) -> str:
    """`key=value` text that `flowrl-ray train ... key=value` reads back to the same value."""
    value = _plain(value)
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


def trial_bundles(cfg: Config, cluster_gpus: float = 0.0) -> list[dict]:
    """Placement group bundles for one trial: its driver, each learner rank, one per rollout worker."""
    from flowrl_ray.runtime.cluster import learner_gpus
    rt = cfg.runtime

    def bundle(cpu: float, gpu: float) -> dict:
        # Zero entries are left out (a bundle may not request 0 of a resource).
        return {k: v for k, v in (("CPU", float(cpu)), ("GPU", float(gpu))) if v > 0}

    bundles = [bundle(TRIAL_DRIVER_CPU, 0)]
    bundles += [bundle(rt.learner_num_cpus, learner_gpus(cfg, cluster_gpus)) for _ in range(rt.num_learners)]
    bundles += [bundle(rt.num_cpus_per_worker, rt.num_gpus_per_worker) for _ in range(rt.num_workers)]
    return [b for b in bundles if b]


def _domain_values(domain: Any) -> list:
    """Representative values of a search object (for sizing a local Ray)."""
    if isinstance(domain, dict) and "grid_search" in domain:
        return list(domain["grid_search"])
    if hasattr(domain, "categories"):
        return list(domain.categories)
    if hasattr(domain, "lower") and hasattr(domain, "upper"):
        return [domain.lower, domain.upper]
    return [domain]


def _largest_trial_cpus(config_path: Path, overrides: list[str], space: dict) -> float:
    """CPUs of the largest trial: sweeping a runtime.* key changes a trial's size."""
    runtime_keys = [k for k in space if k.startswith("runtime.")]
    combos = itertools.product(*(_domain_values(space[k]) for k in runtime_keys)) if runtime_keys else [()]
    best = 0.0
    for combo in combos:
        cfg = trial_config(config_path, overrides, dict(zip(runtime_keys, combo)))
        best = max(best, sum(b.get("CPU", 0.0) for b in trial_bundles(cfg)))
    return best


def _count_trials(space: dict, seeds: int, num_samples: int) -> int:
    n = seeds * num_samples
    for domain in space.values():
        if isinstance(domain, dict) and "grid_search" in domain:
            n *= len(domain["grid_search"])
    return n


# --------------------------------------------------------------------------- the trial

def _placement_group_id(_actor_self) -> str | None:
    """Runs inside an actor (via __ray_call__): the placement group it was scheduled in."""
    import ray
    return ray.get_runtime_context().get_placement_group_id()


def _record_placement(trainer, run_dir: Path) -> dict:
    """Write run_dir/placement.json: the trial's placement group and each actor's."""
    import ray
    pg = ray.util.get_current_placement_group()
    trial_pg = pg.id.hex() if pg is not None else None
    learner_pgs = ray.get([a.__ray_call__.remote(_placement_group_id) for a in trainer.learners.actors])
    worker_pgs = ray.get([w.__ray_call__.remote(_placement_group_id) for w in trainer.workers])
    info = {"trial_placement_group": trial_pg, "learner": learner_pgs[0], "learner_ranks": learner_pgs,
            "workers": worker_pgs,
            "inside": trial_pg is not None and all(p == trial_pg for p in [*learner_pgs, *worker_pgs])}
    (run_dir / "placement.json").write_text(json.dumps(info, indent=2) + "\n")
    if not info["inside"]:
        print(f"[flowrl_ray] warning: trial actors are not all in the trial's placement group: {info}",
              file=sys.stderr, flush=True)
    return info


def _trial_dirname(trial) -> str:
    return trial.trial_id


def _run_trial(config: dict, config_path: str, overrides: list[str], trials_dir: str,
               cluster_gpus: float) -> None:
    """Tune function trainable: one full training run; metrics go to Tune every iteration."""
    from ray import tune

    from flowrl_ray.runtime.cluster import learner_gpus
    from flowrl_ray.runtime.trainer import Trainer

    cfg = trial_config(config_path, overrides, config)
    if cfg.runtime.learner_num_gpus is None:
        # Pin what the placement group reserved, so the learner's request fits its bundle.
        cfg.runtime.learner_num_gpus = learner_gpus(cfg, cluster_gpus)
    run_dir = Path(trials_dir) / tune.get_context().get_trial_id()
    trainer = Trainer(cfg, run_dir, tune_trial=True, quiet=True)
    try:
        trainer.setup()
        _record_placement(trainer, run_dir)
        trainer.train()
    finally:
        trainer.close()


# --------------------------------------------------------------------------- the sweep

def run_sweep(config_path: str | os.PathLike, overrides: list[str], space: dict, seeds: int = 1,
              num_samples: int = 1, out_dir: str | os.PathLike = "runs/tune",
              metric: str = "episode_return_mean", mode: str = "max", max_concurrent: int = 0) -> dict:
    """Run the sweep; write results.csv and best_config.yaml; return a short summary."""
    import ray
    from ray import tune

    from flowrl_ray.runtime.cluster import cluster_gpus as reachable_gpus
    from flowrl_ray.runtime.cluster import init_ray

    if seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    if num_samples < 1:
        raise ConfigError(f"--num-samples must be >= 1, got {num_samples}")
    if mode not in ("max", "min"):
        raise ConfigError(f"--mode must be 'max' or 'min', got {mode!r}")
    # Trials run in other processes with their own working directory: absolute paths only.
    config_path = Path(config_path).resolve()
    overrides = list(overrides or [])
    out_dir = Path(out_dir).resolve()
    base = load_config(config_path, overrides)
    from flowrl_ray.runtime.tracking import preflight, tune_callbacks
    preflight(base.logging)               # an unreachable tracking server stops here, before Ray
    out_dir.mkdir(parents=True, exist_ok=True)
    trials_dir = out_dir / "trials"

    swept = list(space)
    param_space = dict(space)
    param_space["seed"] = tune.grid_search([base.seed + i for i in range(seeds)])

    # A local Ray gets room for `max_concurrent` trials (2 when unlimited) of the largest size.
    n_trials = _count_trials(space, seeds, num_samples)
    concurrent = min(max_concurrent or 2, n_trials) if n_trials else (max_concurrent or 2)
    need = math.ceil(concurrent * _largest_trial_cpus(config_path, overrides, space) - 1e-9)
    sizing = dataclasses.replace(base, runtime=dataclasses.replace(
        base.runtime, num_cpus=max(base.runtime.num_cpus or os.cpu_count() or 1, need)))
    started = init_ray(sizing)
    try:
        cluster_gpus = reachable_gpus()

        def resources(trial_params: dict):
            cfg = trial_config(config_path, overrides, trial_params)
            return tune.PlacementGroupFactory(trial_bundles(cfg, cluster_gpus))

        trainable = tune.with_parameters(_run_trial, config_path=str(config_path), overrides=overrides,
                                         trials_dir=str(trials_dir), cluster_gpus=cluster_gpus)
        trainable = tune.with_resources(trainable, resources)
        callbacks, tracking_env = tune_callbacks(base, out_dir)
        tuner = tune.Tuner(
            trainable, param_space=param_space,
            tune_config=tune.TuneConfig(metric=metric, mode=mode, num_samples=num_samples,
                                        max_concurrent_trials=max_concurrent or None,
                                        # out_dir/tune/<id> next to out_dir/trials/<id>
                                        trial_dirname_creator=_trial_dirname),
            run_config=tune.RunConfig(storage_path=str(out_dir), name="tune", callbacks=callbacks))
        # The first iterations of a run may end no episode, so `episode_return_mean` is absent
        # from them; Tune's strict check would fail such a trial. The metric is checked below.
        env = {"TUNE_DISABLE_STRICT_METRIC_CHECKING": "1", **tracking_env}
        previous = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            grid = tuner.fit()
        finally:
            for k, v in previous.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        if started:
            ray.shutdown()
    return _write_results(grid, swept, config_path, overrides, out_dir, trials_dir, metric, mode)


def _final_metric(result, metric: str) -> float | None:
    value = (result.metrics or {}).get(metric)
    return float(value) if _is_number(value) and math.isfinite(value) else None


def _write_results(grid, swept: list[str], config_path: Path, overrides: list[str], out_dir: Path,
                   trials_dir: Path, metric: str, mode: str) -> dict:
    rows = []
    for result in grid:
        m = result.metrics or {}
        trial_id = m.get("trial_id") or Path(result.path).name     # a trial that never reported
        rows.append({"trial_id": trial_id, "status": "ERROR" if result.error else "TERMINATED",
                     **{k: result.config.get(k) for k in swept}, "seed": result.config.get("seed"),
                     metric: _final_metric(result, metric), "env_steps": m.get("env_steps"),
                     "iterations": m.get("iteration"), "run_dir": str(trials_dir / trial_id),
                     "error": str(result.error).strip().splitlines()[-1] if result.error else "",
                     "_params": {k: result.config.get(k) for k in [*swept, "seed"]}})
    results_csv = out_dir / "results.csv"
    fields = [k for k in rows[0] if k != "_params"] if rows else ["trial_id", "status", metric]
    with open(results_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items() if k != "_params"})

    scored = [r for r in rows if r[metric] is not None]
    if not scored:
        errors = [r["error"] for r in rows if r["error"]]
        if rows and len(errors) == len(rows):
            raise TrainingError(f"all {len(rows)} trials failed; first error: {errors[0]} "
                               f"(see {out_dir / 'tune'})")
        reported = sorted({k for result in grid for k in (result.metrics or {})})
        raise ConfigError(f"--metric {metric!r}: no trial reported a finite value (results in "
                          f"{results_csv}); reported keys: {', '.join(reported)}")
    best = (max if mode == "max" else min)(scored, key=lambda r: r[metric])
    best_overrides = [_format_override(k, v) for k, v in best["_params"].items()]
    best_cfg = trial_config(config_path, overrides, best["_params"])
    best_yaml = out_dir / "best_config.yaml"
    save_config(best_cfg, best_yaml)
    return {"metric": metric, "mode": mode, "best_metric": best[metric],
            "best_overrides": best_overrides, "best_trial": best["trial_id"],
            "best_run_dir": best["run_dir"], "trials": len(rows),
            "errored": sum(r["status"] == "ERROR" for r in rows),
            "results_csv": str(results_csv), "best_config": str(best_yaml),
            "tune_dir": str(out_dir / "tune")}
