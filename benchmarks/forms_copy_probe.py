"""Can the forms model learn to copy at all, and how fast? A probe of the SFT's hardest skill.

The masked-diffusion model of a Flow-GRPO config (its size, its tokenizer trained on the SFT
pairs) is trained on the auxiliary "repeat the quoted value" pairs alone (:func:`copy_pairs` of
the SFT task set: names, emails, sentences, numbers, dates ...), with short sequences
(``--prompt-len`` / ``--gen-len`` tokens), and after every ``--eval-every`` steps it decodes
(greedy) values of the evaluation task set, which it never saw, and as many of its own training
values; reported against the optimiser steps and seconds: the fraction copied exactly, with a 95 %
bootstrap interval, and the token accuracy (answer tokens equal to the value's token at the same
position), for unseen and for training values. Unseen values copied as well as training ones
mean the model copies; training values far ahead mean it memorises them.

    .venv/bin/python benchmarks/forms_copy_probe.py                      # forms_small's model
    .venv/bin/python benchmarks/forms_copy_probe.py --steps 3000 --eval-every 500

Full SFT pairs are ~700 tokens, of which a copied value is a few; here every answer token is a
copied one. If the model copies here within a few hundred steps but not after 2,000 full SFT
steps, copying is learnable by this model and the full SFT does not spend enough of its signal on
it. Results: ``benchmarks/results/<output>.{json,md}``. No assertion is made.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS_DIR, git_revision, machine_info, md_table,  # noqa: E402
                     write_json, write_results)

CONFIG = "configs/flow_grpo/forms_small.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--pairs", type=int, default=8000, help="training copy pairs (sft task set values)")
    p.add_argument("--eval-values", type=int, default=200, help="evaluation-set values decoded per check")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default="forms_copy_probe")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides, e.g. algo.model.tie_embeddings=false")
    return p.parse_args(argv)


def token_accuracy(encode, outputs: list[str], values: list[str]) -> float:
    """Mean over values of the fraction of the value's tokens (``encode(str) -> ids``) that the
    output has at the same position; an empty value counts 1 when the output is empty too."""
    scores = []
    for out, value in zip(outputs, values, strict=True):
        o, v = encode(out), encode(value)
        scores.append(sum(a == b for a, b in zip(o, v)) / len(v) if v else float(not o))
    return sum(scores) / len(scores) if scores else float("nan")


def exact_copies(outputs: list[str], values: list[str]) -> list[float]:
    """1.0 where the output is the value exactly, else 0.0."""
    return [float(o == v) for o, v in zip(outputs, values, strict=True)]


def main(argv=None) -> dict:
    import numpy as np
    import torch

    from flowrl_ray.config import apply_overrides, config_from_dict, read_yaml
    from flowrl_ray.envs.forms import FormCatalog, FormsSettings, load_tasks
    from flowrl_ray.models.masked_diffusion import build_masked_lm
    from flowrl_ray.pretrain.text_sft import fit_sft
    from flowrl_ray.models.text_tokenizer import train_tokenizer
    from flowrl_ray.pretrain.text_sft import copy_pairs, sft_pairs
    from flowrl_ray.stats import paired_bootstrap_gain

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = config_from_dict(apply_overrides(read_yaml(args.config), args.overrides))
    forms = FormsSettings.from_env_cfg(cfg.env)
    catalog = FormCatalog.load(forms.forms_dir)
    texts = [t for pair in sft_pairs(cfg.env) for t in pair]          # the SFT's own tokenizer corpus
    tokenizer = train_tokenizer(texts, cfg.algo.model.vocab_size)
    sft_tasks = load_tasks("sft", seed=forms.task_seed, catalog=catalog, per_form=200)
    eval_tasks = load_tasks("eval", seed=forms.task_seed, catalog=catalog)
    train = copy_pairs(sft_tasks, catalog, args.pairs, seed=args.seed)
    held = copy_pairs(eval_tasks, catalog, args.eval_values, seed=args.seed + 1)
    lm = build_masked_lm({**asdict(cfg.algo.model), "max_len": args.prompt_len + args.gen_len},
                         tokenizer=tokenizer, seed=args.seed)
    rows, curve, t0, done = [], [], time.perf_counter(), 0

    seen = train[:len(held)]

    def decode(pairs):
        outs = []
        for i in range(0, len(pairs), 50):
            outs += lm.generate_text([p for p, _ in pairs[i:i + 50]], args.gen_len, steps=args.gen_len // 2,
                                     temperature=0.0, max_prompt_len=args.prompt_len)
        return [o.strip() for o in outs]

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def check() -> None:
        outs, outs_seen = decode(held), decode(seen)
        held_values, seen_values = [v for _, v in held], [v for _, v in seen]
        right = np.array(exact_copies(outs, held_values))
        ci = paired_bootstrap_gain(right[None], np.zeros_like(right), n_boot=2000)
        curve.append({"step": done, "seconds": round(time.perf_counter() - t0, 1), "copy_accuracy": float(right.mean()),
                      "ci_low": float(ci["ci_low"]), "ci_high": float(ci["ci_high"]),
                      "token_accuracy": token_accuracy(encode, outs, held_values),
                      "seen_copy_accuracy": float(np.mean(exact_copies(outs_seen, seen_values))),
                      "seen_token_accuracy": token_accuracy(encode, outs_seen, seen_values),
                      "examples": [(v, o) for o, (_, v) in list(zip(outs, held))[:3]]})
        c = curve[-1]
        print(f"[probe] step {done}: exact copies {right.mean():.3f} [{ci['ci_low']:.3f}, {ci['ci_high']:.3f}], "
              f"tokens {c['token_accuracy']:.3f}; training values {c['seen_copy_accuracy']:.3f} / "
              f"{c['seen_token_accuracy']:.3f}; e.g. {c['examples'][0]}", flush=True)

    random.seed(args.seed)
    while done < args.steps:
        n = min(args.eval_every, args.steps - done)
        fit_sft(lm, train, epochs=None, steps=n, batch_size=args.batch_size, lr=args.lr, gen_length=args.gen_len,
                max_prompt_len=args.prompt_len, seed=args.seed + done)
        done += n
        check()
    for c in curve:
        rows.append([c["step"], f"{c['seconds'] / 60:.1f}", f"{c['copy_accuracy']:.3f} [{c['ci_low']:.3f}, {c['ci_high']:.3f}]",
                     f"{c['token_accuracy']:.3f}", f"{c['seen_copy_accuracy']:.3f} / {c['seen_token_accuracy']:.3f}",
                     f"`{c['examples'][0][0]}` -> `{c['examples'][0][1]}`"])
    body = (f"Model of `{args.config}`{' with ' + ' '.join(args.overrides) if args.overrides else ''} ({sum(p.numel() for p in lm.model.parameters()):,} parameters), trained on "
            f"{len(train):,} copy pairs of the SFT task set's values, {args.prompt_len} + {args.gen_len} tokens, "
            f"batch {args.batch_size}, lr {args.lr} (constant within each segment of {args.eval_every} steps); greedy "
            f"decoding of {len(held)} values of the evaluation task set with {args.gen_len // 2} unmasking steps; "
            f"exact copies with 95 % bootstrap intervals.\n\n"
            + md_table(["optimiser steps", "minutes", "unseen: exact copies [95 % CI]", "unseen: token accuracy",
                        "training values: exact / tokens", "example (value -> output)"], rows) + "\n")
    write_results(args.output, "Forms: can the model learn to copy?", body)
    results = {"args": vars(args), "machine": machine_info(), "git": git_revision(), "curve": curve}
    write_json(RESULTS_DIR / f"{args.output}.json", results)
    return results


if __name__ == "__main__":
    main()
