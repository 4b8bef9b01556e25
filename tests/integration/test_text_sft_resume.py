"""`flowrl-ray pretrain` of the forms language model in several invocations: stopped by
--max-minutes, continued with --resume to the same weights as one uninterrupted run, refused when
the settings differ or the run is finished, and trained further from a finished one with
--init-from. A tiny model on 4 tasks per training form."""

import json

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from flowrl_ray.cli import main  # noqa: E402
from flowrl_ray.models.masked_diffusion import load_sft_checkpoint  # noqa: E402
from flowrl_ray.pretrain.text_sft import SETTINGS_FILE, STATE_FILE  # noqa: E402
from unit.algorithms.test_flow_grpo import TINY_MODEL, _config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _pretrain(config, out, capsys, *flags) -> tuple[int, dict | str]:
    code = main(["pretrain", str(config), "--out", str(out), "--steps", "5", "--tasks-per-form", "4",
                 "--batch-size", "16", "--lr", "3e-3", *flags])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out.strip().splitlines()[-1]) if code == 0 else captured.err)


def _weights(path):
    return load_sft_checkpoint(path, TINY_MODEL).model.state_dict()


def test_stopped_resumed_and_extended_sft_runs(tmp_path, capsys):
    config = tmp_path / "fg.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path, str(tmp_path / "unused"))))
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    code, summary = _pretrain(config, whole, capsys)
    assert code == 0 and summary["steps"] == 5 and summary["finished"]
    assert not (whole / STATE_FILE).exists()                   # a finished run keeps no training state ...
    kept = json.loads((whole / SETTINGS_FILE).read_text())      # ... but the settings that made it
    assert kept["steps"] == 5 and kept["finished"] and kept["train_s"] > 0

    # a first invocation out of time after its first step: the checkpoint holds the state
    code, summary = _pretrain(config, parts, capsys, "--max-minutes", "1e-9")
    assert code == 0 and summary["steps"] == 1 and not summary["finished"]
    assert (parts / STATE_FILE).is_file() and json.loads((parts / SETTINGS_FILE).read_text())["steps"] == 5
    assert len((parts / "sft_metrics.jsonl").read_text().splitlines()) == 1
    code, err = _pretrain(config, parts, capsys, "--resume", "--lr", "1e-3")
    assert code == 2 and "config key 'pretrain.lr'" in err and "lr=0.003" in err
    code, summary = _pretrain(config, parts, capsys, "--resume")
    assert code == 0 and summary["steps"] == 5 and summary["finished"] and not (parts / STATE_FILE).exists()
    assert len((parts / "sft_metrics.jsonl").read_text().splitlines()) == 5
    assert (whole / "sft_metrics.jsonl").read_text() == (parts / "sft_metrics.jsonl").read_text()
    for (name, a), b in zip(_weights(whole).items(), _weights(parts).values()):
        assert torch.equal(a, b), name                        # the same run, bit for bit

    code, err = _pretrain(config, parts, capsys, "--resume")   # nothing left to resume
    assert code == 2 and "holds no unfinished run" in err and f"--init-from {parts}" in err
    further = tmp_path / "further"
    code, summary = _pretrain(config, further, capsys, "--init-from", str(parts), "--steps", "2")
    assert code == 0 and summary["steps"] == 2
    before, after = _weights(parts), _weights(further)
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    tok = lambda p: load_sft_checkpoint(p, TINY_MODEL).tokenizer.get_vocab()       # noqa: E731
    assert tok(further) == tok(parts)                         # the tokenizer comes with the weights
    code, err = _pretrain(config, tmp_path / "x", capsys, "--init-from", str(tmp_path / "missing"))
    assert code == 2 and "config key 'pretrain.init_from'" in err
