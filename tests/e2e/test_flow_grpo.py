"""Flow-GRPO end to end: a tiny SFT -> Flow-GRPO -> eval run through the CLI with real Chromium
scorers on a real local Ray."""

import json
import math

import pytest
import torch
import yaml

from flowrl_ray.envs.forms import FormCatalog
from unit.algorithms.test_flow_grpo import _config


@pytest.mark.slow
def test_sft_then_flow_grpo_then_eval_through_the_cli(tmp_path, capsys):
    from flowrl_ray.cli import main
    config = tmp_path / "fg.yaml"
    sft, run = tmp_path / "sft", tmp_path / "run"
    config.write_text(yaml.safe_dump(_config(tmp_path, str(sft))))
    assert main(["pretrain", str(config), "--steps", "3", "--tasks-per-form", "4", "--batch-size", "32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["pairs"] == 4 * len(FormCatalog.load().ids(heldout=False)) and summary["steps"] == 3
    assert summary["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")    # the GPU when there is one
    assert (sft / "sft_loss.png").is_file() and (sft / "config.json").is_file()

    assert main(["train", str(config), "--run-dir", str(run), "--no-tensorboard"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[0]["eval/episodes"] == 2 and "eval/heldout_forms/field_accuracy" in rows[0]
    assert rows[0]["eval/invalid_episodes"] == 0
    for row in rows[1:]:
        assert row["episodes_this_iter"] == 4              # 2 prompts x G=2, scored in Chromium
        assert 0.0 <= row["field_accuracy"] <= 1.0 and math.isfinite(row["flow_grpo/loss"])
        for k in ("flow_grpo/ratio_mean", "flow_grpo/ratio_min", "flow_grpo/ratio_max", "approx_kl", "kl",
                  "clipfrac", "task_completion", "execution_completeness", "invalid_episodes"):
            assert math.isfinite(row[k]), k            # per-iteration metrics in metrics.jsonl
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["eval/episodes"] == 2 and 0.0 <= result["eval/field_accuracy"] <= 1.0
