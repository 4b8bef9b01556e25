"""`flowrl-ray forms fewshot` end to end: a tiny llama GGUF in a fake installed package (written by
tests/unit/models/test_packaged_lm.py), few-shot on 2 evaluation tasks (one per kind), each
completion scored in a real headless Chromium by the env's reward; the JSON summary and the
per-task file. Skipped when Playwright or Chromium is missing."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("playwright.async_api")

from flowrl_ray.envs.forms import BrowserUnavailable, evaluation_tasks, find_chromium  # noqa: E402
from unit.models.test_packaged_lm import fake_site, tiny_gguf_package  # noqa: E402, F401 (fixtures)

try:
    find_chromium()
except BrowserUnavailable as e:                                    # pragma: no cover - depends on the machine
    pytest.skip(str(e), allow_module_level=True)

METRICS = ("field_accuracy", "task_completion", "execution_completeness", "rewards")


@pytest.mark.slow
def test_fewshot_verb_on_a_tiny_packaged_model(tiny_gguf_package, tmp_path, capsys):
    from flowrl_ray.cli import main
    name, _ = tiny_gguf_package
    out = tmp_path / "results" / "fewshot.json"
    assert main(["forms", "fewshot", "--model", name, "--tasks", "2", "--batch", "2", "--threads", "1",
                 "--pages", "2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)                               # stdout: the summary alone
    assert "[fewshot: generating] 2/2 tasks" in captured.err
    assert "[fewshot: scoring in Chromium] 2/2 tasks" in captured.err
    assert summary["model"] == name and summary["gguf"] == "tiny.gguf" and summary["tasks"] == 2
    assert summary["format"] == "chat template" and summary["decoding"] == "greedy"
    assert summary["examples"] and all(t.startswith("sft/") for t in summary["examples"])
    for kind in ("all", "heldout_values", "heldout_forms"):
        assert summary[kind]["tasks"] == (2 if kind == "all" else 1)
        for m in METRICS:
            assert 0.0 <= summary[kind][m] <= 1.0, (kind, m)
    assert summary["generation_s"] >= 0 and summary["scoring_s"] > 0 and summary["invalid"] == 0

    saved = json.loads(out.read_text())
    assert saved["summary"] == summary
    per_task = saved["per_task"]
    tasks = evaluation_tasks(2)
    assert per_task["task_ids"] == [t.task_id for t in tasks]
    assert per_task["kinds"] == ["heldout_values", "heldout_forms"]
    for m in METRICS:
        assert len(per_task[m]) == 2 and all(0.0 <= x <= 1.0 for x in per_task[m])
    assert len(per_task["completions"]) == 2 and all(isinstance(c, str) for c in per_task["completions"])
    assert per_task["valid"] == [True, True] and len(per_task["reasons"]) == 2


@pytest.mark.slow
def test_forms_protocol_evaluates_the_reference_model_on_the_bases_tasks(tiny_gguf_package, tmp_path):
    import sys

    import yaml

    from conftest import REPO
    from flowrl_ray.config import read_yaml
    sys.path.insert(0, str(REPO / "benchmarks"))
    import forms_protocol as fp

    name, _ = tiny_gguf_package
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(read_yaml(REPO / "configs/flow_grpo/forms_small.yaml")))
    tasks = evaluation_tasks(2)
    base = {"task_ids": [t.task_id for t in tasks], "kinds": [t.split for t in tasks],
            "field_accuracy": [1.0, 0.0], "task_completion": [1.0, 0.0], "rewards": [1.0, 0.0]}
    ref = fp.evaluate_reference(name, run, 2, base)
    assert ref["task_ids"] == base["task_ids"] and ref["kinds"] == ["heldout_values", "heldout_forms"]
    assert all(len(ref[m]) == 2 and all(0.0 <= x <= 1.0 for x in ref[m]) for m in fp.METRICS)
    assert ref["invalid"] == 0 and ref["scoring_s"] > 0 and len(ref["completions"]) == 2
    s = fp.summarise(base, [{"outcomes": ref}], n_boot=100)
    assert s["all"]["field_accuracy"]["gain"]["gain"] == pytest.approx(sum(ref["field_accuracy"]) / 2 - 0.5)
    with pytest.raises(fp.UsageError, match="differ from the base's"):         # other tasks than the base's
        fp.evaluate_reference(name, run, 2, {**base, "task_ids": base["task_ids"][::-1]})


@pytest.mark.slow
def test_forms_protocol_evaluates_the_committed_base_with_and_without_sampled_rows(tmp_path):
    """The protocol's evaluation of the committed SFT base on 2 tasks in Chromium: the config's
    eval_sampled adds the same tasks again under sampled/<kind>; --greedy-only leaves them out,
    and the greedy rows are the same either way (greedy decoding is deterministic)."""
    import sys

    import yaml

    from conftest import REPO
    from flowrl_ray.config import read_yaml
    sys.path.insert(0, str(REPO / "benchmarks"))
    import forms_protocol as fp

    run = tmp_path / "run"
    run.mkdir()
    cfg = read_yaml(REPO / "configs/flow_grpo/forms_small.yaml")
    cfg["algo"]["sft_checkpoint"] = str(REPO / cfg["algo"]["sft_checkpoint"])
    cfg["algo"]["num_generation_steps"] = 8                          # the test's time; the rows are the point
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    both = fp.evaluate_policy(run, 2, "base", base=True)
    greedy = fp.evaluate_policy(run, 2, "base", base=True, sampled=False)
    assert both["kinds"] == ["heldout_values", "heldout_forms", "sampled/heldout_values", "sampled/heldout_forms"]
    assert greedy["kinds"] == ["heldout_values", "heldout_forms"]
    assert greedy["task_ids"] == both["task_ids"][:2] == both["task_ids"][2:]
    for k in ("task_ids", "kinds", *fp.METRICS):
        assert fp.greedy_part(both)[k] == greedy[k], k
