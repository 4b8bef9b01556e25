"""benchmarks/forms_bases.py: SFT checkpoints scored in Chromium on the same tasks, each paired with
the first."""

import json
import re
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.mark.slow
def test_two_bases_on_the_same_tasks_and_the_same_base_twice_differs_by_nothing(tmp_path, capsys):
    import forms_bases

    base, cont = REPO / "pretrained/forms_small_sft", REPO / "pretrained/forms_small_sft_cont"
    rc = forms_bases.main([str(base), str(cont), str(base), "--tasks", "2", "--greedy-only", "--n-boot", "200",
                           "--set", "algo.num_generation_steps=8", "--results-dir", str(tmp_path), "--output", "b"])
    assert rc == 0
    data = json.loads((tmp_path / "b.json").read_text())
    first, other, again = data["checkpoints"]
    assert data["compared_with"] == "pretrained/forms_small_sft" and data["tasks"] == 2     # JSON paths: repository-relative
    assert first["outcomes"]["task_ids"] == other["outcomes"]["task_ids"] == again["outcomes"]["task_ids"]
    assert first["outcomes"]["kinds"] == ["heldout_values", "heldout_forms"]        # greedy only
    # greedy decoding is deterministic: the same checkpoint scores the same on every task
    for m in ("field_accuracy", "task_completion", "rewards"):
        assert again["outcomes"][m] == first["outcomes"][m]
        g = again["summary"]["all"][m]["gain"]
        assert g["gain"] == g["ci_low"] == g["ci_high"] == 0.0
        # the other checkpoint's difference is its mean minus the first's, paired by task
        diff = sum(other["outcomes"][m]) / 2 - sum(first["outcomes"][m]) / 2
        assert other["summary"]["all"][m]["gain"]["gain"] == pytest.approx(diff)
    md = (tmp_path / "b.md").read_text()
    assert re.search(r"\| checkpoint +\| tasks +\| n \| metric +\| base +\|", md) and str(cont) in md


def test_a_directory_that_is_not_a_checkpoint_is_refused_before_anything_loads(tmp_path, capsys):
    import forms_bases

    assert forms_bases.main([str(REPO / "pretrained/forms_small_sft"), str(tmp_path), "--tasks", "2"]) == 2
    assert f"not an SFT checkpoint directory (no config.json): {tmp_path}" in capsys.readouterr().err
    assert forms_bases.main([str(REPO / "pretrained/forms_small_sft"), "--tasks", "2", "--set", "algo.nope=1"]) == 2
    assert "nope" in capsys.readouterr().err
