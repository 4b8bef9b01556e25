"""The Ray runtime on a real local cluster: weight sync, a killed worker, exact resume, async mode."""

import json
import os
import shutil
import signal
import threading
import time

import pytest
import ray
import torch

from flowrl_ray.checkpoint import latest_checkpoint, load_checkpoint
from flowrl_ray.metrics import read_metrics
from flowrl_ray.runtime.trainer import Trainer

from conftest import REPO, TINY_RUNTIME, run_trainer, tiny_config, train_killing

pytestmark = pytest.mark.slow


def test_weights_reach_every_worker_with_their_version_and_the_run_directory_contents(local_ray, tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(tiny_config("eval.interval=2", "eval.episodes=3", "runtime.checkpoint_interval=2",
                                  "train.iterations=4"), run, quiet=True)
    try:
        trainer.setup()
        summary = trainer.train()
        learner_policy = ray.get(trainer.learner.policy_weights.remote())
        assert trainer.version == 4
        for w in trainer.workers:
            assert ray.get(w.policy_version.remote()) == 4
            worker_policy = ray.get(w.policy_state.remote())
            for k, v in learner_policy.items():
                assert torch.equal(v, worker_policy[k]), k
    finally:
        trainer.close()
    rows = read_metrics(run)
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert all(r["policy_lag_mean"] == 0 for r in rows)      # sync mode: on-policy batches
    assert all(r["batches"] == 2 for r in rows)
    # the run directory
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    for key in ("iteration", "env_steps", "episode_return_mean", "time_s", "ppo/policy_loss",
                "ppo/value_loss", "ppo/approx_kl", "worker_restarts", "dropped_batches"):
        assert key in rows[-1], key
    assert rows[-1]["env_steps"] == 4 * 2 * 2 * 64
    assert "eval/return_mean" in rows[1] and "eval/return_mean" not in rows[0]
    assert (run / "config.yaml").is_file() and (run / "plots" / "learning_curve.png").stat().st_size > 1000
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*.pt")) == ["iter_000002.pt", "iter_000004.pt"]
    assert not list((run / "checkpoints").glob("*.tmp"))
    assert json.loads((run / "summary.json").read_text())["iterations"] == summary["iterations"] == 4


def test_the_periodic_evaluation_is_flowrl_ray_eval_of_its_checkpoint(local_ray, tmp_path, capsys):
    """The run's last evaluation (two workers, each its share of the evaluation envs) and
    `flowrl-ray eval` of the checkpoint written at that iteration, same episodes and rule: the
    same returns (the workers' seeds and env counts play no part). By random sampling here; by
    zero sampling (the default) in the start-vs-final test below."""
    from flowrl_ray.cli import main
    sampling = "random"
    cfg = tiny_config("train.iterations=2", "eval.interval=2", "eval.episodes=5", "eval.at_start=false",
                      f"eval.sampling={sampling}", "env.max_episode_steps=50")
    run = tmp_path / "run"
    run_trainer(cfg, run)
    row = next(r for r in read_metrics(run) if r.get("iteration") == 2)
    assert row["eval/episodes"] == 5
    assert main(["eval", str(run), "--episodes", "5", "--sampling", sampling]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["return_mean"] == pytest.approx(row["eval/return_mean"], rel=1e-6)
    assert out["return_std"] == pytest.approx(row["eval/return_std"], rel=1e-5)


def test_start_vs_final_plays_flowrl_ray_evals_episodes_with_both_policies(local_ray, tmp_path, capsys):
    """eval.compare_episodes: the initial policy before the first iteration and the final one after
    the last, on the same seeded episodes by both rules; the final side is `flowrl-ray eval` of the
    last checkpoint, the start side the initial policy's evaluation (eval.at_start, same episodes)."""
    from flowrl_ray.cli import main
    cfg = tiny_config("train.iterations=2", "eval.compare_episodes=4", "eval.at_start=true", "eval.interval=2",
                      "eval.episodes=4", "env.max_episode_steps=30")
    run = tmp_path / "run"
    summary = run_trainer(cfg, run, quiet=False)
    out = capsys.readouterr().out
    data = json.loads((run / "start_vs_final.json").read_text())
    assert data["outcome"] == "return" and list(data["rules"]) == ["zero", "random"]
    assert data["start"]["zero"]["keys"] == [[0, 0], [1, 0], [2, 0], [3, 0]]
    first = next(r for r in read_metrics(run) if r["iteration"] == 0)
    assert sum(data["start"]["zero"]["values"]) / 4 == pytest.approx(first["eval/return_mean"], rel=1e-6)
    last = next(r for r in read_metrics(run) if r["iteration"] == 2)     # periodic, zero sampling
    for rule in ("zero", "random"):
        assert main(["eval", str(run), "--episodes", "4", "--sampling", rule]) == 0
        standalone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        if rule == "zero":      # the periodic evaluation is `flowrl-ray eval` of its checkpoint
            assert standalone["return_mean"] == pytest.approx(last["eval/return_mean"], rel=1e-6)
            assert standalone["return_std"] == pytest.approx(last["eval/return_std"], rel=1e-5)
        r = data["rules"][rule]
        assert standalone["return_mean"] == pytest.approx(r["final"], rel=1e-6)
        assert r["gain"] == pytest.approx(r["final"] - r["start"]) and r["ci_low"] <= r["gain"] <= r["ci_high"]
    assert summary["start_vs_final"] == data["rules"]
    assert "start vs final on the same 4 seeded episodes" in out and "  zero sampling (deployed): " in out
    assert (run / "plots" / "start_vs_final.png").is_file()


def test_killed_worker_is_restarted_and_the_run_finishes(local_ray, tmp_path):
    cfg = tiny_config("train.iterations=4", "runtime.rollout_length=400", "runtime.max_worker_restarts=2")
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.setup()
        victim = ray.get(trainer.workers[1].pid.remote())

        def kill_during_second_iteration():
            while trainer.counters.iteration < 1:
                time.sleep(0.01)
            time.sleep(0.05)                       # the second iteration's sampling is under way
            os.kill(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_during_second_iteration, daemon=True)
        killer.start()
        summary = trainer.train()
        killer.join(timeout=5)
        new_pid = ray.get(trainer.workers[1].pid.remote())
    finally:
        trainer.close()
    assert summary["iterations"] == 4 and summary["worker_restarts"] == 1
    assert new_pid != victim
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["worker_restarts"] == 1
    # the iteration hit by the failure went on with the batch that did arrive
    assert min(r["batches"] for r in rows) == 1 and rows[-1]["batches"] == 2


def test_restart_budget_spent_stops_the_run(local_ray, tmp_path):
    from flowrl_ray.runtime.trainer import TrainingError
    cfg = tiny_config("train.iterations=3", "runtime.max_worker_restarts=0")
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.setup()
        os.kill(ray.get(trainer.workers[0].pid.remote()), signal.SIGKILL)
        with pytest.raises(TrainingError, match="max_worker_restarts"):
            trainer.train()
    finally:
        trainer.close()


def _resume_config(algorithm: str):
    resume = ["train.iterations=3", "runtime.checkpoint_interval=2", "eval.interval=3"]
    if algorithm == "ppo":
        return tiny_config(*resume)
    from flowrl_ray.config import load_config
    # history_size 2: the checkpoint at iteration 2 holds a full history that iteration 3 reuses.
    return load_config(REPO / "configs" / "cma_ppo" / "pendulum.yaml",
                       TINY_RUNTIME + resume + ["algo.minibatch_size=64", "algo.epochs=2", "algo.history_size=2",
                                                "algo.hidden_sizes=[16, 16]", "algo.mirror_sampling=resample"])


@pytest.mark.parametrize("algorithm", ["ppo", "cma_ppo"])
def test_resume_gives_the_same_next_iteration_as_an_uninterrupted_run(local_ray, tmp_path, algorithm):
    cfg = _resume_config(algorithm)
    full = tmp_path / "full"
    run_trainer(cfg, full)
    # An interrupted run is one that stopped right after its iteration-2 checkpoint.
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "config.yaml", part / "config.yaml")
    shutil.copy(full / "metrics.jsonl", part / "metrics.jsonl")
    shutil.copy(full / "checkpoints" / "iter_000002.pt", part / "checkpoints" / "iter_000002.pt")
    run_trainer(cfg, part, resume=True)
    a, b = read_metrics(full), read_metrics(part)
    assert [r["iteration"] for r in b] == [1, 2, 3]
    skip = {"time_s", "env_steps_per_s", "sample_time_s", "learner/update_time_s", "learner/fetch_time_s"}
    for key, value in a[2].items():
        if key not in skip:
            assert b[2][key] == value, key
    pa = load_checkpoint(latest_checkpoint(full))["policy"]
    pb = load_checkpoint(latest_checkpoint(part))["policy"]
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


@pytest.mark.parametrize("staleness", [0, 2])      # on-policy, and more than one version behind
def test_async_mode_paces_sampling_instead_of_dropping(local_ray, tmp_path, staleness):
    cfg = tiny_config("train.iterations=5", "runtime.mode=async", f"runtime.max_staleness={staleness}")
    summary = run_trainer(cfg, tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    assert summary["iterations"] == 5
    assert all(r["dropped_batches"] == 0 for r in rows)              # paced: nothing thrown away
    assert all(r["batches"] == 2 for r in rows)                      # one batch of each worker per update
    assert all(r["policy_lag_max"] <= staleness for r in rows)
    if staleness == 0:
        assert all(r["policy_lag_mean"] == 0 for r in rows)          # waits for the new weights: on-policy
    else:
        # sampling overlapped the update: later batches were sampled one version (or more) before use
        assert max(r["policy_lag_max"] for r in rows[1:]) >= 1


def test_a_full_disk_mid_run_and_a_damaged_newest_checkpoint_lose_nothing_committed(local_ray, tmp_path, capsys,
                                                                                 monkeypatch):
    """A checkpoint write that fails (no space left) at iteration 2: the run goes on and writes
    iteration 3's. That one then cut in half: `--resume` names it and continues from iteration 1,
    `flowrl-ray eval` too; every file damaged: one line and exit 2, no traceback."""
    import flowrl_ray.runtime.trainer as tr
    from flowrl_ray.cli import main
    from flowrl_ray.errors import UserError
    real = tr.save_checkpoint

    def full_disk_at_2(run_dir, iteration, payload, keep):
        if iteration == 2:
            raise OSError(28, "No space left on device")
        return real(run_dir, iteration, payload, keep)
    monkeypatch.setattr(tr, "save_checkpoint", full_disk_at_2)
    cfg = tiny_config("train.iterations=3", "runtime.checkpoint_interval=1")
    run = tmp_path / "run"
    summary = run_trainer(cfg, run, quiet=False)
    out = capsys.readouterr().out
    assert summary["iterations"] == 3
    assert "checkpoint of iteration 2 not written ([Errno 28] No space left on device); the newest stays " \
           "iter_000001.pt" in out
    ckdir = run / "checkpoints"
    assert sorted(p.name for p in ckdir.glob("iter_*.pt")) == ["iter_000001.pt", "iter_000003.pt"]
    newest = ckdir / "iter_000003.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    longer = tiny_config("train.iterations=4", "runtime.checkpoint_interval=1")
    trainer = Trainer(longer, run, resume=True)
    try:
        trainer.setup()
        out = capsys.readouterr().out
        assert "iter_000003.pt skipped: it does not load whole (RuntimeError" in out
        assert trainer.counters.iteration == 1
        trainer.train()
    finally:
        trainer.close()
    assert [r["iteration"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert load_checkpoint(latest_checkpoint(run))["trainer"]["iteration"] == 4
    (ckdir / "iter_000004.pt").write_bytes(b"")
    assert main(["eval", str(run), "--episodes", "2"]) == 0
    captured = capsys.readouterr()
    assert "iter_000004.pt skipped" in captured.err and json.loads(captured.out.strip().splitlines()[-1])["episodes"] == 2
    for p in ckdir.glob("iter_*.pt"):
        p.write_bytes(b"")
    trainer = Trainer(longer, run, resume=True)
    try:
        with pytest.raises(UserError, match="no checkpoint loads whole"):
            trainer.setup()
    finally:
        trainer.close()
    assert main(["eval", str(run), "--episodes", "2"]) == 2
    err = capsys.readouterr().err
    assert "flowrl-ray eval: error:" in err and "no checkpoint loads whole" in err and "Traceback" not in err


def test_dead_learner_resumes_from_the_last_checkpoint(local_ray, tmp_path):
    cfg = tiny_config("train.iterations=4", "runtime.checkpoint_interval=1")
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    try:
        trainer.setup()
        summary = train_killing(trainer, ray.get(trainer.learner.pid.remote()))
    finally:
        trainer.close()
    rows = read_metrics(tmp_path / "run")
    assert summary["iterations"] == 4 and rows[-1]["learner_restarts"] == 1
    # the new learner continued from the checkpoint's policy version, not from scratch
    assert rows[-1]["policy_version"] >= 3
