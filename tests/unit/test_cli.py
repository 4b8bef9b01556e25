"""The CLI without a run: the learning-curve area of `compare` by hand, and `train --dry-run`
(checks everything, prints the plan, starts nothing). The verbs end to end: tests/e2e/test_cli.py."""

import pytest

from conftest import REPO


def test_learning_curve_area_by_hand():
    from flowrl_ray.runtime.compare import learning_curve_area
    rows = [{"env_steps": 0, "episode_return_mean": 0.0}, {"env_steps": 10, "episode_return_mean": 10.0},
            {"env_steps": 20, "episode_return_mean": None}, {"env_steps": 30, "episode_return_mean": 10.0}]
    assert learning_curve_area(rows) == pytest.approx((50 + 200) / 30)


def test_train_dry_run_checks_everything_prints_the_plan_and_starts_nothing(tmp_path, capsys):
    from flowrl_ray.cli import main
    run = tmp_path / "run"
    assert main(["train", str(REPO / "configs/ppo/pendulum.yaml"), "--run-dir", str(run), "--dry-run",
                 "train.iterations=7"]) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing started" in out and "ppo" in out and "gym/Pendulum-v1" in out
    assert "iterations    7" in out and f"{run} (new)" in out
    assert not run.exists()                                       # no run directory, no Ray
    # a config mistake stops with the key's name, as train itself does
    assert main(["train", str(REPO / "configs/ppo/pendulum.yaml"), "--dry-run", "algo.clip_rnge=0.1"]) == 2
    assert "algo.clip_rnge" in capsys.readouterr().err
    # what the config points at is checked too: a missing SFT checkpoint
    assert main(["train", str(REPO / "configs/flow_grpo/forms_small.yaml"), "--dry-run",
                 f"algo.sft_checkpoint={tmp_path / 'none'}"]) == 2
    assert "algo.sft_checkpoint" in capsys.readouterr().err
