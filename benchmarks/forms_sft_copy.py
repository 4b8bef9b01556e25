"""Does the SFT model copy what it is told? Greedy decoding on held-out evaluation tasks (never
seen by SFT or RL), scored offline against the gold action script, without the browser.

    .venv/bin/python benchmarks/forms_sft_copy.py                       # algo.sft_checkpoint of the config
    .venv/bin/python benchmarks/forms_sft_copy.py --tasks 192 --checkpoint DIR --steps 48

Reported, each with a 95 % percentile-bootstrap interval (flowrl_ray.stats, resampling the items
of that row):

- field accuracy per field type: fill text / textarea / email / tel / number / date, select
  (select and radio), check (yes/no boxes and check groups) and click (the submit button); a
  field is right when its gold action line appears exactly in the completion;
- task completion per field type: the tasks having that type whose actions of that type are all
  right, and ``all``: every gold action right;
- copy accuracy: the free-text values alone (composed names, companies, emails, sentences, ...),
  the ones that can only be right by copying them from the prompt.

Tasks: ``--tasks`` drawn evenly from the ``eval`` split (held-out values on the training forms and
the held-out forms). Results: ``<results-dir>/<output>.{json,md}`` (default
benchmarks/results/forms_sft_copy). No assertion is made.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, git_revision, machine_info, md_table, write_json  # noqa: E402

CONFIG = "configs/flow_grpo/forms_small.yaml"
FILL_TYPES = ("text", "textarea", "email", "tel", "number", "date")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--checkpoint", help="SFT checkpoint directory (default: algo.sft_checkpoint)")
    p.add_argument("--forms-dir", help="a directory of extra form spec files (*.json)")
    p.add_argument("--tasks", type=int, default=96, help="held-out evaluation tasks (>= 96 for the report)")
    p.add_argument("--steps", type=int, help="unmasking steps (default: algo.num_generation_steps)")
    p.add_argument("--batch", type=int, default=16, help="prompts per generate call")
    p.add_argument("--n-boot", type=int, default=10_000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--output", default="forms_sft_copy")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_args(argv)


def field_kind(f) -> str:
    """The row a gold field is reported under."""
    if f.type in FILL_TYPES:
        return f"fill {f.type}"
    if f.type in ("select", "radio"):
        return "select"
    return "check"


def is_free_text(f) -> bool:
    """A value that can only be right by copying it: composed free text, not a listed option."""
    return f.type in ("text", "textarea", "email") and not isinstance(f.sample, tuple)


def score_task(task, form, completion: str, catalog) -> list[tuple[str, bool, bool]]:
    """(row, right, free text) for every gold action of ``task`` (one per field value, then the click)."""
    from flowrl_ray.envs.forms.actions import format_action, parse_actions
    from flowrl_ray.envs.forms.tasks import gold_action_list
    written = {str(a) for a in parse_actions(completion).actions}
    return [(field_kind(f) if f is not None else "click", format_action(verb, *args) in written,
             f is not None and is_free_text(f))
            for f, verb, args in gold_action_list(task, catalog)]


def interval(outcomes: list[float], n_boot: int) -> dict:
    """Mean of 0/1 outcomes with its 95 % percentile-bootstrap interval."""
    from flowrl_ray.stats import mean_interval
    return mean_interval(outcomes, n_boot=n_boot, level=0.95)


def summarize(scored: list[list[tuple[str, bool, bool]]], n_boot: int) -> dict:
    """Field accuracy and task completion per row, copy accuracy of the free-text values."""
    rows = sorted({k for s in scored for k, _, _ in s})
    field, task = {}, {}
    for k in rows:
        field[k] = interval([r for s in scored for kk, r, _ in s if kk == k], n_boot)
        task[k] = interval([all(r for kk, r, _ in s if kk == k) for s in scored if any(kk == k for kk, _, _ in s)],
                           n_boot)
    task["all"] = interval([all(r for _, r, _ in s) for s in scored], n_boot)
    field["all"] = interval([r for s in scored for _, r, _ in s], n_boot)
    free = [r for s in scored for _, r, ft in s if ft]
    return {"field_accuracy": field, "task_completion": task,
            "copy_accuracy": interval(free, n_boot) if free else None}


def token_coverage(lm, cfg, tasks, catalog) -> dict:
    """How many tokens of the tasks' free-text values never occur in an SFT answer (the SFT pairs
    of the config, with its default tasks per form)."""
    from collections import Counter

    from flowrl_ray.envs.forms.tasks import format_value
    from flowrl_ray.pretrain.text_sft import sft_pairs
    tok = lm.tokenizer
    seen = Counter(t for _, a in sft_pairs(cfg.env, 200) for t in tok(a, add_special_tokens=False)["input_ids"])
    values = [format_value(f, t.ground_truth_fields[f.name]) for t in tasks for f in catalog[t.form_id].fields
              if f.name in t.ground_truth_fields and is_free_text(f)]
    ids = [tok(v, add_special_tokens=False)["input_ids"] for v in values]
    out_emb, in_emb = lm.model.get_output_embeddings(), lm.model.get_input_embeddings()
    return {"values": len(ids), "value_tokens": sum(map(len, ids)),
            "unseen_tokens": sum(seen[t] == 0 for r in ids for t in r),
            "values_with_unseen": sum(any(seen[t] == 0 for t in r) for r in ids),
            "tied": bool(out_emb is not None and out_emb.weight is in_emb.weight)}


def _fmt(e: dict | None) -> str:
    return "-" if e is None else f"{e['mean']:.3f} [{e['ci_low']:.3f}, {e['ci_high']:.3f}] (n={e['n']})"


def main(argv=None) -> dict:
    import numpy as np
    import torch

    from flowrl_ray.config import apply_overrides, config_from_dict, read_yaml
    from flowrl_ray.envs.forms import FormCatalog, FormsSettings, load_tasks
    from flowrl_ray.models.masked_diffusion import load_sft_checkpoint
    from flowrl_ray.envs.forms import prompt_text

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = config_from_dict(apply_overrides(read_yaml(args.config), args.overrides))
    c = cfg.algo
    forms = FormsSettings.from_env_cfg(cfg.env)
    catalog = FormCatalog.load(args.forms_dir or forms.forms_dir)
    checkpoint = args.checkpoint or c.sft_checkpoint
    lm = load_sft_checkpoint(checkpoint, asdict(c.model), device="cuda" if torch.cuda.is_available() else "cpu")
    steps = args.steps or c.num_generation_steps
    tasks = load_tasks("eval", seed=forms.task_seed, catalog=catalog,
                       per_form=max(8, -(-args.tasks // max(len(catalog.ids()), 1))))
    pick = np.linspace(0, len(tasks) - 1, min(args.tasks, len(tasks))).round().astype(int)
    tasks = [tasks[i] for i in pick]
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(tasks), args.batch):
        outs += lm.generate_text([prompt_text(t, catalog) for t in tasks[i:i + args.batch]], c.gen_length,
                                 steps=steps, temperature=0.0, max_prompt_len=c.max_prompt_len, sampler=c.sampler)
    seconds = time.perf_counter() - t0
    coverage = token_coverage(lm, cfg, tasks, catalog)
    scored = [score_task(t, catalog[t.form_id], o, catalog) for t, o in zip(tasks, outs)]
    summary = summarize(scored, args.n_boot)
    results = {"args": vars(args), "machine": machine_info(), "git": git_revision(), "checkpoint": str(checkpoint),
               "tasks": len(tasks), "heldout_forms_tasks": sum(t.split == "heldout_forms" for t in tasks),
               "steps": steps, "gen_length": c.gen_length, "generation_s": seconds, "token_coverage": coverage,
               **summary,
               "examples": [{"task_id": t.task_id, "completion": o} for t, o in list(zip(tasks, outs))[:3]]}
    rows = [[k, _fmt(summary["field_accuracy"][k]), _fmt(summary["task_completion"].get(k))]
            for k in summary["field_accuracy"]]
    body = (f"# Forms SFT model: does it copy what it is told?\n\nCheckpoint `{checkpoint}`, config `{args.config}`; "
            f"greedy decoding, {steps} unmasking steps, {c.gen_length} completion tokens, {len(tasks)} held-out "
            f"evaluation tasks ({results['heldout_forms_tasks']} on held-out forms), {seconds:.0f} s of generation. "
            f"Means with 95 % bootstrap intervals over the items of each row.\n\n"
            + md_table(["field type", "field accuracy", "task completion"], rows)
            + f"\n\nCopy accuracy (free-text values alone): {_fmt(summary['copy_accuracy'])}\n"
            + f"\nTokens of these tasks' free-text values that no SFT answer contains (an untied output layer never "
              f"learned to write them): {coverage['unseen_tokens']} of {coverage['value_tokens']}; values with at least "
              f"one: {coverage['values_with_unseen']} of {coverage['values']}. Output layer tied to the input "
              f"embedding: {coverage['tied']}.\n")
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.output}.md").write_text(body)
    write_json(out / f"{args.output}.json", results)
    print(body, flush=True)
    return results


if __name__ == "__main__":
    main()
