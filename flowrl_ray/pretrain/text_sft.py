"""`flowrl-ray pretrain` for Flow-GRPO configs: masked-diffusion SFT of the language model on
(prompt -> gold action script) pairs of the forms train split, the start and the KL reference of
Flow-GRPO. No Ray.

The offline default trains its tokenizer here (byte-level BPE with [MASK], on the same texts);
a config with ``algo.model.path`` fine-tunes that checkpoint (with LoRA / QLoRA when set).
The checkpoint directory (``algo.sft_checkpoint`` or ``--out``) is written to a temporary
directory next to it and renamed into place, so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flowrl_ray.config import Config, ConfigError, TextSFTPretrainConfig
from flowrl_ray.envs.forms.tasks import prompt_text

if TYPE_CHECKING:
    from flowrl_ray.models.masked_diffusion import MaskedDiffusionLM


def copy_pairs(tasks, catalog, n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` auxiliary "repeat the quoted value" pairs: a value typed into a field of one of
    ``tasks`` (names, emails, sentences, numbers, dates, ...) quoted in the prompt, the same
    value alone as the answer. They train the one skill every fill action needs: copying."""
    import random

    from flowrl_ray.envs.forms.tasks import format_value
    rng = random.Random(seed)
    values = sorted({format_value(catalog[t.form_id].field(k), v) for t in tasks
                     for k, v in t.ground_truth_fields.items()
                     if catalog[t.form_id].field(k).type in ("text", "textarea", "email", "tel", "number", "date")})
    if n <= 0 or not values:
        return []
    return [(f'Repeat the quoted value.\nValue: "{v}"\nAnswer:\n', v) for v in (rng.choice(values) for _ in range(n))]


def sft_pairs(env_cfg, tasks_per_form: int | None = None, copy_aux: float = 0.0) -> list[tuple[str, str]]:
    """(prompt, gold action script) of every task of the config's split (``env.id``; the
    training split ``train``/``rl`` maps to its SFT twin ``sft``: the same forms, other tasks).

    ``tasks_per_form`` draws that many tasks per form instead of the split's default. Tasks are
    drawn by index, so a larger count keeps the split's own tasks and adds new records from the
    same value pools: more training data, with the held-out pools and forms still unseen.
    ``copy_aux`` > 0 adds that fraction (of the task pairs) of :func:`copy_pairs`."""
    from flowrl_ray.envs.forms import FormCatalog, FormsSettings, gold_actions, load_tasks
    forms = FormsSettings.from_env_cfg(env_cfg)
    catalog = FormCatalog.load(forms.forms_dir)
    split = "sft" if env_cfg.id in ("train", "rl") else env_cfg.id    # SFT never sees the RL tasks
    tasks = load_tasks(split, seed=forms.task_seed, catalog=catalog, per_form=tasks_per_form)
    if copy_aux < 0:
        raise ValueError(f"copy_aux must be >= 0, got {copy_aux}")
    pairs = [(prompt_text(t, catalog), gold_actions(t, catalog)) for t in tasks]
    return pairs + copy_pairs(tasks, catalog, round(copy_aux * len(pairs)), seed=forms.task_seed)


