"""Few-shot prompting of a pretrained causal language model on the forms task: what a packaged
model (:mod:`flowrl_ray.models.packaged_lm`) does with no RL and no fine-tuning, scored by the
env's own reward in Chromium (``flowrl-ray forms fewshot``).

The prompt (:func:`fewshot_prompt`): two worked examples, then the task.

- The examples are the same for every task: of the SFT split's first task on each training
  form (``load_tasks("sft", seed, per_form=1)``), the pair on two forms whose gold records
  together hold the most field types (ties: the first pair in the split's order), so that they
  show fill, select, check and click lines. SFT tasks are their own seed stream and values: an
  evaluation task is never an example.
- Each example is its ``prompt_text`` (the form's fields and the instruction, ending in
  ``Actions:``) as the user's turn and its ``gold_actions`` as the answer; then the task's
  ``prompt_text``.
- The format is the model's chat template (:data:`CHAT`): each example a user turn and an
  assistant turn, the task a user turn, the assistant's turn opened. Measured against plain text
  (the same texts, examples separated by blank lines) with SmolLM2-135M-Instruct on 8 SFT-split
  tasks (index 1 on 8 training forms; never an example, never an evaluation task), scored in
  Chromium: chat template field accuracy 0.229, task completion 0, reward 0.178, 4 of 8 scripts
  reach a click line; plain text 0.000, 0, 0.067, no script reaches a click, so nothing is
  submitted (the model repeats lines until the token limit).

Decoding: greedy, at most :data:`MAX_NEW_TOKENS` new tokens, a completion ends at the end of
the turn or EOS or at a blank line (what follows is dropped); batched with left padding and the
KV cache (:meth:`~flowrl_ray.models.packaged_lm.PackagedLM.generate`).
"""

from __future__ import annotations

import time
from itertools import combinations
from typing import Any, Callable, TextIO

import numpy as np

from flowrl_ray.envs.forms.scorer import FormsScorer, FormsSettings
from flowrl_ray.envs.forms.spec import FormCatalog
from flowrl_ray.envs.forms.tasks import FormTask, gold_actions, load_tasks, prompt_text

N_EXAMPLES = 2
#: the longest gold script of the SFT split is 163 SmolLM2 tokens (the held-out split's: 159)
MAX_NEW_TOKENS = 200
#: the prompt format (see the module docstring for the measurement that chose it)
CHAT = True
STOP = ("\n\n",)
KINDS = ("heldout_values", "heldout_forms")
METRICS = ("field_accuracy", "task_completion", "execution_completeness", "rewards")


def fewshot_examples(catalog: FormCatalog, seed: int = 0, n: int = N_EXAMPLES) -> list[FormTask]:
    """The ``n`` worked examples (SFT-split tasks on ``n`` different training forms), the same
    for the same catalog and seed; see the module docstring for the rule."""
    candidates = load_tasks("sft", seed=seed, per_form=1, catalog=catalog)
    types = [{catalog[t.form_id].field(name).type for name in t.ground_truth_fields} for t in candidates]
    best = max(combinations(range(len(candidates)), n), key=lambda pick: len(set().union(*(types[i] for i in pick))))
    return [candidates[i] for i in best]


def fewshot_prompt(task: FormTask, examples: list[FormTask], catalog: FormCatalog, lm: Any = None,
                   chat: bool = CHAT) -> str:
    """The prompt text for ``task``: the examples then the task, in ``lm``'s chat template
    (``chat``: ``lm.chat(messages)``) or as plain text (examples separated by blank lines: the
    format the chat template was measured against)."""
    if chat:
        messages = []
        for ex in examples:
            messages += [{"role": "user", "content": prompt_text(ex, catalog)},
                         {"role": "assistant", "content": gold_actions(ex, catalog)}]
        return lm.chat(messages + [{"role": "user", "content": prompt_text(task, catalog)}])
    shots = "".join(f"{prompt_text(ex, catalog)}{gold_actions(ex, catalog)}\n\n" for ex in examples)
    return shots + prompt_text(task, catalog)


