"""Gradient clipping in whole FPO++ and FlowSAR updates (seconds each on a busy 2-core machine,
more than the unit folder's 2 s). The rest: tests/unit/algorithms/test_grad_clip.py."""

import copy

import torch

import flowrl_ray.algorithms.flowsar as flowsar_module
from flowrl_ray.algorithms.flowsar import FlowSAR
from flowrl_ray.algorithms.fpopp import FPOPP
from flowrl_ray.envs import EnvSpec

from unit.algorithms.test_flowsar import SPEC as FLOWSAR_SPEC, make_batch as flowsar_batch, tiny_cfg as flowsar_cfg
from unit.algorithms.test_fpopp import _rollout_batch as fpopp_rollout_batch, tiny_cfg as fpopp_cfg
from unit.algorithms.test_grad_clip import _old_optimizer_step, _update_with


def test_fpopp_actor_step_does_not_depend_on_the_critic_gradient():
    """vf_coef 0.5 vs 5000 makes the critic's gradient 10^4 times larger; the actor's gradient
    is the same, so with per-network clipping its weights end bit-for-bit the same. With one
    norm over both (the old step) the large critic gradient shrank every actor step."""
    spec = EnvSpec((19,), 7)
    runs = {}
    for vf_coef in (0.5, 5000.0):
        torch.manual_seed(0)                                  # the same initial actor and critic
        algo = FPOPP(fpopp_cfg(critic_warmup_iters=0, lr=1e-3, vf_coef=vf_coef, max_grad_norm=1.0),
                     spec, torch.device("cpu"))
        metrics = algo.update(algo.prepare([fpopp_rollout_batch(algo)]))
        runs[vf_coef] = (copy.deepcopy(algo.policy.state_dict()), metrics)
    (actor_a, m_a), (actor_b, m_b) = runs[0.5], runs[5000.0]
    assert m_a["fpopp/actor_steps"] > 1 and m_b["fpopp/critic_grad_norm"] > 1.0   # the critic's clip bites
    assert all(torch.equal(v, actor_b[k]) for k, v in actor_a.items())
    assert m_a["fpopp/actor_grad_norm"] == m_b["fpopp/actor_grad_norm"]
    assert m_b["fpopp/critic_grad_norm"] > 100 * m_a["fpopp/critic_grad_norm"]
    # grad_norm: both networks together, at least each one's norm
    for m in (m_a, m_b):
        assert m["fpopp/grad_norm"] >= max(m["fpopp/actor_grad_norm"], m["fpopp/critic_grad_norm"]) - 1e-9

def test_flowsar_with_its_critic_keeps_one_norm_over_policy_and_critic():
    """FlowSAR passes joint=True: with the critic_oracle side critic on, the policy and the
    critic are still clipped together, bit-for-bit as the old step did."""
    cfg = flowsar_cfg(weight_mode="critic_oracle")
    cfg.algo.max_grad_norm = 0.01                                     # small enough to bite
    batch = flowsar_batch(0, ends={(5, 0): "term", (5, 1): "term"}, rewards={(5, 0): 1.0})
    results = []
    for use_old in (False, True):
        torch.manual_seed(0)
        algo = FlowSAR(cfg, FLOWSAR_SPEC, torch.device("cpu"))
        init = copy.deepcopy(algo.policy.state_dict())

        def old_step(loss, optimizers, max_grad_norm, joint, also_sum=None):   # one learner: nothing to sum
            params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
            norm, stepped = _old_optimizer_step(loss, optimizers, params, max_grad_norm)
            return [norm], stepped

        metrics = _update_with(flowsar_module, algo, algo.prepare([batch]), old_step if use_old else None)
        results.append((copy.deepcopy(algo.policy.state_dict()), copy.deepcopy(algo.critic.state_dict()), metrics))
    (pol_new, critic_new, m_new), (pol_old, critic_old, m_old) = results
    assert m_new["flowsar/grad_norm"] > 0.01 and "flowsar/v_loss" in m_new       # the clip bit, critic on
    assert any(not torch.equal(v, init[k]) for k, v in pol_new.items())
    assert all(torch.equal(v, pol_old[k]) for k, v in pol_new.items())
    assert all(torch.equal(v, critic_old[k]) for k, v in critic_new.items())
    assert m_new["flowsar/grad_norm"] == m_old["flowsar/grad_norm"]
