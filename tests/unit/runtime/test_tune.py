"""Ray Tune integration without Ray: search-space parsing, trial bundles and trial configs."""

from __future__ import annotations

import pytest

from flowrl_ray.config import ConfigError, load_config
from flowrl_ray.runtime.tune import parse_search_space, trial_bundles, trial_config

from conftest import REPO

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
    # a learner group: one bundle per rank, each with the rank's CPUs and GPU
    group = trial_config(PENDULUM, SWEEP_OVERRIDES, {"runtime.num_learners": 2, "runtime.learner_num_cpus": 0.5,
                                                      "runtime.num_workers": 2})
    assert trial_bundles(group) == [{"CPU": 0.01}, {"CPU": 0.5}, {"CPU": 0.5}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert trial_bundles(group, cluster_gpus=2)[1:3] == [{"CPU": 0.5, "GPU": 1.0}] * 2
