"""`flowrl-ray demos` / `flowrl-ray pretrain` on real robosuite: scripted demos, flow-matching
behaviour cloning, the base-policy checkpoint FPO++ loads, and the two CLI verbs in process."""

import json

import numpy as np
import pytest

pytest.importorskip("robosuite")

from flowrl_ray import cli                                                   # noqa: E402
from flowrl_ray.models.flow_policy import load_base_policy, make_flow_policy, policy_arch  # noqa: E402
from flowrl_ray.algorithms.fpopp import FPOPP                                # noqa: E402
from flowrl_ray.config import ConfigError, config_from_dict  # noqa: E402
from flowrl_ray.envs.robot import robomimic_data as rd                             # noqa: E402
from flowrl_ray.envs import robot                                            # noqa: E402
from flowrl_ray.envs.robot.experts import collect_demos                      # noqa: E402
from flowrl_ray.pretrain.flow_bc import pretrain_flow_policy as pretrain  # noqa: E402


def _config(dataset, **env):
    return config_from_dict({
        "algorithm": "fpopp",
        "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2,
                "dataset": str(dataset), **env},
        "algo": {"hidden_sizes": [64, 64], "minibatch_size": 8},
        "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 4}})


@pytest.fixture(scope="module")
def lift_demos(tmp_path_factory):
    path = tmp_path_factory.mktemp("demos") / "lift.hdf5"
    collect_demos("lift", episodes=2, out_path=path, seed=0, noise=0.1)
    return path


def test_pretrain_learns_and_writes_a_base_policy_fpopp_loads(lift_demos, tmp_path):
    cfg = _config(lift_demos, max_episode_steps=24)        # short eval episodes
    out = tmp_path / "base" / "lift.pt"
    summary = pretrain(cfg, out=out, epochs=100, batch_size=16, lr=1e-3, eval_episodes=1, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "base" / "lift.metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(rows) == 100 and np.mean(losses[-3:]) < 0.65 * np.mean(losses[:3])
    assert summary["final_loss"] == losses[-1] and summary["demos"] == 2
    assert (tmp_path / "base" / "lift.loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["lift.loss.png", "lift.metrics.jsonl", "lift.pt"]

    ckpt = load_base_policy(out)
    assert ckpt["arch"] == policy_arch(cfg) and ckpt["demos"] == 2 and ckpt["epochs"] == 100
    assert ckpt["samples"] == sum(len(d["actions"]) for d in rd.load_demos(lift_demos, robot.LOW_DIM_KEYS))
    assert ckpt["dataset"] == str(lift_demos) and ckpt["config"]["env"]["dataset"] == str(lift_demos)
    for mode in ("zero", "random"):
        assert 0 <= ckpt["eval"][mode]["success_rate"] <= 1
    assert summary["success_zero"] == ckpt["eval"]["zero"]["success_rate"]
    policy = make_flow_policy(cfg, robot.spec(cfg.env))
    policy.load_state_dict(ckpt["policy"])                           # strict: same architecture
    # an FPO++ config naming it passes FPO++'s checks; another architecture is refused, naming the key
    data = {"algorithm": "fpopp", "env": ckpt["config"]["env"],
            "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 4}}

    def fpopp_checks(hidden_sizes):
        cfg = config_from_dict({**data, "algo": {"hidden_sizes": hidden_sizes, "minibatch_size": 8,
                                                 "base_policy": str(out)}})
        FPOPP.preflight(cfg, robot.spec(cfg.env))

    fpopp_checks([64, 64])
    with pytest.raises(ConfigError, match=r"algo\.hidden_sizes"):
        fpopp_checks([32])


def test_pretrain_needs_a_dataset_and_an_output(lift_demos, tmp_path):
    cfg = _config(lift_demos)
    with pytest.raises(ConfigError, match=r"algo\.base_policy"):
        pretrain(cfg, progress=False)
    with pytest.raises(ConfigError, match=r"env\.dataset"):
        pretrain(cfg, dataset=tmp_path / "none.hdf5", out=tmp_path / "x.pt", progress=False)


def test_cli_demos_writes_a_dataset(tmp_path, capsys):
    out = tmp_path / "d" / "lift.hdf5"
    assert cli.main(["demos", "lift", "--episodes", "1", "--out", str(out)]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["task"] == "lift" and line["demos"] == 1 and line["out"] == str(out)
    assert 0 < line["success_rate"] <= 1 and line["steps"] > 0
    assert len(rd.load_demos(out, robot.LOW_DIM_KEYS)) == 1


def test_cli_pretrain(lift_demos, tmp_path, capsys):
    base = tmp_path / "base.pt"
    config = tmp_path / "cfg.yaml"
    # algo.base_policy names the file pretraining creates: it must not be loaded beforehand
    config.write_text(json.dumps({
        "algorithm": "fpopp", "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2,
                                      "dataset": str(tmp_path / "missing.hdf5")},
        "algo": {"hidden_sizes": [64, 64], "minibatch_size": 8, "base_policy": str(base)},
        "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 4}}))
    assert cli.main(["pretrain", str(config), "--epochs", "2"]) == 2
    assert "env.dataset" in capsys.readouterr().err
    assert cli.main(["pretrain", str(config), "--dataset", str(tmp_path / "nope.hdf5")]) == 2
    assert "--dataset" in capsys.readouterr().err
    assert cli.main(["pretrain", str(config), f"env.dataset={lift_demos}", "--epochs", "2",
                     "--batch-size", "32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["out"] == str(base) and summary["epochs"] == 2 and base.is_file()
    assert load_base_policy(base)["arch"]["hidden_sizes"] == [64, 64]
