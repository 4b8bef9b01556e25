"""The optimiser step every update shares and the learning-rate schedules: pure PyTorch, used by
the algorithms and by pretraining alike.

- :func:`optimizer_step` / :func:`clip_and_step`: backward, clip (each optimiser by its own norm),
  step; a non-finite loss or gradient skips the step (the caller counts it).
- :class:`Accumulator`: several backward passes into one such step (gradient accumulation).
- :func:`minibatches`: one shuffled pass over a batch's rows, in minibatches of index tensors.
- :func:`ema_update`: an exponential moving average of a module's weights (or of a state dict).
- :func:`dropout_off`: the log-probs of a ratio are computed with every dropout off.
- :class:`LRSchedule` / :func:`lr_multiplier` / :func:`load_scheduler`: warm-up then constant,
  linear or cosine decay, resumable and extendable.
- Data parallelism over a learner group (one process per rank, ``torch.distributed`` set up by
  the runtime): every rank holds the whole batch and draws the same minibatches; each takes its
  consecutive share of a minibatch's rows (:func:`local_part`), weights its loss by its share of
  the rows, and :func:`clip_and_step` sums the gradients over the ranks (one all-reduce) before
  clipping, so the step is the one-process step on the whole minibatch. :func:`reduce_sum` sums
  statistics the same way; a step's own statistics can ride in its gradients' all-reduce
  (``optimizer_step(..., also_sum=stats)``), one collective per step instead of two. Outside a group (world size 1) all of it is the identity.

      for idx in minibatches(m, size, generator):          # the same on every rank
          rows = idx[local_part(len(idx))]                  # this rank's share
          loss = loss_fn(rows) * (len(rows) / len(idx))     # the mean over idx, summed over ranks
          optimizer_step(loss, opt, max_grad_norm)
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn


# --------------------------------------------------------------------------- data parallelism

def world() -> tuple[int, int]:
    """(rank, world size) of this process's learner group; (0, 1) outside one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_part(n: int) -> slice:
    """This rank's rows of a minibatch of ``n`` rows: consecutive shares whose sizes differ by at
    most one (the first ``n % world`` ranks take one more). World size 1: every row."""
    rank, size = world()
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + int(rank < extra))


def reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the ranks (a new tensor; ``x`` itself outside a group)."""
    return _all_reduce(x, "SUM")


def reduce_max(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elementwise maximum over the ranks (``x`` itself outside a group)."""
    return _all_reduce(x, "MAX")


def _all_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    if world()[1] == 1:
        return x
    out = x.detach().clone()
    dist.all_reduce(out, op=getattr(dist.ReduceOp, op))
    return out


def _poison(optimizers: list[torch.optim.Optimizer]) -> None:
    """NaN gradients: in a group, a rank whose loss was not finite still joins the gradient sum,
    which is then not finite on every rank, so every rank skips the step (no extra collective)."""
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                p.grad = torch.full_like(p, float("nan"))


def _sum_gradients(params: list[torch.Tensor], also_sum: torch.Tensor | None = None) -> None:
    """Each gradient summed over the ranks, in one all-reduce of one flat buffer (a parameter
    without a gradient counts as zeros and gets the sum); ``also_sum`` (statistics of the step,
    1-D) rides in the same buffer and is overwritten with its sum."""
    if world()[1] == 1 or not params:
        return
    params = list({id(p): p for p in params}.values())          # a parameter two optimisers share: once
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    extra = [] if also_sum is None else [also_sum.detach().to(grads[0].dtype).reshape(-1)]
    flat = torch.cat([g.reshape(-1) for g in grads] + extra)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n
    if also_sum is not None:
        also_sum.copy_(flat[offset:].view_as(also_sum))


def optimizer_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
                   max_grad_norm: float | None, joint: bool = False,
                   also_sum: torch.Tensor | None = None) -> tuple[list[float], bool]:
    """Backward, clip, step (one optimiser or several, e.g. actor and critic with their own
    learning rates). A non-finite loss or gradient skips the step (the caller counts it).

    Each optimiser's parameters are clipped to ``max_grad_norm`` by their own norm (``joint``:
    all of them by one norm), see :func:`clip_and_step`. ``also_sum``: a 1-D tensor of the
    step's statistics (this rank's share), summed over a learner group's ranks in place, in the
    gradients' all-reduce (float32); untouched outside a group.
    Returns (grad norms before clipping, one per optimiser or one if ``joint``; whether the
    step was taken).
    """
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        if world()[1] == 1:
            return [float("nan")] * (1 if joint else len(optimizers)), False
        _poison(optimizers)                          # in a group: every rank skips in clip_and_step
        return clip_and_step(optimizers, max_grad_norm, joint, also_sum)
    loss.backward()
    return clip_and_step(optimizers, max_grad_norm, joint, also_sum)


