"""benchmarks/flow_grpo_gradient_agreement.py end to end on a tiny model with real Chromium scoring:
every variant's cosines, the same-prompt pairs apart, the results files."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from unit.algorithms.test_flow_grpo import _config, sft_dir  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.mark.slow
def test_the_agreement_benchmark_runs_and_reports_every_variant(sft_dir, tmp_path):
    import flow_grpo_gradient_agreement as bench
    config = tmp_path / "fg.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path, sft_dir)))
    r = bench.main(["--config", str(config), "--batches", "4", "--prompts", "1", "--steps", "2", "--same-prompts",
                    "--n-boot", "100", "--results-dir", str(tmp_path), "--output", "agree"])
    assert set(r["variants"]) == {"sequence", "sequence shuffled", "line", "line shuffled"}
    tasks = [b["tasks"] for b in r["batches"]]
    assert tasks[0] == tasks[1] and tasks[2] == tasks[3] and tasks[0] != tasks[2]      # pairs share prompts
    for v in r["variants"].values():
        assert v["same_prompts"]["n"] == 2 and v["cosine"]["n"] == 4                   # (0,1), (2,3) vs the rest
        assert all(-1.0 <= c <= 1.0 for c in v["pair_cosines"])
    saved = json.loads((tmp_path / "agree.json").read_text())
    assert saved["steps"] == [0, 5] and (tmp_path / "agree.md").read_text().startswith("# Flow-GRPO")
