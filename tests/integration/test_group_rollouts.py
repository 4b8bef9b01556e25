"""Group rollouts on a real local Ray: the learner generates, scoring workers reward, the learner
updates; a scorer that dies mid-iteration is replaced and its chunk scored again. The algorithm
and env family are plugins named in the config by import path."""

import os
from pathlib import Path

import pytest
import ray

from flowrl_ray.metrics import read_metrics

from conftest import TESTS, run_trainer, train_killing
from unit.runtime.test_group_rollouts import _config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plugin_ray():
    # Ray's local workers inherit the driver's environment: that is how they import the plugins.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    os.environ["FLOWRL_TEST_CRASH_FILE"] = str(TESTS / ".crash-scorer-once")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_group_algorithm_learns_from_scoring_workers(plugin_ray, tmp_path):
    summary = run_trainer(_config(), tmp_path / "run", tensorboard=False)
    rows = read_metrics(tmp_path / "run")
    assert rows[0]["env_steps"] == 32 and rows[-1]["env_steps"] == 12 * 32   # 4 prompts x 8 samples
    assert all(r["batches"] == 2 and r["policy_lag_mean"] == 0 for r in rows)
    assert rows[-1]["token_grpo/reward_mean"] > rows[0]["token_grpo/reward_mean"]
    assert rows[-1]["eval/return_mean"] == 1.0           # greedy tokens are all right
    assert summary["worker_restarts"] == 0


def test_dead_scorer_is_replaced_and_its_chunk_rescored(plugin_ray, tmp_path):
    crash = Path(os.environ["FLOWRL_TEST_CRASH_FILE"])
    crash.write_text("die")
    try:
        summary = run_trainer(_config(), tmp_path / "run", tensorboard=False)
    finally:
        crash.unlink(missing_ok=True)
    rows = read_metrics(tmp_path / "run")
    assert summary["worker_restarts"] == 1 and summary["iterations"] == 12
    assert all(r["batches"] == 2 for r in rows)          # the lost chunk was scored again
    assert rows[-1]["env_steps"] == 12 * 32


@pytest.mark.parametrize("staleness", [1, 2])
def test_async_group_run_scores_ahead_and_trains_on_every_generation(plugin_ray, tmp_path, staleness):
    """Async mode: the next groups are generated before each update and scored during it; every
    update prepares the generation its scored samples came from (the plugin checks the tokens),
    trains on samples up to max_staleness versions old with their behaviour log-probs (the ratio
    starts away from 1), and nothing is dropped."""
    summary = run_trainer(_config(mode="async", max_staleness=staleness), tmp_path / "run", tensorboard=False)
    rows = read_metrics(tmp_path / "run")
    assert [r["policy_lag_max"] for r in rows] == [min(i, staleness) for i in range(12)]
    assert rows[0]["token_grpo/ratio_start_dev"] < 1e-6 < rows[-1]["token_grpo/ratio_start_dev"]
    assert rows[-1]["env_steps"] == 12 * 32 and all(r["batches"] == 2 for r in rows)
    assert summary["dropped_batches"] == 0
    assert rows[-1]["token_grpo/reward_mean"] > rows[0]["token_grpo/reward_mean"]
    assert rows[-1]["eval/return_mean"] == 1.0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_learner_is_survived_and_its_samples_sampled_again(plugin_ray, tmp_path, mode):
    """The learner keeps what each update needs from its generation; killed, it is resumed from
    the last checkpoint and the samples it generated are sampled again (the plugin fails the run if
    an update prepares scores of another generation)."""
    from flowrl_ray.runtime.trainer import Trainer
    trainer = Trainer(_config(mode=mode, checkpoint_interval=1), tmp_path / "run", quiet=True)
    try:
        trainer.setup()
        learner = trainer.learners.pids()[0]
        summary = train_killing(trainer, learner)
        assert learner not in trainer.learners.pids()
    finally:
        trainer.close()
    rows = read_metrics(tmp_path / "run")
    assert summary["iterations"] == 12 and rows[-1]["learner_restarts"] == 1
    assert [r["iteration"] for r in rows] == list(range(1, 13)) and all(r["batches"] == 2 for r in rows)
