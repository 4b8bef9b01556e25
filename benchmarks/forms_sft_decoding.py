"""What the masked-diffusion SFT model writes, without the browser: for each split, the fraction
of gold actions that appear in the greedy completion (an offline proxy of field accuracy: an
action is right when its verb, label and value match the gold line exactly), at several numbers
of unmasking steps.

Run from the repository root after `flowrl-ray pretrain configs/flow_grpo/forms_small.yaml`
(a few minutes on 2 cores):

    .venv/bin/python benchmarks/forms_sft_decoding.py
    .venv/bin/python benchmarks/forms_sft_decoding.py --steps 12 48 192 --tasks 48 algo.sft_checkpoint=DIR

Per task kind (RL train, SFT, held-out values, held-out forms; ``--tasks`` tasks drawn evenly from each) and
step count: gold actions found, scripts entirely right, lines that do not parse, and the seconds
the generation took. It also counts prompts longer than ``algo.max_prompt_len`` and gold
scripts that do not fit ``algo.gen_length``: those tasks cannot be solved at all.
Results: ``benchmarks/results/<output>.md/.json``. No assertion is made.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS_DIR, git_revision, machine_info, md_table,  # noqa: E402
                     write_json, write_results)

CONFIG = "configs/flow_grpo/forms_small.yaml"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--steps", type=int, nargs="+", default=[12, 48],
                   help="unmasking steps to compare (each <= algo.gen_length)")
    p.add_argument("--tasks", type=int, default=32, help="tasks per split")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default="forms_sft_decoding")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_args()


def action_matches(completion: str, gold: str) -> tuple[int, int, int]:
    """(gold actions found in the completion, gold actions, completion lines that do not parse)."""
    from flowrl_ray.envs.forms.actions import parse_actions
    said = parse_actions(completion)
    wanted = [str(a) for a in parse_actions(gold).actions]
    written = {str(a) for a in said.actions}
    return sum(w in written for w in wanted), len(wanted), said.unparseable


def main() -> None:
    import numpy as np
    import torch

    from flowrl_ray.algorithms.flow_grpo import warn_if_cut
    from flowrl_ray.config import apply_overrides, config_from_dict, read_yaml
    from flowrl_ray.envs.forms import FormCatalog, FormsSettings, gold_actions, load_tasks
    from flowrl_ray.envs.forms.tasks import KINDS             # rl (train), sft, held-out values, held-out forms
    from flowrl_ray.models.masked_diffusion import load_sft_checkpoint
    from flowrl_ray.envs.forms import prompt_text

    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = config_from_dict(apply_overrides(read_yaml(args.config), args.overrides))
    c = cfg.algo
    forms = FormsSettings.from_env_cfg(cfg.env)
    catalog = FormCatalog.load(forms.forms_dir)
    lm = load_sft_checkpoint(c.sft_checkpoint, asdict(c.model),
                             device="cuda" if torch.cuda.is_available() else "cpu")
    results = {"args": vars(args), "machine": machine_info(), "git": git_revision(),
               "sft_checkpoint": c.sft_checkpoint, "splits": {}}
    rows = []
    for split in KINDS:
        tasks = load_tasks(split, seed=forms.task_seed, catalog=catalog)
        in_split = len(tasks)
        cut = warn_if_cut(lm, tasks, catalog, c.max_prompt_len, c.gen_length, split)
        pick = np.linspace(0, len(tasks) - 1, min(args.tasks, len(tasks))).round().astype(int)
        tasks = [tasks[i] for i in pick]
        prompts = [prompt_text(t, catalog) for t in tasks]
        golds = [gold_actions(t, catalog) for t in tasks]
        results["splits"][split] = {"tasks_in_split": in_split, "prompts_cut": cut[0], "answers_cut": cut[1],
                                    "steps": {}}
        for steps in args.steps:
            t0 = time.perf_counter()
            outs = lm.generate_text(prompts, c.gen_length, steps=steps, temperature=0.0,
                                    max_prompt_len=c.max_prompt_len, sampler=c.sampler)
            seconds = time.perf_counter() - t0
            found = total = bad = whole = 0
            for out, gold in zip(outs, golds):
                f, n, u = action_matches(out, gold)
                found, total, bad, whole = found + f, total + n, bad + u, whole + (f == n)
            entry = {"action_accuracy": found / max(total, 1), "scripts_right": whole, "tasks": len(tasks),
                     "unparseable_lines": bad, "seconds": seconds, "example": outs[0]}
            results["splits"][split]["steps"][steps] = entry
            rows.append([split, steps, f"{entry['action_accuracy']:.3f}", f"{whole}/{len(tasks)}", bad,
                         f"{seconds:.1f}"])
            print(f"[bench] {split} {steps} steps: gold actions found {entry['action_accuracy']:.3f}, "
                  f"scripts right {whole}/{len(tasks)} ({seconds:.1f} s)", flush=True)
    cut_lines = [f"- {s}: {r['prompts_cut']} of {r['tasks_in_split']} prompts longer than algo.max_prompt_len "
                 f"({c.max_prompt_len}), {r['answers_cut']} gold scripts longer than algo.gen_length "
                 f"({c.gen_length}) allows" for s, r in results["splits"].items()]
    examples = [f"- {s}, {max(args.steps)} steps: `{json.dumps(r['steps'][max(args.steps)]['example'][:240])}`"
                for s, r in results["splits"].items()]
    body = (f"SFT checkpoint `{c.sft_checkpoint}`, config `{args.config}`"
            f"{' with ' + ' '.join(args.overrides) if args.overrides else ''}; greedy decoding "
            f"(temperature 0), {c.gen_length} completion tokens.\n\n"
            + md_table(["split", "unmasking steps", "gold actions found", "scripts entirely right",
                        "unparseable lines", "generation s"], rows)
            + "\n\nTasks that cannot fit:\n\n" + "\n".join(cut_lines)
            + "\n\nFirst completion of each split (cut to 240 characters):\n\n" + "\n".join(examples) + "\n")
    write_results(args.output, "Forms SFT model: gold actions written, by unmasking steps", body)
    write_json(RESULTS_DIR / f"{args.output}.json", results)


if __name__ == "__main__":
    main()
