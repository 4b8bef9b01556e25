"""The learner group on a real local Ray with gloo: two learner ranks give the weights one learner
gives on the same batches, every rank holds the same weights, a two-rank run resumes exactly, and
a killed rank is survived."""

import shutil
import time

import pytest
import ray
import torch

from flowrl_ray.checkpoint import latest_checkpoint, load_checkpoint
from flowrl_ray.metrics import read_metrics
from flowrl_ray.runtime.trainer import Trainer

from conftest import run_trainer, tiny_config, train_killing

pytestmark = pytest.mark.slow

# 2 workers x 2 envs x 64 steps = 256 rows per iteration: minibatches of 64, 2 epochs
TWO = ("runtime.num_learners=2", "runtime.learner_num_cpus=0.5")


def _final_policy(run_dir) -> dict:
    return load_checkpoint(latest_checkpoint(run_dir))["policy"]


def test_two_learner_ranks_update_as_one_learner(local_ray, tmp_path):
    one = run_trainer(tiny_config("train.iterations=2"), tmp_path / "one")
    trainer = Trainer(tiny_config("train.iterations=2", *TWO), tmp_path / "two", quiet=True)
    try:
        trainer.setup()
        two = trainer.train()
        assert trainer.learners.size == 2 and len(set(trainer.learners.pids())) == 2
        ranks = [ray.get(a.policy_weights.remote()) for a in trainer.learners.actors]
    finally:
        trainer.close()
    for k, v in ranks[0].items():                          # every rank holds the same weights
        assert torch.equal(v, ranks[1][k]), k
    a, b = _final_policy(tmp_path / "one"), _final_policy(tmp_path / "two")
    for k in a:                                            # the sum of the shares is the one-learner step
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)
    rows_one, rows_two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for key in ("ppo/policy_loss", "ppo/value_loss", "ppo/approx_kl", "ppo/clip_fraction", "ppo/grad_norm"):
        # statistics of the whole minibatch, reduced over the ranks
        assert rows_two[-1][key] == pytest.approx(rows_one[-1][key], rel=1e-3, abs=1e-6), key
    assert (one["iterations"], two["iterations"]) == (2, 2)
    # the second iteration sampled with the same weights: the same batch, to float precision
    assert rows_two[-1]["ppo/advantage_mean"] == pytest.approx(rows_one[-1]["ppo/advantage_mean"], rel=1e-3)


def test_a_two_rank_run_resumes_exactly_and_with_another_number_of_learners(local_ray, tmp_path):
    cfg = ("runtime.checkpoint_interval=1", "algo.lr_schedule=constant", *TWO)   # constant: a longer run changes no lr
    run_trainer(tiny_config("train.iterations=3", *cfg), tmp_path / "whole")
    run_trainer(tiny_config("train.iterations=2", *cfg), tmp_path / "parts")
    shutil.copytree(tmp_path / "parts", tmp_path / "parts_one")
    run_trainer(tiny_config("train.iterations=3", *cfg), tmp_path / "parts", resume=True)
    a, b = _final_policy(tmp_path / "whole"), _final_policy(tmp_path / "parts")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the same checkpoint resumed by one learner: the same iteration 3 up to float reordering
    one = tuple(x for x in cfg if x not in TWO)
    run_trainer(tiny_config("train.iterations=3", *one), tmp_path / "parts_one", resume=True)
    c = _final_policy(tmp_path / "parts_one")
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


def test_a_killed_rank_is_survived_from_the_last_checkpoint(local_ray, tmp_path):
    cfg = tiny_config("train.iterations=4", "runtime.checkpoint_interval=1", *TWO)
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.setup()
        rank1 = trainer.learners.pids()[1]
        summary = train_killing(trainer, rank1)
        assert rank1 not in trainer.learners.pids()         # a new group
    finally:
        trainer.close()
    rows = read_metrics(tmp_path / "run")
    assert summary["iterations"] == 4 and rows[-1]["learner_restarts"] == 1
    assert rows[-1]["policy_version"] >= 3


def test_a_fed_grpo_run_samples_and_trains_on_two_ranks(local_ray, tmp_path):
    from flowrl_ray.config import config_from_dict
    from unit.algorithms.test_fed_grpo import _config
    data = _config(sample_group_size=4, train_micro_batch_size=4)
    data["runtime"].update(num_learners=2, learner_num_cpus=0.5, num_cpus_per_worker=0.5)
    trainer = Trainer(config_from_dict(data), tmp_path / "run", quiet=True)
    try:
        trainer.setup()
        summary = trainer.train()
        weights = [ray.get(a.get_state.remote())["algorithm"]["model"] for a in trainer.learners.actors]
    finally:
        trainer.close()
    assert summary["iterations"] == 2
    for k, v in weights[0].items():                        # every rank holds the same model
        assert torch.equal(v, weights[1][k]), k
    rows = read_metrics(tmp_path / "run")
    for row in rows[1:]:
        # the 12 molecules of both ranks were scored and summarised (none left unscored)
        assert sum(v for k, v in row.items() if k.startswith("reason/")) == pytest.approx(1.0)
        assert row.get("reason/not_scored", 0.0) == 0.0
        assert row["fed_grpo/skipped_updates"] == 0 and row["fed_grpo/ratio_min"] > 0
    assert "eval/validity" in rows[0] and "eval/validity" in rows[-1]


def _group_config(*overrides):
    cfg = tiny_config(*TWO, *overrides)
    from flowrl_ray.envs import EnvSpec
    return cfg, EnvSpec((3,), 1)


def _no_group_left(before_pgs: set) -> None:
    """Every placement group made since ``before_pgs`` is removed and no Learner actor lives."""
    from ray._private.state import actors as actor_table
    from ray.util import placement_group_table
    new = {k: v for k, v in placement_group_table().items() if k not in before_pgs}
    assert new and all(v["state"] == "REMOVED" for v in new.values())
    deadline = time.time() + 30
    while any(a["ActorClassName"] == "Learner" and a["State"] != "DEAD" for a in actor_table().values()):
        assert time.time() < deadline, "a Learner actor outlived its group"
        time.sleep(0.2)


def test_a_group_the_cluster_cannot_place_fails_naming_the_key_and_leaves_nothing(local_ray, tmp_path):
    from flowrl_ray.errors import TrainingError
    from flowrl_ray.runtime.learner_group import LearnerGroup
    from ray.util import placement_group_table
    before = set(placement_group_table())
    cfg, spec = _group_config("runtime.learner_num_cpus=3", "runtime.sample_timeout_s=3")   # 2 x 3 CPUs of 4
    with pytest.raises(TrainingError, match=r"runtime\.num_learners: the cluster cannot place 2 learners"):
        LearnerGroup(cfg, spec)
    _no_group_left(before)


def test_a_group_whose_rank_fails_to_start_removes_its_actors_and_placement(local_ray, tmp_path):
    from ray.exceptions import RayActorError
    from flowrl_ray.runtime.learner_group import LearnerGroup
    from ray.util import placement_group_table
    before = set(placement_group_table())
    cfg, _ = _group_config()
    with pytest.raises(RayActorError):
        LearnerGroup(cfg, None)                  # every rank's algorithm fails to build (no env spec)
    _no_group_left(before)
