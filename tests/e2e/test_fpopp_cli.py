"""The FPO++ pipeline end to end through the CLI, on real robosuite Lift and a real local Ray:
demos -> pretrain -> train (FPO++ from the base policy) -> eval with zero and random sampling
-> Serve answering an action chunk over HTTP."""

import json
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest  # noqa: E402
import yaml  # noqa: E402

from conftest import free_port  # noqa: E402
from flowrl_ray.cli import main  # noqa: E402


@pytest.mark.slow
def test_demos_pretrain_train_eval_serve(tmp_path, capsys):
    demos, base, run = tmp_path / "lift.hdf5", tmp_path / "base.pt", tmp_path / "run"
    assert main(["demos", "lift", "--episodes", "2", "--out", str(demos)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["demos"] == 2
    config = tmp_path / "fpopp.yaml"
    config.write_text(yaml.safe_dump({
        "name": "fpopp-cli", "algorithm": "fpopp",
        "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2,
                "max_episode_steps": 10, "dataset": str(demos)},
        "train": {"iterations": 2},
        "runtime": {"num_workers": 2, "envs_per_worker": 2, "rollout_length": 6, "checkpoint_interval": 0},
        "eval": {"interval": 2, "episodes": 2, "at_start": True},
        "algo": {"base_policy": str(base), "hidden_sizes": [32, 32], "critic_hidden_sizes": [16],
                 "minibatch_size": 12, "n_mc": 2, "flow_steps": 3, "critic_warmup_iters": 1, "epochs": 2}}))
    assert main(["pretrain", str(config), "--epochs", "2", "--batch-size", "32"]) == 0
    assert base.is_file()
    capsys.readouterr()

    assert main(["train", str(config), "--run-dir", str(run), "--no-tensorboard"]) == 0
    out = capsys.readouterr().out
    assert "eval success rate" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "fpopp" and summary["iterations"] == 2
    assert 0.0 <= summary["first_eval_success_rate"] <= 1.0          # the base policy, before any update
    assert "final_success_rate" in summary and (run / "plots" / "success_rate.png").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[1]["fpopp/actor_frozen"] == 1.0 and "pg_loss" in rows[2] and "clipfrac" in rows[2]

    # zero sampling (FPO++'s deployed rule) here; random sampling through the CLI: test_reinflow_cli.py
    assert main(["eval", str(run), "--episodes", "2", "--sampling", "zero"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sampling"] == "zero" and result["episodes"] == 2
    assert 0.0 <= result["success_rate"] <= 1.0

    import requests

    from flowrl_ray.runtime.serve import deploy, shutdown
    url = deploy(run, host="127.0.0.1", port=free_port())
    try:
        health = requests.get(url + "/healthz", timeout=30).json()
        assert health["horizon_steps"] == 4 and health["act_steps"] == 2 and len(health["action_low"]) == 7
        r = requests.post(url + "/act", json={"observation": [0.0] * 19}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["action"]) == 4 and all(len(row) == 7 for row in body["action"])
        assert all(-1.0 <= v <= 1.0 for row in body["normalized_action"] for v in row)
        again = requests.post(url + "/act", json={"observation": [0.0] * 19}, timeout=30).json()
        assert again["action"] == body["action"]                  # zero-sampling is deterministic
        bad = requests.post(url + "/act", json={"observation": [0.0] * 18}, timeout=30)
        assert bad.status_code == 400 and "error" in bad.json()
    finally:
        shutdown()