def clip_and_step(optimizers: list[torch.optim.Optimizer], max_grad_norm: float | None,
                  joint: bool = False, also_sum: torch.Tensor | None = None) -> tuple[list[float], bool]:
    """Clip the gradients already in the optimisers' parameters, then step them all.

    Each optimiser's parameters (its param groups) are clipped by their own L2 norm to
    ``max_grad_norm`` (None: no clipping), so that a large critic gradient does not shrink the
    actor's step; ``joint=True`` clips all of them together by one norm (the old behaviour).
    A non-finite norm in any of them skips the whole step: no optimiser steps, the gradients
    are cleared and the caller counts the skip. In a learner group the gradients are first
    summed over the ranks (see the module docstring): every rank then clips and steps alike.

    Returns (norms before clipping: one per optimiser, or one if ``joint``; whether stepped).
    """
    limit = max_grad_norm if max_grad_norm else float("inf")   # an inf limit scales by exactly 1
    groups = [[p for g in o.param_groups for p in g["params"]] for o in optimizers]
    _sum_gradients([p for params in groups for p in params], also_sum)
    if joint:
        groups = [[p for params in groups for p in params]]
    norms = [float(torch.nn.utils.clip_grad_norm_(params, limit)) for params in groups]
    if not all(math.isfinite(n) for n in norms):
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        return norms, False
    for o in optimizers:
        o.step()
    return norms, True


