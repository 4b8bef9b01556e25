"""The robot evaluation protocol end to end on a tiny FPO++ Lift run (real demos, pretraining, two
training runs on local Rays)."""

import json
import os
import re
import sys

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from conftest import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.mark.slow
def test_protocol_end_to_end_on_a_tiny_lift_run(tmp_path, capsys):
    """2 seeds x 2 iterations of a tiny FPO++ Lift config, trained 2 at a time, then the base and
    both final policies on the same 6 episodes; the numbers are read back and recomputed."""
    import robot_protocol

    from flowrl_ray.cli import main as cli
    demos, base = tmp_path / "lift.hdf5", tmp_path / "base.pt"
    assert cli(["demos", "lift", "--episodes", "2", "--out", str(demos)]) == 0
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "name": "tiny-lift", "algorithm": "fpopp",
        "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2,
                "max_episode_steps": 10, "dataset": str(demos)},
        "train": {"iterations": 2},
        "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 6, "checkpoint_interval": 0},
        "eval": {"interval": 2, "episodes": 2, "at_start": True},
        "algo": {"base_policy": str(base), "hidden_sizes": [32, 32], "critic_hidden_sizes": [16],
                 "minibatch_size": 12, "n_mc": 2, "flow_steps": 3, "critic_warmup_iters": 1, "epochs": 1}}))
    assert cli(["pretrain", str(config), "--epochs", "2", "--batch-size", "32"]) == 0
    capsys.readouterr()

    results = tmp_path / "results"
    common = ["--episodes", "6", "--n-boot", "2000", "--results-dir", str(results)]
    assert robot_protocol.main(["--config", str(config), "--seeds", "0", "1", "--parallel", "2",
                                "--runs-dir", str(tmp_path / "runs"), "--output", "smoke", *common]) == 0
    out = capsys.readouterr().out
    assert "seed 1 finished" in out and "has 2 seed(s)" in out
    data = json.loads((results / "smoke.json").read_text())
    v = data["variants"]["tiny-lift"]
    assert [r["seed"] for r in v["runs"]] == [0, 1]
    (base_entry,) = data["bases"].values()
    from _robot import base_policy, run_config, weights_digest
    digest = weights_digest(base_policy(run_config(v["runs"][0]["run_dir"]), str(base)))
    assert base_entry["weights_sha256"] == digest and f"`{base}` {digest}" in (results / "smoke.md").read_text()
    for s in ("zero", "random"):
        b = base_entry["outcomes"][s]
        assert len(b["successes"]) == 6 and b["keys"] == sorted(b["keys"])
        assert sorted(map(tuple, b["keys"])) == [(i, k) for i in range(6) for k in range(1)]   # 6 envs, 1 each
        per_seed = [r["outcomes"][s]["successes"] for r in v["runs"]]
        assert all(r["outcomes"][s]["keys"] == b["keys"] for r in v["runs"])    # the same episodes
        gain = np.mean([np.mean(p) for p in per_seed]) - np.mean(b["successes"])
        assert v["gain"][s]["gain"] == pytest.approx(gain)
        assert v["gain"][s]["ci_low"] <= v["gain"][s]["gain"] <= v["gain"][s]["ci_high"]
        assert v["success"][s]["per_seed"] == pytest.approx([np.mean(p) for p in per_seed])
    for r in v["runs"]:
        assert r["iterations"] == 2 and r["chunks"] == 2 * 2 * 6 and r["launch_wall_s"] > 0
        assert r["env_steps"] == 2 * r["chunks"]         # robosuite steps: 10-step episodes run whole 2-row chunks
        assert len(r["train_curve"]) >= 1 and [x for x, _ in r["eval_curve"]] == [0, 24]
        # the same training success against robosuite steps (2 per chunk here)
        assert [(2 * x, y) for x, y in r["train_curve"]] == [tuple(p) for p in r["train_curve_env_steps"]]
    assert data["machine"]["CPU"] and "logical" in data["machine"]["cores"]
    for png in ("smoke_train.png", "smoke_eval.png", "smoke_train_env_steps.png"):
        assert (results / png).read_bytes()[:4] == b"\x89PNG"
    md = (results / "smoke.md").read_text()
    assert re.search(r"\| tiny-lift +\| random +\| 2 +\|", md) and "## Machine" in md

    runs = [r["run_dir"] for r in v["runs"]]
    # the finished runs again (--runs groups them by their config name, the variant's), in a new
    # evaluation with new envs, by one sampling rule only and out of distribution too (the same
    # episodes in a scene with action noise): the same in-distribution outcomes of that rule, and
    # nothing of the other rule
    assert robot_protocol.main(["--runs", *runs, "--output", "ood", "--sampling", "random",
                                "--ood", "action_noise", *common]) == 0
    ood = json.loads((results / "ood.json").read_text())
    assert ood["protocol"]["sampling"] == ["random"]
    (b_ood,) = ood["bases"].values()
    assert b_ood["outcomes"] == {"random": base_entry["outcomes"]["random"]}
    v_ood = ood["variants"]["tiny-lift"]
    assert [r["outcomes"] for r in v_ood["runs"]] == [{"random": r["outcomes"]["random"]} for r in v["runs"]]
    assert list(v_ood["gain"]) == ["random"]
    assert list(b_ood["ood"]) == ["action_noise"] and list(b_ood["ood"]["action_noise"]) == ["random"]
    noisy = b_ood["ood"]["action_noise"]["random"]
    assert noisy["keys"] == base_entry["outcomes"]["random"]["keys"]                  # the same episodes
    per_seed = [r["ood"]["action_noise"]["random"]["successes"] for r in v_ood["runs"]]
    gain = np.mean([np.mean(p) for p in per_seed]) - np.mean(noisy["successes"])
    assert v_ood["ood"]["action_noise"]["gain"]["random"]["gain"] == pytest.approx(gain)
    md = (results / "ood.md").read_text()
    assert "| tiny-lift | action_noise" in md and "| zero " not in md