def fit_sft(policy: "MaskedDiffusionLM", pairs: Sequence[tuple[str, str]], epochs: int | None,
            batch_size: int, lr: float, gen_length: int | None = None,
            max_prompt_len: int | None = None, seed: int = 0, grad_clip: float | None = 1.0,
            weight_decay: float = 0.0, progress: bool = False, steps: int | None = None,
            warmup_steps: int = 0, lr_schedule: str = "constant", min_lr_ratio: float = 0.0,
            state: dict | None = None, checkpoint_every: int = 0,
            on_checkpoint: Callable[[dict], None] | None = None, max_seconds: float = 0.0
            ) -> list[float]:
    """Masked-diffusion SFT on (instruction, gold answer text) pairs with AdamW on the
    trainable parameters (all, or the LoRA adapters).

    The budget is ``epochs`` passes over the pairs or, when ``steps`` is given (then ``epochs``
    must be None), that many optimiser steps over reshuffled passes. The learning rate follows
    ``lr_multiplier(lr_schedule, total steps, warmup_steps, min_lr_ratio)``.
    gen_length: the completion region (answers are padded with [EOS] up to it; generate with the
    same value); default: the longest answer + 1. Returns the loss of every optimiser step
    (NaN where a non-finite loss or gradient skipped the update), a resumed run's earlier steps
    included. Leaves the model in eval mode.

    Resuming: ``on_checkpoint(state)`` is called every ``checkpoint_every`` steps (0: never), when
    ``max_seconds`` (> 0) of this call have passed (then the call returns early) and at the end;
    ``state`` (tensors and plain values: the optimiser, the schedule, the random generator, the
    pass's order and place in it, the losses) passed back as ``state=`` with the same pairs and
    settings continues the run exactly where it stopped.
    """
    from flowrl_ray.models.masked_diffusion import sft_loss
    from flowrl_ray.optim import lr_multiplier, optimizer_step   # as in the RL updates

    if not pairs:
        raise ValueError("fit_sft needs at least one (prompt, answer) pair")
    if (epochs is None) == (steps is None):
        raise ValueError(f"fit_sft takes either epochs or steps, got epochs={epochs}, steps={steps}")
    ids, pmask, ans, amask = _encode_pairs(policy, pairs, gen_length, max_prompt_len)   # [N, Lp], [N, Lg]
    n = len(pairs)
    steps_per_epoch = math.ceil(n / batch_size)
    total = steps if steps is not None else epochs * steps_per_epoch
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_multiplier(lr_schedule, total, warmup_steps, min_lr_ratio))
    gen = torch.Generator().manual_seed(seed)              # pass order and masks, one stream
    losses: list[float] = []
    perm, pos = torch.zeros(0, dtype=torch.long), n       # the pass under way, batches taken from it
    if state is not None:
        if len(state["perm"]) != n:
            raise ValueError(f"the saved SFT state orders {len(state['perm'])} pairs, these are {n}")
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        gen.set_state(state["generator"])
        perm, pos, losses = state["perm"], int(state["position"]), list(state["losses"])

    def snapshot() -> dict:
        return {"optimizer": copy.deepcopy(opt.state_dict()), "scheduler": sched.state_dict(), "generator": gen.get_state(),
                "perm": perm.clone(), "position": pos, "losses": list(losses), "step": len(losses)}

    skipped, start, first = 0, time.perf_counter(), len(losses)
    policy.model.train()
    try:
        while len(losses) < total:
            if pos >= n:                       # a new pass: one randperm, as optim.minibatches draws it
                perm, pos = torch.randperm(n, generator=gen), 0
            idx = perm[pos:pos + batch_size].to(ids.device)
            pos += batch_size
            keep = pmask[idx].any(dim=0)                                      # drop all-pad columns
            loss = sft_loss(policy.model, ids[idx][:, keep], pmask[idx][:, keep], ans[idx],
                            amask[idx], policy.mask_token_id, gen)
            _, ok = optimizer_step(loss, opt, grad_clip)       # a non-finite one: skipped
            skipped += not ok
            losses.append(loss.item() if ok else float("nan"))
            sched.step()
            done = len(losses)
            if progress and (done % steps_per_epoch == 0 or done == total or done % 100 == 0):
                _print_progress(losses, total, first, steps_per_epoch, sched.get_last_lr()[0], skipped, start)
            out_of_time = max_seconds > 0 and time.perf_counter() - start >= max_seconds
            if on_checkpoint is not None and done < total and (
                    out_of_time or (checkpoint_every > 0 and done % checkpoint_every == 0)):
                on_checkpoint(snapshot())
            if out_of_time:
                break
    finally:
        policy.model.eval()
    if on_checkpoint is not None and len(losses) == total:
        on_checkpoint(snapshot())
    return losses



