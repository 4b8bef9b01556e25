"""A forms scorer serves the tasks of a file in FormFactory's layout (``env.kwargs.task_file``) in
a real browser."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from flowrl_ray.envs.forms import FormsSettings, gold_actions
from unit.envs.test_forms_task_file import CATALOG, _gold_record, _write


@pytest.mark.slow
def test_a_scorer_serves_the_file_tasks_in_the_browser(tmp_path):
    from flowrl_ray.envs.forms import FormsScorer
    from flowrl_ray.envs.forms.tasks import load_tasks
    task = load_tasks("rl", per_form=1, catalog=CATALOG)[0]
    path = _write(tmp_path, [json.dumps(_gold_record(task))], name="ff.jsonl")
    settings = FormsSettings.from_env_cfg(SimpleNamespace(id="train", kwargs={"task_file": str(path), "pages": 1}))
    scorer = FormsScorer(settings)
    try:
        batch = scorer.score({"ids": [0, 1], "task_ids": ["file/ff/1", "file/ff/1"],
                              "texts": [gold_actions(task, CATALOG), "click(nothing)"]})
    finally:
        scorer.close()
    assert batch["rewards"][0] == pytest.approx(1.0) and batch["field_accuracy"][0] == pytest.approx(1.0)
    assert batch["rewards"][1] < 1.0 and bool(batch["valid"][0])
