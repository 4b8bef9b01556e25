"""Ray Tune on a local Ray: a 2-trial sweep, and a failed trial reported."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from flowrl_ray.config import load_config
from flowrl_ray.runtime.tune import parse_search_space, run_sweep

from conftest import PENDULUM
from unit.runtime.test_tune import SWEEP_OVERRIDES

# --------------------------------------------------------------------------- a real sweep

@pytest.mark.slow
def test_two_trial_sweep(tmp_path):
    import ray
    base_cfg = load_config(PENDULUM, SWEEP_OVERRIDES)
    space = parse_search_space(["algo.lr=1e-3,3e-4"], [], [], [], base=base_cfg)
    out = tmp_path / "sweep"
    # No Ray running: run_sweep starts a local one sized for 2 trials at once, and stops it.
    assert not ray.is_initialized()
    result = run_sweep(PENDULUM, SWEEP_OVERRIDES, space, seeds=1, num_samples=1, out_dir=out,
                       metric="episode_return_mean", mode="max", max_concurrent=0)
    assert not ray.is_initialized()

    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert sorted(float(r["algo.lr"]) for r in rows) == [3e-4, 1e-3]
    for r in rows:
        assert r["status"] == "TERMINATED", r
        assert r["seed"] == str(base_cfg.seed)
        assert math.isfinite(float(r["episode_return_mean"]))
        assert int(r["env_steps"]) == 2 * 1 * 2 * 64          # iterations x workers x envs x steps
        assert int(r["iterations"]) == 2

    best = max(rows, key=lambda r: float(r["episode_return_mean"]))
    assert result["best_metric"] == pytest.approx(float(best["episode_return_mean"]))
    assert result["trials"] == 2 and result["errored"] == 0
    assert f"algo.lr={float(best['algo.lr'])}" in result["best_overrides"]

    # best_config.yaml is a valid config (same format as a run's config.yaml) of the best trial
    best_cfg = load_config(out / "best_config.yaml")
    assert best_cfg.algo.lr == float(best["algo.lr"])
    assert best_cfg.train.iterations == 2 and best_cfg.env.max_episode_steps == 50
    # ... and the config that trial ran with, except that the trial pinned the learner's GPUs
    # to what its placement group reserved
    ran = load_config(Path(result["best_run_dir"]) / "config.yaml").to_dict()
    assert ran["runtime"].pop("learner_num_gpus") in (0.0, 1.0)
    expected = best_cfg.to_dict()
    assert expected["runtime"].pop("learner_num_gpus") is None
    assert ran == expected

    # each trial is a full run: its own run dir, metrics, checkpoint; actors inside its placement group
    pgs = set()
    for r in rows:
        run_dir = Path(r["run_dir"])
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["iteration"] for x in lines] == [1, 2]
        assert (run_dir / "checkpoints" / "latest").is_file()
        placement = json.loads((run_dir / "placement.json").read_text())
        assert placement["trial_placement_group"], placement
        assert placement["learner"] == placement["trial_placement_group"]
        assert placement["workers"] == [placement["trial_placement_group"]]
        assert placement["inside"] is True
        pgs.add(placement["trial_placement_group"])
    assert len(pgs) == 2, "each trial has its own placement group"
    assert (out / "tune").is_dir()


@pytest.mark.slow
def test_a_trial_with_a_learner_group_places_its_ranks_in_the_trials_bundles(tmp_path, local_ray):
    """num_learners 2 in a sweep: the trial reserves a bundle per rank and both ranks land in the
    trial's placement group (no group of their own), and the trial trains. On the module's local
    Ray (after the sweep above, which starts its own)."""
    overrides = [*SWEEP_OVERRIDES, "runtime.num_learners=2", "runtime.learner_num_cpus=0.5"]
    base_cfg = load_config(PENDULUM, overrides)
    space = parse_search_space(["algo.lr=1e-3"], [], [], [], base=base_cfg)
    out = tmp_path / "sweep"
    result = run_sweep(PENDULUM, overrides, space, seeds=1, num_samples=1, out_dir=out,
                       metric="episode_return_mean", mode="max", max_concurrent=0)
    assert local_ray.is_initialized()            # not ours to stop
    assert result["trials"] == 1 and result["errored"] == 0
    run_dir = Path(result["best_run_dir"])
    placement = json.loads((run_dir / "placement.json").read_text())
    assert placement["inside"] is True and len(placement["learner_ranks"]) == 2
    assert set(placement["learner_ranks"]) == {placement["trial_placement_group"]}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2] and all(math.isfinite(r["ppo/policy_loss"]) for r in rows)


@pytest.mark.slow
def test_failed_trial_is_reported(tmp_path, local_ray):
    """A trial that fails (an env id that does not exist) is a row with status ERROR and its
    error; the best trial is taken among the others. Runs on the module's local Ray."""
    base_cfg = load_config(PENDULUM, SWEEP_OVERRIDES)
    space = parse_search_space(["env.id=Pendulum-v1,NoSuchEnv-v0"], [], [], [], base=base_cfg)
    result = run_sweep(PENDULUM, SWEEP_OVERRIDES, space, seeds=1, out_dir=tmp_path / "sweep",
                       max_concurrent=1)
    assert local_ray.is_initialized()            # not ours to stop
    with open(tmp_path / "sweep" / "results.csv") as f:
        rows = {r["env.id"]: r for r in csv.DictReader(f)}
    assert rows["NoSuchEnv-v0"]["status"] == "ERROR"
    assert "NoSuchEnv-v0" in rows["NoSuchEnv-v0"]["error"]
    assert rows["NoSuchEnv-v0"]["episode_return_mean"] == ""
    assert rows["Pendulum-v1"]["status"] == "TERMINATED"
    assert result["errored"] == 1 and result["trials"] == 2
    assert "env.id=Pendulum-v1" in result["best_overrides"]
    assert (tmp_path / "sweep" / "tune" / rows["Pendulum-v1"]["trial_id"]).is_dir()
