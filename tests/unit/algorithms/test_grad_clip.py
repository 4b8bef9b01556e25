"""Gradient clipping in the shared optimiser step: each optimiser's parameters by their own norm.

Hand numbers first (two linear "networks" with known gradients), then what it means for the
algorithms: FPO++'s actor step no longer depends on the critic's gradient, and single-optimiser
algorithms (PPO) and CMA-PPO (one optimiser per loss) update bit-for-bit as before, and FlowSAR,
which keeps one norm over its policy and side critic, too.
"""

import copy
import math

import pytest
import torch
from torch import nn

import flowrl_ray.algorithms.cma_ppo as cma_ppo_module
import flowrl_ray.algorithms.ppo as ppo_module
from flowrl_ray.optim import optimizer_step
from flowrl_ray.algorithms.cma_ppo import CMAPPO
from flowrl_ray.algorithms.fpopp import FPOPP
from flowrl_ray.algorithms.ppo import PPO
from flowrl_ray.envs import EnvSpec

from conftest import tiny_config
from unit.algorithms.test_cma_ppo import _batch as cma_rollout_batch, _cfg as cma_cfg
from unit.algorithms.test_fpopp import _rollout_batch as fpopp_rollout_batch, tiny_cfg as fpopp_cfg
from unit.algorithms.test_ppo_math import _synthetic_batch as ppo_rollout_batch


def _old_optimizer_step(loss, optimizer, params, max_grad_norm):
    """The optimiser step before per-optimiser clipping, verbatim: one norm over ``params``."""
    optimizers = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return float("nan"), False
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    if not torch.isfinite(norm):
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        return float(norm), False
    for o in optimizers:
        o.step()
    return float(norm), True


def _two_linear_nets(actor_x=(0.06, 0.08), critic_x=(60.0, 80.0)):
    """actor, critic: Linear(2 -> 1, no bias) with zero weights and SGD(lr=1); the loss
    actor(actor_x) + critic(critic_x) has d loss / d weight = the input, so the actor's gradient
    is (0.06, 0.08) (norm 0.1) and the critic's (60, 80) (norm 100). SGD's step is -lr * grad."""
    actor, critic = nn.Linear(2, 1, bias=False), nn.Linear(2, 1, bias=False)
    for net in (actor, critic):
        nn.init.zeros_(net.weight)
    opts = [torch.optim.SGD(actor.parameters(), lr=1.0), torch.optim.SGD(critic.parameters(), lr=1.0)]
    loss = (actor(torch.tensor(actor_x)) + critic(torch.tensor(critic_x))).sum()
    return actor, critic, opts, loss


def test_each_optimiser_is_clipped_by_its_own_norm_by_hand():
    actor, critic, opts, loss = _two_linear_nets()
    norms, stepped = optimizer_step(loss, opts, max_grad_norm=1.0)
    assert stepped and norms == pytest.approx([0.1, 100.0], rel=1e-6)
    # actor: norm 0.1 < 1, its step is the unclipped one, -(0.06, 0.08)
    assert actor.weight.detach().flatten().tolist() == pytest.approx([-0.06, -0.08], rel=1e-6)
    # critic: norm 100 > 1, its gradient scaled by 1 / 100 to norm 1: the step is -(0.6, 0.8)
    assert critic.weight.detach().flatten().tolist() == pytest.approx([-0.6, -0.8], rel=1e-5)
    assert float(critic.weight.detach().norm()) == pytest.approx(1.0, rel=1e-5)


def test_one_norm_over_both_shrinks_the_actor_step_which_per_optimiser_clipping_does_not():
    """What the old step did (and ``joint=True`` still does): the joint norm
    sqrt(0.1^2 + 100^2) = 100.00005 scales the actor's step by 1 / 100.00005 too."""
    joint = math.sqrt(0.1 ** 2 + 100.0 ** 2)
    for step in (lambda loss, opts: optimizer_step(loss, opts, 1.0, joint=True),
                 lambda loss, opts: _old_optimizer_step(loss, opts, [p for o in opts for g in o.param_groups
                                                                     for p in g["params"]], 1.0)):
        actor, critic, opts, loss = _two_linear_nets()
        norms, stepped = step(loss, opts)
        assert stepped and (norms == pytest.approx([joint]) or norms == pytest.approx(joint))
        assert actor.weight.detach().flatten().tolist() == pytest.approx([-0.06 / joint, -0.08 / joint], rel=1e-5)
        assert critic.weight.detach().flatten().tolist() == pytest.approx([-60 / joint, -80 / joint], rel=1e-5)