def _encode_pairs(policy: "MaskedDiffusionLM", pairs: Sequence[tuple[str, str]], gen_length: int | None,
                  max_prompt_len: int | None) -> tuple[torch.Tensor, ...]:
    """(prompt ids [N, Lp], prompt mask, answer ids [N, Lg] padded with [EOS], answer mask);
    gen_length None: the longest answer + 1."""
    prompts, answers = [p for p, _ in pairs], [a for _, a in pairs]
    if gen_length is None:
        gen_length = 1 + max(len(policy.tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)
    ids, pmask = policy.encode_prompts(prompts, max_prompt_len)
    ans = policy.encode_answers(answers, gen_length)
    return ids, pmask, ans, torch.ones_like(ans, dtype=torch.bool)


def _print_progress(losses: list[float], total: int, first: int, steps_per_epoch: int, lr: float, skipped: int,
                    start: float) -> None:
    """One progress line: the step, the pass, the mean finite loss of the last pass (at most 100
    steps), the learning rate, the skipped steps and the time left at this invocation's pace."""
    done, elapsed = len(losses), time.perf_counter() - start
    recent = [v for v in losses[-min(steps_per_epoch, 100):] if math.isfinite(v)]
    mean = sum(recent) / len(recent) if recent else float("nan")
    eta = elapsed / (done - first) * (total - done)
    print(f"[sft] step {done}/{total} (epoch {done / steps_per_epoch:.1f}) loss {mean:.4f} lr {lr:.2e} "
          f"skipped {skipped} ({elapsed:.1f}s, eta {eta:.1f}s)", flush=True)

#: the training state of an unfinished SFT run, beside the model in its checkpoint directory
STATE_FILE = "sft_state.pt"
#: the settings that run was started with: a resume must match them
SETTINGS_FILE = "sft_run.json"


def run(cfg: Config, p: TextSFTPretrainConfig, seed: int, progress: bool = True) -> dict:
    """``flowrl-ray pretrain`` for Flow-GRPO: the ``pretrain:`` section ``p`` (no budget given:
    2,000 steps)."""
    steps = 2000 if p.steps is None and p.epochs is None else p.steps
    return pretrain_text(cfg, out=p.out, epochs=p.epochs, steps=steps, batch_size=p.batch_size, lr=p.lr,
                         tasks_per_form=p.tasks_per_form, seed=seed, copy_aux=p.copy_aux, progress=progress,
                         init_from=p.init_from, checkpoint_every=p.checkpoint_every,
                         max_minutes=p.max_minutes, resume=p.resume)


def pretrain_text(cfg: Config, out: str | Path | None = None, epochs: int | None = None,
                  steps: int | None = None, batch_size: int = 32, lr: float = 1e-3,
                  tasks_per_form: int | None = None, warmup_steps: int | None = None,
                  lr_schedule: str = "cosine", min_lr_ratio: float = 0.1, seed: int = 0,
                  progress: bool = True, device: str | None = None, copy_aux: float = 0.0,
                  init_from: str | Path | None = None, checkpoint_every: int = 0,
                  max_minutes: float = 0.0, resume: bool = False) -> dict:
    """SFT budget: ``epochs`` passes or ``steps`` optimiser steps (one of them; see ``fit_sft``).
    The learning rate warms up over ``warmup_steps`` (default: 10 % of the steps, at most 200),
    then follows ``lr_schedule`` down to ``min_lr_ratio`` x ``lr``. ``device``: default the GPU
    when there is one. ``copy_aux``: auxiliary copy pairs per task pair (see :func:`sft_pairs`).

    ``init_from``: an SFT checkpoint directory whose weights and tokenizer start the run (the
    model trained further, with a new optimiser and schedule); none: a new tokenizer and model.
    ``checkpoint_every`` > 0 writes the checkpoint directory every that many steps, and
    ``max_minutes`` > 0 stops this invocation at the first step after that many minutes with the
    checkpoint written; an unfinished run keeps its training state there (``sft_state.pt``,
    ``sft_run.json``), and ``resume`` continues it exactly (same pairs and settings, else a
    ``ConfigError`` naming the setting). A finished run's directory holds no training state; its
    ``sft_run.json`` keeps the settings with ``finished`` and the training seconds of all invocations.
    """
    if (epochs is None) == (steps is None):
        raise ValueError(f"pretrain_text takes either epochs or steps, got epochs={epochs}, steps={steps}")
    c = cfg.algo
    out = out if out is not None else c.sft_checkpoint
    if out is None:
        raise ConfigError("config key 'algo.sft_checkpoint': where should the SFT model go? (or --out)")
    out = Path(out)
    pairs = sft_pairs(cfg.env, tasks_per_form, copy_aux=copy_aux)
    if warmup_steps is None:
        total = steps if steps is not None else epochs * math.ceil(len(pairs) / batch_size)
        warmup_steps = min(200, total // 10)
    settings = {"pairs": len(pairs), "steps": steps, "epochs": epochs, "batch_size": batch_size, "lr": lr,
                "tasks_per_form": tasks_per_form, "copy_aux": copy_aux, "warmup_steps": warmup_steps,
                "lr_schedule": lr_schedule, "min_lr_ratio": min_lr_ratio, "seed": seed,
                "init_from": None if init_from is None else str(init_from)}
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    lm, state, before_s = _start_model(cfg, out, pairs, settings, resume, init_from, seed, device, progress)
    t0 = time.perf_counter()

    def elapsed() -> float:
        return before_s + time.perf_counter() - t0

    def write(fit_state: dict) -> None:
        finished = fit_state["step"] == total_steps          # a finished run keeps how it was made, not its state
        extra = ({SETTINGS_FILE: {**settings, "finished": True, "train_s": round(elapsed(), 1)}} if finished else
                 {STATE_FILE: {**fit_state, "train_s": elapsed()}, SETTINGS_FILE: settings})
        _write_checkpoint(lm, out, fit_state["losses"], extra)

    total_steps = steps if steps is not None else epochs * math.ceil(len(pairs) / batch_size)
    losses = fit_sft(lm, pairs, epochs=epochs, steps=steps, batch_size=batch_size, lr=lr,
                     gen_length=c.gen_length, max_prompt_len=c.max_prompt_len, seed=seed,
                     warmup_steps=warmup_steps, lr_schedule=lr_schedule, min_lr_ratio=min_lr_ratio,
                     progress=progress, state=state, checkpoint_every=checkpoint_every, on_checkpoint=write,
                     max_seconds=60 * max_minutes)
    finite = [v for v in losses if v == v]
    params = sum(p.numel() for p in lm.model.parameters())
    return {"out": str(out), "pairs": len(pairs), "epochs": round(len(losses) * batch_size / len(pairs), 2),
            "steps": len(losses), "finished": len(losses) == total_steps,
            "first_loss": finite[0] if finite else None, "final_loss": finite[-1] if finite else None,
            "train_s": round(elapsed(), 1), "parameters": params, "device": str(lm.device),
            "loss_plot": str(out / "sft_loss.png") if (out / "sft_loss.png").is_file() else None}


def _start_model(cfg: Config, out: Path, pairs: list, settings: dict, resume: bool, init_from, seed: int,
                 device: str, progress: bool) -> tuple["MaskedDiffusionLM", dict | None, float]:
    """Where an SFT invocation starts -> (model, fit_sft's state or None, seconds trained before):
    the unfinished run in ``out`` (``resume``: its settings must be these, else a ConfigError
    naming the setting), an SFT checkpoint's weights and tokenizer (``init_from``), or a new
    tokenizer and model."""
    from dataclasses import asdict

    from flowrl_ray.models.masked_diffusion import build_masked_lm, load_sft_checkpoint
    from flowrl_ray.models.text_tokenizer import train_tokenizer
    model_cfg = asdict(cfg.algo.model)
    if resume and out.is_dir() and not (out / STATE_FILE).is_file():
        done = sum(1 for _ in (out / "sft_metrics.jsonl").open()) if (out / "sft_metrics.jsonl").is_file() else 0
        raise ConfigError(f"config key 'pretrain.resume': {out} holds no unfinished run (no {STATE_FILE}; "
                          f"{done} steps done); train it further with --init-from {out} and another --out")
    if resume and (out / STATE_FILE).is_file():
        saved = json.loads((out / SETTINGS_FILE).read_text())
        for key, value in settings.items():
            if saved.get(key) != value:
                raise ConfigError(f"config key 'pretrain.{key}': --resume continues the run in {out}, "
                                  f"started with {key}={saved.get(key)!r}; got {value!r}")
        lm = load_sft_checkpoint(out, model_cfg, device=device)
        state = torch.load(out / STATE_FILE, map_location="cpu", weights_only=True)
        before_s = float(state.pop("train_s"))
        if progress:
            print(f"[sft] resuming {out} at step {state['step']}", flush=True)
        return lm, state, before_s
    if init_from is not None:
        return load_sft_checkpoint(init_from, model_cfg, device=device, sft_key="pretrain.init_from"), None, 0.0
    tokenizer = None
    if model_cfg["path"] is None and model_cfg["tokenizer_path"] is None:
        tokenizer = train_tokenizer([t for pair in pairs for t in pair], model_cfg["vocab_size"])
    torch.manual_seed(seed)
    return build_masked_lm(model_cfg, tokenizer=tokenizer, seed=seed, device=device), None, 0.0


def _write_checkpoint(lm: "MaskedDiffusionLM", out: Path, losses: list[float], extra: dict) -> None:
    """The checkpoint directory ``out``, replaced whole (written next to it, then renamed): the
    model and tokenizer, the loss of every step (``sft_metrics.jsonl``; ``sft_loss.png`` where
    matplotlib is installed) and
    ``extra`` files ({name: a state dict for torch.save, or a JSON-able mapping})."""
    from flowrl_ray.plotting import plot_curves
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        lm.save(tmp)
        metrics = [{"step": i + 1, "loss": v} for i, v in enumerate(losses)]
        (tmp / "sft_metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        try:
            plot_curves({"sft": [(list(range(1, len(losses) + 1)), losses)]}, tmp / "sft_loss.png",
                        "optimiser step", "masked-diffusion SFT loss", "SFT on the forms train split")
        except ImportError as e:                 # a GPU machine without matplotlib: the numbers stay
            print(f"[sft] no sft_loss.png ({e}); sft_metrics.jsonl has the losses", flush=True)
        for name, value in extra.items():
            if name.endswith(".json"):
                (tmp / name).write_text(json.dumps(value, indent=1))
            else:
                torch.save(value, tmp / name)
        if out.exists():
            old = out.with_name(out.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
