"""FlowSAR end to end through the CLI on real robosuite Lift and a real local Ray:
demos -> pretrain (the FlowSAR config's flow policy) -> train -> the analysis pictures -> eval."""

import json
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from flowrl_ray.cli import main  # noqa: E402


@pytest.mark.slow
def test_demos_pretrain_train_analysis_eval(tmp_path, capsys):
    demos, base, run = tmp_path / "lift.hdf5", tmp_path / "base.pt", tmp_path / "run"
    assert main(["demos", "lift", "--episodes", "2", "--out", str(demos)]) == 0
    config = tmp_path / "flowsar.yaml"
    config.write_text(yaml.safe_dump({
        "name": "flowsar-cli", "algorithm": "flowsar",
        "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2,
                "max_episode_steps": 10, "dataset": str(demos)},
        "train": {"iterations": 2},
        # 6 chunk steps per env per iteration; an episode is at most 5: every env ends one
        "runtime": {"num_workers": 2, "envs_per_worker": 2, "rollout_length": 6, "checkpoint_interval": 0},
        "eval": {"interval": 2, "episodes": 2, "at_start": True},
        "algo": {"base_policy": str(base), "hidden_sizes": [32, 32], "flow_steps": 3, "minibatch_size": 8,
                 "flowsar": {"lr": 1e-4, "n_annotation_samples": 2}}}))
    assert main(["pretrain", str(config), "--epochs", "2", "--batch-size", "32"]) == 0
    assert base.is_file()
    capsys.readouterr()

    assert main(["train", str(config), "--run-dir", str(run), "--no-tensorboard"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "flowsar" and summary["iterations"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["flowsar/episodes"] >= 4                    # 4 envs, each ended an episode
        assert row["flowsar/steps"] >= 1 and np.isfinite(row["flowsar/loss"])
        assert 0.0 <= row["flowsar/weight_entropy_ratio"] <= 1.0 + 1e-6
    assert rows[1]["flowsar/ema_coefficient"] == 0.0 and rows[2]["flowsar/ema_coefficient"] == pytest.approx(0.001)
    analysis = np.load(run / "analysis" / "iter_0002.npz")
    weights, mask = analysis["weights"], analysis["mask"]
    real = mask.any(1)              # the default episode_mean: every episode sums to the batch's mean length
    sums, lengths = weights.sum(1)[real], mask.sum(1)[real]
    np.testing.assert_allclose(sums, sums[0], rtol=1e-5)
    assert lengths.min() - 1e-5 <= sums[0] <= lengths.max() + 1e-5
    for png in ("flowsar_errors.png", "flowsar_weights.png", "flowsar_e_spread.png", "success_rate.png"):
        assert (run / "plots" / png).stat().st_size > 0, png

    # the policy in perturbed scenes (the OOD suite's action noise; a key of env.perturb); the
    # unperturbed `eval`: tests/e2e/test_fpopp_cli.py
    assert main(["eval", str(run), "--episodes", "2", "--sampling", "zero", "--perturb", "action_noise"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["perturb"] == {"name": "action_noise", "action_noise_std": 0.1} and result["episodes"] == 2
    assert result["sampling"] == "zero" and 0.0 <= result["success_rate"] <= 1.0
    assert main(["eval", str(run), "--episodes", "2", "--perturb", "placement_scale=1.5",
                 "--perturb", "table_friction_scale=0.5"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["perturb"] == {"name": "custom", "placement_scale": 1.5, "table_friction_scale": 0.5}
    for bad, key in (("placment_scale=2", "env.perturb.placment_scale"), ("camera", "env.perturb.camera_shift")):
        assert main(["eval", str(run), "--episodes", "2", "--perturb", bad]) == 2
        assert key in capsys.readouterr().err