def test_a_non_finite_gradient_in_one_optimiser_skips_the_whole_step():
    actor, critic = nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.tensor([0.0, 4.0]))
    opts = [torch.optim.SGD([actor], lr=1.0), torch.optim.SGD([critic], lr=1.0)]
    # a finite loss (sqrt(0) + sqrt(4) = 2) whose critic gradient is 1 / (2 sqrt(0)) = inf
    loss = (actor ** 2).sum() + critic.sqrt().sum()
    norms, stepped = optimizer_step(loss, opts, max_grad_norm=1.0)
    assert not stepped and math.isfinite(norms[0]) and not math.isfinite(norms[1])
    assert actor.tolist() == [1.0, 2.0] and critic.tolist() == [0.0, 4.0]      # neither moved
    assert actor.grad is None and critic.grad is None                          # nothing left to leak
    norms, stepped = optimizer_step((actor * float("nan")).sum(), opts, max_grad_norm=1.0)
    assert not stepped and len(norms) == 2 and all(math.isnan(n) for n in norms)


def test_fpopp_critic_warmup_reports_only_the_critic_norm():
    algo = FPOPP(fpopp_cfg(critic_warmup_iters=1), EnvSpec((19,), 7), torch.device("cpu"))
    m = algo.update(algo.prepare([fpopp_rollout_batch(algo)]))
    assert m["fpopp/actor_frozen"] == 1.0 and math.isnan(m["fpopp/actor_grad_norm"])
    assert m["fpopp/critic_grad_norm"] > 0 and m["fpopp/grad_norm"] == pytest.approx(m["fpopp/critic_grad_norm"])


def _update_with(module, algo, batch, old_step):
    """``algo.update`` with the module's ``optimizer_step`` replaced by ``old_step`` (or not)."""
    if old_step is None:
        return algo.update(batch)
    saved = module.optimizer_step
    module.optimizer_step = old_step
    try:
        return algo.update(batch)
    finally:
        module.optimizer_step = saved


def test_ppo_update_is_bit_for_bit_what_it_was():
    """One optimiser over policy and value: per-optimiser clipping is the old clipping. The old
    step (above, verbatim) and the new one give identical weights, with a clip that bites."""
    cfg = tiny_config("algo.epochs=3", "algo.minibatch_size=16", "algo.max_grad_norm=0.05")
    results = []
    for use_old in (False, True):
        torch.manual_seed(0)
        algo = PPO(cfg, EnvSpec((3,), 1), torch.device("cpu"))
        batch = algo.prepare([ppo_rollout_batch(algo)])

        def old_step(loss, optimizer, max_grad_norm, algo=algo, also_sum=None):   # one learner: nothing to sum
            norm, stepped = _old_optimizer_step(loss, optimizer, algo.params, max_grad_norm)
            return [norm], stepped

        metrics = _update_with(ppo_module, algo, batch, old_step if use_old else None)
        results.append((copy.deepcopy(algo.state_dict()["policy"]), copy.deepcopy(algo.value_net.state_dict()),
                        metrics))
    (pol_new, val_new, m_new), (pol_old, val_old, m_old) = results
    assert m_new["ppo/grad_norm"] > 0.05                              # the clip bit
    assert all(torch.equal(v, pol_old[k]) for k, v in pol_new.items())
    assert all(torch.equal(v, val_old[k]) for k, v in val_new.items())
    assert m_new == m_old


def test_cma_ppo_update_is_bit_for_bit_what_it_was():
    """CMA-PPO steps its mean, variance and value networks each with its own loss and
    optimiser: each was always clipped by its own norm, so nothing changes."""
    cfg = cma_cfg("algo.normalize_obs=false", "algo.max_grad_norm=0.01")
    states = []
    for use_old in (False, True):
        torch.manual_seed(0)
        algo = CMAPPO(cfg, EnvSpec((3,), 1), torch.device("cpu"))
        init = copy.deepcopy(algo.policy.state_dict())

        def old_step(loss, optimizer, max_grad_norm):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            norm, stepped = _old_optimizer_step(loss, optimizer, params, max_grad_norm)
            return [norm], stepped

        for seed in range(2):
            _update_with(cma_ppo_module, algo, algo.prepare([cma_rollout_batch(algo, seed)]),
                         old_step if use_old else None)
        states.append(copy.deepcopy(algo.policy.state_dict()))
    assert all(torch.equal(v, states[1][k]) for k, v in states[0].items())
    assert any(not torch.equal(v, init[k]) for k, v in states[0].items())   # and the update moved them
