"""Ray Tune integration: search-space parsing (no Ray) and a 2-trial sweep on a local Ray."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from flowrl_ray.config import ConfigError, load_config
from flowrl_ray.runtime.tune import parse_search_space, run_sweep, trial_bundles, trial_config

REPO = Path(__file__).resolve().parents[1]
PENDULUM = REPO / "configs" / "ppo" / "pendulum.yaml"
# Short episodes (50 steps) so that the first iteration already ends episodes and every trial
# reports episode_return_mean.
SWEEP_OVERRIDES = ["train.iterations=2", "runtime.num_workers=1", "runtime.envs_per_worker=2",
                   "runtime.rollout_length=64", "algo.minibatch_size=64", "algo.epochs=2",
                   "eval.interval=0", "env.max_episode_steps=50"]


@pytest.fixture(scope="module")
def base():
    return load_config(PENDULUM, SWEEP_OVERRIDES)


def _space(base, grid=(), choice=(), uniform=(), loguniform=()):
    return parse_search_space(list(grid), list(choice), list(uniform), list(loguniform), base=base)


# --------------------------------------------------------------------------- parsing, no Ray

def test_search_objects(base):
    from ray import tune
    space = _space(base, grid=["algo.lr=1e-3,3e-4"], choice=["algo.hidden_sizes=[32,32],[64,64]"],
                   uniform=["algo.clip=0.1,0.3"], loguniform=["algo.ent_coef=1e-4,1e-2"])
    assert space["algo.lr"] == {"grid_search": [1e-3, 3e-4]}       # YAML scalars: 1e-3 is a float
    assert isinstance(space["algo.hidden_sizes"], tune.search.sample.Categorical)
    assert space["algo.hidden_sizes"].categories == [[32, 32], [64, 64]]   # brackets keep lists whole
    assert isinstance(space["algo.clip"], tune.search.sample.Float)
    assert (space["algo.clip"].lower, space["algo.clip"].upper) == (0.1, 0.3)
    assert (space["algo.ent_coef"].lower, space["algo.ent_coef"].upper) == (1e-4, 1e-2)


def test_misspelled_key_names_key_and_closest_before_ray_starts(base):
    import ray
    assert not ray.is_initialized()
    with pytest.raises(ConfigError) as e:
        _space(base, grid=["algo.lrr=1e-3,3e-4"])
    assert "algo.lrr" in str(e.value) and "did you mean 'algo.lr'" in str(e.value)
    with pytest.raises(ConfigError, match="runtime.num_wrkers.*runtime.num_workers"):
        _space(base, choice=["runtime.num_wrkers=1,2"])
    assert not ray.is_initialized()


def test_cli_tune_typo_exits_2_without_starting_ray(capsys):
    import ray

    from flowrl_ray.cli import main
    rc = main(["tune", str(PENDULUM), *SWEEP_OVERRIDES, "--grid", "algo.lrr=1e-3,3e-4"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "algo.lrr" in err and "algo.lr" in err
    assert not ray.is_initialized()


@pytest.mark.parametrize("flag,text,message", [
    ("grid", "algo.lr=1e-3,-1", "algo.lr': must be > 0"),                 # every value is checked
    ("uniform", "algo.epochs=1,10", "algo.epochs': expected int"),        # floats into an int key
    ("uniform", "algo.clip=0.3,0.1", "LO must be smaller"),
    ("loguniform", "algo.lr=0,1e-3", "must be > 0"),
    ("uniform", "algo.clip=0.1", "two numbers"),
    ("choice", "algo.activation=tanh,gelu", "algo.activation': must be one of"),
    ("grid", "seed=1,2", "--seeds"),
    ("grid", "algo.lr", "KEY=V1,V2"),
])
def test_bad_sweep_values(base, flag, text, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        _space(base, **{flag: [text]})


def test_same_key_twice(base):
    with pytest.raises(ConfigError, match="swept twice"):
        _space(base, grid=["algo.lr=1e-3"], choice=["algo.lr=3e-4"])


def test_trial_bundles_and_config(base):
    cfg = trial_config(PENDULUM, SWEEP_OVERRIDES, {"algo.lr": 5e-4, "seed": 3, "runtime.num_workers": 2})
    assert (cfg.algo.lr, cfg.seed, cfg.runtime.num_workers) == (5e-4, 3, 2)
    assert trial_bundles(cfg) == [{"CPU": 0.01}, {"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    # with a GPU in the cluster the learner's bundle reserves it (learner_num_gpus: null)
    assert trial_bundles(cfg, cluster_gpus=1)[1] == {"CPU": 1.0, "GPU": 1.0}


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