def generate_fewshot(lm: Any, tasks: list[FormTask], catalog: FormCatalog, batch: int = 8, seed: int = 0,
                     chat: bool = CHAT, progress: Callable[[int], None] | None = None) -> list[str]:
    """Greedy few-shot completions (action scripts) of ``tasks`` by ``lm`` (a
    :class:`~flowrl_ray.models.packaged_lm.PackagedLM`), ``batch`` prompts per generate call;
    ``progress(done)`` after each batch."""
    examples = fewshot_examples(catalog, seed)
    out: list[str] = []
    for i in range(0, len(tasks), batch):
        prompts = [fewshot_prompt(t, examples, catalog, lm, chat) for t in tasks[i:i + batch]]
        out += lm.generate(prompts, MAX_NEW_TOKENS, stop=STOP)
        if progress is not None:
            progress(len(out))
    return out


def score_completions(tasks: list[FormTask], texts: list[str], catalog: FormCatalog,
                      settings: FormsSettings | None = None, chunk: int = 16,
                      progress: Callable[[int], None] | None = None) -> dict[str, list]:
    """Each (task, completion) executed in headless Chromium by the family's scorer and scored by
    the env's reward -> per task (lists of ``len(tasks)``): ``task_ids``, ``kinds`` and
    :data:`METRICS`, ``reasons`` ('' when judged normally) and ``valid``; ``progress(done)``
    after each ``chunk``."""
    out: dict[str, list] = {"task_ids": [t.task_id for t in tasks], "kinds": [t.split for t in tasks],
                            **{k: [] for k in (*METRICS, "reasons", "valid")}}
    with FormsScorer(settings or FormsSettings(), catalog=catalog) as scorer:
        for i in range(0, len(tasks), chunk):
            b = scorer.score({"ids": np.arange(i, min(i + chunk, len(tasks))),
                              "task_ids": out["task_ids"][i:i + chunk], "texts": texts[i:i + chunk]})
            for k in METRICS:
                out[k] += [float(x) for x in b[k]]
            out["reasons"] += [str(r) for r in b["reason"]]
            out["valid"] += [bool(v) for v in b["valid"]]
            if progress is not None:
                progress(len(out["rewards"]))
    return out


def summarise_fewshot(results: dict[str, list]) -> dict[str, dict]:
    """Per task kind (``all`` and each of :data:`KINDS` present): ``tasks`` and the mean of each
    of :data:`METRICS`, from :func:`score_completions`' per-task lists."""
    kinds = np.asarray(results["kinds"])
    out = {}
    for kind in ("all", *KINDS):
        rows = np.ones(len(kinds), bool) if kind == "all" else kinds == kind
        if rows.any():
            out[kind] = {"tasks": int(rows.sum()),
                         **{m: round(float(np.asarray(results[m])[rows].mean()), 4) for m in METRICS}}
    return out


def evaluate_fewshot(lm: Any, tasks: list[FormTask], catalog: FormCatalog, batch: int = 8, seed: int = 0,
                     settings: FormsSettings | None = None, stream: TextIO | None = None) -> dict:
    """Generate (:func:`generate_fewshot`) then score (:func:`score_completions`) ``tasks``:
    the per-task lists plus ``completions``, ``invalid`` (count), ``generation_s`` and
    ``scoring_s``. Progress lines (one per batch and per scored chunk) go to ``stream``
    (default stdout)."""
    from flowrl_ray.progress import CountProgress
    t0 = time.perf_counter()
    gen = CountProgress(len(tasks), "fewshot: generating", unit="tasks", stream=stream)
    texts = generate_fewshot(lm, tasks, catalog, batch, seed, progress=gen.update)
    t1 = time.perf_counter()
    scoring = CountProgress(len(tasks), "fewshot: scoring in Chromium", unit="tasks", stream=stream)
    results = score_completions(tasks, texts, catalog, settings, progress=scoring.update)
    t2 = time.perf_counter()
    return {**results, "completions": texts, "invalid": int(sum(not v for v in results["valid"])),
            "generation_s": round(t1 - t0, 1), "scoring_s": round(t2 - t1, 1)}
