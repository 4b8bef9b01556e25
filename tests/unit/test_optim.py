"""The optimisation toolkit every training loop shares (flowrl_ray/optim.py, the k3 estimator in
algorithms/losses.py): minibatches, EMA, the one KL estimator, and pretraining's skip of a
non-finite step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowrl_ray.algorithms.flow_grpo import k3_kl
from flowrl_ray.algorithms.losses import approx_kl, k3
from flowrl_ray.optim import Accumulator, ema_update, minibatches


def test_minibatches_cover_every_row_once_in_the_stream_randperm_draws():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    parts = list(minibatches(10, 4, g1))
    assert [len(p) for p in parts] == [4, 4, 2]                          # the last one shorter
    assert sorted(torch.cat(parts).tolist()) == list(range(10))
    assert torch.equal(torch.cat(parts), torch.randperm(10, generator=g2))   # the same random stream
    assert torch.equal(torch.rand(1, generator=g1), torch.rand(1, generator=g2))   # ... and no more


def test_minibatches_of_an_empty_batch_yield_nothing():
    assert list(minibatches(0, 4, torch.Generator().manual_seed(0))) == []


def test_ema_update_mixes_each_parameter_by_hand():
    old, new = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        old.weight.copy_(torch.tensor([[4.0, -8.0]]))
        old.bias.fill_(1.0)
        new.weight.copy_(torch.tensor([[0.0, 8.0]]))
        new.bias.fill_(-3.0)
    ema_update(old, new, 0.25)
    # .25 old + .75 new
    assert old.weight.tolist() == [[1.0, 4.0]] and old.bias.tolist() == [-2.0]
    assert new.weight.tolist() == [[0.0, 8.0]]                      # the source is untouched


def test_ema_update_of_a_state_dict_mixes_floats_and_copies_the_rest():
    ema = {"w": torch.tensor([4.0, -8.0]), "steps": torch.tensor(1)}
    model = {"w": torch.tensor([0.0, 8.0]), "steps": torch.tensor(7)}
    ema_update(ema, model, 0.75)                                      # .75 ema + .25 model
    assert ema["w"].tolist() == [3.0, -4.0] and int(ema["steps"]) == 7
    assert model["w"].tolist() == [0.0, 8.0]


def test_k3_by_hand_and_its_two_users():
    # log r = log 2: (2 - 1) - log 2
    assert math.isclose(float(k3(torch.tensor(math.log(2.0)))), 1.0 - math.log(2.0), rel_tol=1e-6)
    assert float(k3(torch.tensor(0.0))) == 0.0                          # exactly 0 where they agree
    assert (k3(torch.linspace(-3, 3, 13)) >= 0).all()
    lr = torch.tensor([0.0, math.log(2.0)])
    assert math.isclose(float(approx_kl(lr)), (1.0 - math.log(2.0)) / 2, rel_tol=1e-6)   # the mean
    # Flow-GRPO's KL(pi || ref) from the policy's log-prob and the reference's: k3(ref - logp)
    assert torch.allclose(k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0 + math.log(2.0)])),
                          torch.tensor([1.0 - math.log(2.0)]))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\(\)` before:UserWarning")
def test_pretraining_skips_a_non_finite_step_and_counts_it(tmp_path, monkeypatch):
    """A NaN loss in behaviour cloning leaves the weights as they were and is counted in the
    epoch's row; the finite steps go on."""
    import flowrl_ray.pretrain.flow_bc as pretrain
    from flowrl_ray.models.flow import FlowPolicy

    real = FlowPolicy.bc_loss
    calls = {"n": 0}

    def bc_loss(self, *args, **kwargs):
        calls["n"] += 1
        loss = real(self, *args, **kwargs)
        return loss * float("nan") if calls["n"] == 1 else loss     # the first step is non-finite
    monkeypatch.setattr(FlowPolicy, "bc_loss", bc_loss)
    obs, actions = torch.randn(8, 3), torch.randn(8, 2, 2)
    for batch_size, steps_taken in ((8, 0), (4, 1)):
        calls["n"] = 0
        torch.manual_seed(0)
        policy = FlowPolicy(state_dim=3, action_dim=2, horizon_steps=2, hidden_sizes=[8], time_dim=4,
                            flow_steps=2)
        before = [p.detach().clone() for p in policy.parameters()]
        rows = pretrain.fit(policy, obs, actions, epochs=1, batch_size=batch_size, lr=1e-3, seed=0,
                            metrics_path=tmp_path / "m.jsonl", progress=False)
        assert rows[0]["skipped_steps"] == 1
        unchanged = all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))
        if steps_taken == 0:
            assert unchanged and math.isnan(rows[0]["loss"])         # nothing taken: no mean loss
        else:
            assert not unchanged and np.isfinite(rows[0]["loss"])   # the finite step went on


def test_accumulator_sums_gradients_into_one_clipped_step_and_skips_a_poisoned_one():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([w], lr=0.1)
    acc = Accumulator([opt], max_grad_norm=1.0)
    # d/dw of (w . [1, 0]) / 2 + (w . [0, 3]) / 2 = [0.5, 1.5]: norm sqrt(2.5), clipped to 1
    assert acc.backward((w * torch.tensor([1.0, 0.0])).sum() / 2)
    assert acc.backward((w * torch.tensor([0.0, 3.0])).sum() / 2)
    (norm,), stepped = acc.step()
    assert stepped and norm == pytest.approx(math.sqrt(2.5))
    g = torch.tensor([0.5, 1.5]) / math.sqrt(2.5)
    torch.testing.assert_close(w.detach(), torch.tensor([1.0, 2.0]) - 0.1 * g)
    assert w.grad is None                                   # cleared for the next step
    # a non-finite loss: nothing more accumulates, the step is skipped and counted, weights kept
    before = w.detach().clone()
    assert acc.backward(w.sum())
    assert not acc.backward(w.sum() * float("nan"))
    assert not acc.backward(w.sum())                         # still poisoned until the step
    (norm,), stepped = acc.step()
    assert not stepped and math.isnan(norm) and acc.skipped == 1
    torch.testing.assert_close(w.detach(), before)
    # the next step starts clean
    assert acc.backward(w.sum()) and acc.step()[1] and acc.skipped == 1


@pytest.mark.parametrize("n, world, sizes", [(10, 3, [4, 3, 3]), (64, 2, [32, 32]), (5, 1, [5]), (3, 3, [1, 1, 1])])
def test_each_rank_takes_a_consecutive_share_of_a_minibatch(n, world, sizes, monkeypatch):
    import flowrl_ray.optim as optim
    parts = []
    for rank in range(world):
        monkeypatch.setattr(optim, "world", lambda rank=rank: (rank, world))
        parts.append(optim.local_part(n))
    assert [p.stop - p.start for p in parts] == sizes
    assert [i for p in parts for i in range(p.start, p.stop)] == list(range(n))     # every row once, in order
    monkeypatch.undo()
    assert optim.local_part(n) == slice(0, n) and optim.world() == (0, 1)           # no group: every row
    x = torch.tensor([1.0, 2.0])
    assert optim.reduce_sum(x) is x
