"""FED-GRPO end to end: a tiny pretrain -> FED-GRPO -> eval run through the CLI with real
GFN2-xTB scorers on a real local Ray, then the molecule protocol on it."""

import json

import numpy as np
import pytest
import yaml

from conftest import REPO
from unit.algorithms.test_fed_grpo import _config


@pytest.mark.slow
def test_pretrain_train_eval_through_the_cli(tmp_path, capsys):
    from flowrl_ray.cli import main
    base, run, config = tmp_path / "edm.pt", tmp_path / "run", tmp_path / "fed.yaml"
    data = _config(base_model=str(base), shaping={"mode": "pbrs_return_to_go", "stride": 2},
                   shared_prefix_steps=2, lr=1e-4)
    config.write_text(yaml.safe_dump(data))
    assert main(["pretrain", str(config), "--steps", "3", "--batch-size", "8", "--eval-samples", "4"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert base.is_file() and summary["steps"] == 3
    assert set(summary["eval"]) >= {"atom_stability", "molecule_stability", "validity", "valid_and_unique"}

    assert main(["train", str(config), "--run-dir", str(run), "--no-tensorboard"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["fed_grpo/transitions"] == 4.0
        assert np.isfinite(row["fed_grpo/pg_loss"]) and row["fed_grpo/ratio_min"] > 0
        # every molecule got a reward or a recorded reason: the reason fractions sum to 1
        assert sum(v for k, v in row.items() if k.startswith("reason/")) == pytest.approx(1.0)
    assert "eval/rms_force_eV_per_A" in rows[0] and "eval/validity" in rows[-1]
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "validity" in json.dumps(result)

    # the molecule protocol on this run: the base and the run sample the same molecules
    import sys
    sys.path.insert(0, str(REPO / "benchmarks"))
    import fed_grpo_protocol
    out = tmp_path / "results"
    assert fed_grpo_protocol.main(["--variant", f"tiny={run}", "--molecules", "6", "--n-boot", "100",
                                   "--results-dir", str(out), "--output", "p"]) == 0
    saved = json.loads((out / "p.json").read_text())
    summary = saved["variants"]["tiny"]["summary"]
    assert summary["molecules"] == 6 and summary["stable_atom_fraction"]["n"] == 6
    assert len(saved["base"]["outcomes"]["rms_force"]) == 6 and saved["variants"]["tiny"]["runs"][0]["iterations"] == 2
    assert (out / "p.md").read_text().startswith("# Molecule evaluation protocol")
    # the periodic evaluation (at iterations 0 and 2, 6 molecules each) drawn against molecules trained
    first = saved["variants"]["tiny"]["runs"][0]
    evals = [r for r in rows if "eval/atom_stability" in r]
    assert [x for x, _ in first["atom_stability_curve"]] == [r["env_steps"] for r in evals] == [0, 12]
    assert [y for _, y in first["atom_stability_curve"]] == pytest.approx([100 * r["eval/atom_stability"] for r in evals])
    assert (out / "p_atom_stability_curve.png").is_file() and (out / "p_force_curve.png").is_file()
