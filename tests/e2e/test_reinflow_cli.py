"""ReinFlow end to end through the CLI on real robosuite Lift and a real local Ray: demos ->
pretrain -> train from the base -> exact resume -> eval -> the policy Serve deploys, noise off."""

import json
import os
import shutil

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from flowrl_ray.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from flowrl_ray.cli import main  # noqa: E402
from flowrl_ray.metrics import read_metrics  # noqa: E402


@pytest.mark.slow
def test_demos_pretrain_train_resume_eval_and_the_served_policy(tmp_path, capsys):
    demos, base, run = tmp_path / "lift.hdf5", tmp_path / "base.pt", tmp_path / "run"
    assert main(["demos", "lift", "--episodes", "2", "--out", str(demos)]) == 0
    config = tmp_path / "reinflow.yaml"
    config.write_text(yaml.safe_dump({
        "name": "reinflow-cli", "algorithm": "reinflow",
        "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2,
                "max_episode_steps": 10, "dataset": str(demos)},
        "train": {"iterations": 3},
        "runtime": {"num_workers": 2, "envs_per_worker": 2, "rollout_length": 6, "checkpoint_interval": 1},
        "eval": {"interval": 3, "episodes": 2, "at_start": True, "sampling": "random"},
        "algo": {"base_policy": str(base), "hidden_sizes": [32, 32], "critic_hidden_sizes": [16],
                 "noise_hidden_sizes": [16], "minibatch_size": 12, "flow_steps": 3, "critic_warmup_iters": 1,
                 "epochs": 2, "logprob_scale": "reference", "clip": 0.01, "ent_coef": 0.01}}))
    assert main(["pretrain", str(config), "--epochs", "2", "--batch-size", "32"]) == 0
    base_state = torch.load(base, weights_only=False)["policy"]
    capsys.readouterr()

    assert main(["train", str(config), "--run-dir", str(run), "--no-tensorboard"]) == 0
    assert "eval success rate" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "reinflow" and summary["iterations"] == 3
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert rows[1]["reinflow/actor_frozen"] == 1.0 and "pg_loss" not in rows[1]
    for key in ("pg_loss", "entropy", "clipfrac", "approx_kl", "noise_std", "ratio_mean"):
        assert key in rows[2], key
    assert 0.08 - 1e-6 <= rows[2]["noise_std"] <= 0.14 + 1e-6                # the default bounds
    # the run started from the base: the critic warm-up iteration left the flow weights alone
    first = load_checkpoint(run / "checkpoints" / "iter_000001.pt")["policy"]
    for k, v in base_state.items():
        assert torch.equal(first[k], v), k

    # An interrupted run: the iteration-2 checkpoint, resumed, gives the uninterrupted iteration 3.
    part = tmp_path / "part"
    (part / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(run / name, part / name)
    shutil.copy(run / "checkpoints" / "iter_000002.pt", part / "checkpoints" / "iter_000002.pt")
    assert main(["train", "--resume", str(part), "--no-tensorboard"]) == 0
    capsys.readouterr()
    a, b = read_metrics(run), read_metrics(part)
    skip = {"time_s", "env_steps_per_s", "sample_time_s", "learner/update_time_s", "learner/fetch_time_s"}
    assert {k: v for k, v in b[-1].items() if k not in skip and not k.startswith("eval")} == \
        {k: v for k, v in a[-1].items() if k not in skip and not k.startswith("eval")}
    pa = load_checkpoint(latest_checkpoint(run))["policy"]
    pb = load_checkpoint(latest_checkpoint(part))["policy"]
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k

    # random sampling here; zero sampling through the CLI: test_fpopp_cli.py (and /act below)
    assert main(["eval", str(run), "--episodes", "2", "--sampling", "random"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sampling"] == "random" and 0.0 <= result["success_rate"] <= 1.0

    # what `flowrl-ray serve` deploys from this run (the HTTP server itself: test_fpopp_cli.py)
    from flowrl_ray.runtime.serve import policy_info
    _, policy, info = policy_info(run)
    assert info["algorithm"] == "reinflow" and info["horizon_steps"] == 4 and len(info["action_low"]) == 7
    obs = torch.zeros(1, 19)
    with torch.no_grad():
        a, _ = policy.eval().act(obs, deterministic=True, record=False)
        b, _ = policy.act(obs, deterministic=True, record=False)
    assert a.shape == (1, 4, 7) and torch.equal(a, b)          # zero-sampling, noise off: deterministic
    assert a.abs().max() <= 1.0
