"""The optimiser step in a group of two gloo processes (torch.distributed, no Ray): the ranks'
weighted shares sum to the one-process step on the whole minibatch, and a non-finite loss on
one rank skips the step on both."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowrl_ray.optim import Accumulator, local_part, optimizer_step, reduce_sum

X = torch.linspace(-1, 1, 14).reshape(7, 2)          # 7 rows: shares of 4 and 3
Y = torch.arange(7.0)


def _model() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model, rows):
    return ((model(X[rows]).squeeze(-1) - Y[rows]) ** 2).mean()


def _rank(rank: int, world: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, opt = _model()
        part = local_part(len(X))
        rows = torch.arange(len(X))[part]
        share = len(rows) / len(X)
        norms, stepped = optimizer_step(_loss(model, rows) * share, opt, max_grad_norm=1.0)
        mean = reduce_sum(_loss(model, rows).detach() * share)       # after the step: the whole batch's
        # a non-finite loss on rank 1 only: both ranks skip (neither waits for the other)
        bad = torch.tensor(float("nan")) * model.weight.sum() if rank == 1 else _loss(model, rows) * share
        _, stepped_bad = optimizer_step(bad, opt, max_grad_norm=1.0)
        acc = Accumulator([opt], 1.0)
        acc.backward(bad)
        _, stepped_acc = acc.step()
        out[rank] = {"weight": model.weight.detach().clone(), "bias": model.bias.detach().clone(),
                     "norm": norms[0], "stepped": stepped, "mean": float(mean),
                     "stepped_bad": stepped_bad, "stepped_acc": stepped_acc, "rows": len(rows)}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_take_the_one_process_step_and_skip_together(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(2, init, out), nprocs=2, join=True)
        out = dict(out)
    model, opt = _model()
    norms, _ = optimizer_step(_loss(model, torch.arange(len(X))), opt, max_grad_norm=1.0)
    assert [out[r]["rows"] for r in (0, 1)] == [4, 3]
    for r in (0, 1):
        assert out[r]["stepped"] and out[r]["norm"] == pytest.approx(norms[0], rel=1e-6)   # clipped alike
        torch.testing.assert_close(out[r]["weight"], model.weight.detach())
        torch.testing.assert_close(out[r]["bias"], model.bias.detach())
        assert out[r]["mean"] == pytest.approx(float(_loss(model, torch.arange(len(X)))), rel=1e-6)
        assert not out[r]["stepped_bad"] and not out[r]["stepped_acc"]