class Accumulator:
    """Several backward passes into one optimiser step (Flow-GRPO's unmasking steps, FED-GRPO's
    micro-batches and denoising steps), with the rule of :func:`optimizer_step`: a non-finite loss
    poisons the step, which is then skipped and counted.

        acc = Accumulator([opt], max_grad_norm)
        for loss in losses:
            if not acc.backward(loss / n):     # non-finite: nothing more is accumulated
                break
        norms, stepped = acc.step()            # clip_and_step, or the skip; grads cleared after
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], max_grad_norm: float | None,
                 joint: bool = False):
        self.optimizers, self.max_grad_norm, self.joint = list(optimizers), max_grad_norm, joint
        self.finite = True
        self.skipped = 0            # steps skipped so far: non-finite losses or gradients

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> bool:
        """Accumulate ``loss``'s gradients; False (and nothing accumulated) once a loss of this
        step was not finite."""
        if self.finite and not torch.isfinite(loss):
            self.finite = False
        if self.finite:
            loss.backward()
        return self.finite

    def step(self) -> tuple[list[float], bool]:
        """Clip and step what was accumulated (:func:`clip_and_step`), or skip a poisoned step;
        either way the gradients are cleared and the next step starts clean.
        Returns (norms before clipping, whether stepped)."""
        if not self.finite and world()[1] > 1:
            _poison(self.optimizers)                 # in a group: every rank skips in clip_and_step
        if self.finite or world()[1] > 1:
            norms, stepped = clip_and_step(self.optimizers, self.max_grad_norm, self.joint)
        else:
            norms, stepped = [float("nan")] * (1 if self.joint else len(self.optimizers)), False
        self.skipped += not stepped
        self.finite = True
        self.zero_grad()
        return norms, stepped


def minibatches(m: int, size: int, generator: torch.Generator | None = None,
                device: torch.device | str | None = None):
    """One epoch: a permutation of ``range(m)`` drawn from ``generator`` (one ``randperm``, so the
    random stream is what every loop that shuffled this way drew) cut into consecutive index
    tensors of ``size`` rows (the last one shorter), each on ``device``."""
    perm = torch.randperm(m, generator=generator)
    if device is not None:
        perm = perm.to(device)
    for start in range(0, m, size):
        yield perm[start:start + size]


@torch.no_grad()
def ema_update(target: nn.Module | dict[str, torch.Tensor], source: nn.Module | dict[str, torch.Tensor],
               b: float) -> None:
    """``target <- b target + (1 - b) source``, in place: the parameters of two modules of the
    same architecture, or every floating-point tensor of two state dicts (other entries, such
    as integer buffers, are copied)."""
    if isinstance(target, nn.Module):
        for p_t, p_s in zip(target.parameters(), source.parameters()):
            p_t.mul_(b).add_(p_s, alpha=1.0 - b)
        return
    for k, v in source.items():
        if v.is_floating_point():
            target[k].lerp_(v, 1.0 - b)
        else:
            target[k].copy_(v)


@contextlib.contextmanager
def dropout_off(module: nn.Module):
    """Within the block every dropout module of ``module`` (``nn.Dropout`` and its kin, peft's
    LoRA dropout included) is in eval mode, whatever the module's own mode; on exit each gets
    back the mode it had. The rest of the module keeps its mode. Log-probs of a ratio are
    computed under it, so the recorded and the recomputed quantity see the same (no) dropout:
    every ratio is exactly 1 before the first step of an update."""
    drops = [m for m in module.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    modes = [m.training for m in drops]
    try:
        for m in drops:
            m.eval()
        yield module
    finally:
        for m, mode in zip(drops, modes):
            m.train(mode)


class LRSchedule:
    """The learning-rate multiplier of a ``LambdaLR``, over steps (iterations or optimiser steps):
    a linear warm-up over ``warmup`` steps, ``(step + 1) / warmup``, then ``kind`` over the
    progress p in [0, 1] of the rest, down to ``end`` at ``total`` (held after):
        constant  1          linear  end + (1 - end) (1 - p)
        cosine    end + (1 - end) (1 + cos(pi p)) / 2

    p runs linearly from an anchor (step a, progress p_a) to 1 at ``total``:
        p(step) = p_a + min(step - a, span) / span * (1 - p_a),   span = max(1, total - a)
    A new schedule is anchored at (warmup, 0). ``extend`` re-anchors it to a new total (a
    resumed run with another ``train.iterations``) from where it stands: see there.

    A callable object, not a closure, so that ``LambdaLR.state_dict`` saves its attributes
    (kind, total, anchor) and ``load_state_dict`` restores them: a checkpoint knows the total
    its schedule ran to. Use :func:`load_scheduler` to load one.
    """

    def __init__(self, kind: str, total: int, warmup: int = 0, end: float = 0.0):
        if kind not in ("constant", "linear", "cosine"):
            raise ValueError(f"lr schedule must be 'constant', 'linear' or 'cosine', got {kind!r}")
        self.kind, self.total, self.warmup, self.end = kind, total, warmup, end
        self.anchor_step, self.anchor_progress = warmup, 0.0

    def progress(self, step: int) -> float:
        """p in [0, 1] of a step at or after the anchor."""
        span = max(1, self.total - self.anchor_step)
        return self.anchor_progress + min(step - self.anchor_step, span) / span * (1.0 - self.anchor_progress)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        p = self.progress(step)
        if self.kind == "linear":
            return self.end + (1.0 - self.end) * (1.0 - p)
        return self.end + (1.0 - self.end) * 0.5 * (1.0 + math.cos(math.pi * p))

    def extend(self, total: int, next_step: int) -> None:
        """Run the rest of the schedule to ``total`` instead, ``next_step`` steps having been taken.

        The last step taken (``next_step - 1``) becomes the anchor with the progress it had:
        its value is kept, and the remaining progress (and so the rest of the shape) is
        stretched, or squeezed, over the steps up to the new total. The schedule goes on
        continuously from where it stood and reaches ``end`` only at ``total``. A warm-up
        counted in steps is kept as it is; a schedule still warming up only gets the new total.
        With an unchanged total this changes nothing (the old and the new p agree)."""
        last = next_step - 1
        if last >= max(self.warmup, self.anchor_step):
            self.anchor_progress = self.progress(last)
            self.anchor_step = last
        self.total = total


def lr_multiplier(kind: str, total_steps: int, warmup_steps: int = 0, min_ratio: float = 0.0) -> LRSchedule:
    """The :class:`LRSchedule` every algorithm's ``LambdaLR`` uses: warm-up over ``warmup_steps``,
    then ``kind`` from 1 down to ``min_ratio`` at ``total_steps``."""
    return LRSchedule(kind, total_steps, warmup_steps, min_ratio)


def load_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict, name: str,
                   unit: str = "iteration") -> list[str]:
    """Load a ``LambdaLR``'s state into a scheduler built from the current config.

    Where the config's total (``train.iterations``) differs from the one the checkpoint's
    schedule ran to, the schedule is extended (:meth:`LRSchedule.extend`) and the optimiser's
    learning rate set to the extended schedule's value at the next step; with the same total
    nothing changes (an exact resume stays bit-for-bit). ``name`` and ``unit`` (what a step
    counts) word the returned lines, one per schedule whose values changed.
    Checkpoints written before schedules were objects hold no total: they keep the config's.
    """
    totals = [getattr(f, "total", None) for f in scheduler.lr_lambdas]     # the config's
    scheduler.load_state_dict(state)
    step, notes = scheduler.last_epoch, []
    for i, (f, total) in enumerate(zip(scheduler.lr_lambdas, totals)):
        if not isinstance(f, LRSchedule) or f.total == total:
            continue
        old_total, before = f.total, f(step)
        f.extend(total, step)
        base = scheduler.base_lrs[i]
        scheduler.optimizer.param_groups[i]["lr"] = base * f(step)
        scheduler._last_lr[i] = base * f(step)
        if f.kind != "constant" and step > 0 and step >= f.warmup:
            notes.append(f"{name} schedule ({unit}s {old_total} -> {total}) re-anchored after {unit} {step} "
                         f"(lr {base * f(step - 1):.3g}): lr {base * f(step):.3g} at {unit} {step + 1} "
                         f"(was {base * before:.3g}), down to {base * f.end:.3g} over the remaining "
                         f"{total - step} {unit}s")
    return notes
