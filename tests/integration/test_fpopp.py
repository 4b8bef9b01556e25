"""FPO++ updates over several iterations (seconds each on a busy 2-core machine, more than the
unit folder's 2 s): critic warm-up, the actor's lr warm-up, target KL, exact resume. The losses,
ratios and objectives: tests/unit/algorithms/test_fpopp.py."""

import copy

import pytest
import torch

from flowrl_ray.algorithms.fpopp import FPOPP
from flowrl_ray.envs import EnvSpec

from unit.algorithms.test_fpopp import _rollout_batch, tiny_cfg


def test_update_freezes_the_actor_during_critic_warmup_then_moves_it():
    cfg = tiny_cfg(critic_warmup_iters=1, lr=1e-3)
    algo = FPOPP(cfg, EnvSpec((19,), 7), torch.device("cpu"))
    actor0 = copy.deepcopy(algo.policy.state_dict())
    critic0 = copy.deepcopy(algo.critic.state_dict())
    m = algo.update(algo.prepare([_rollout_batch(algo)]))
    assert m["fpopp/actor_frozen"] == 1.0 and "pg_loss" not in m
    assert all(torch.equal(v, algo.policy.state_dict()[k]) for k, v in actor0.items())
    assert any(not torch.equal(v, algo.critic.state_dict()[k]) for k, v in critic0.items())
    m = algo.update(algo.prepare([_rollout_batch(algo, seed=2)]))
    assert m["fpopp/actor_frozen"] == 0.0
    assert any(not torch.equal(v, algo.policy.state_dict()[k]) for k, v in actor0.items())
    for key in ("pg_loss", "v_loss", "ratio_mean", "ratio_std", "ratio_min", "ratio_max", "clipfrac",
                "approx_kl", "cfm_loss_new_mean", "cfm_loss_old_mean", "cfm_clamped_frac"):
        assert key in m and m[key] == m[key], key                     # present and not NaN

def test_actor_lr_warms_up_over_its_own_iterations_and_the_critics_does_not():
    cfg = tiny_cfg(critic_warmup_iters=1, lr=1e-3, critic_lr=1e-2, lr_warmup_iters=4)
    algo = FPOPP(cfg, EnvSpec((19,), 7), torch.device("cpu"))
    actor_lrs, critic_lrs = [], []
    for i in range(6):
        m = algo.update(algo.prepare([_rollout_batch(algo, seed=i)]))
        actor_lrs.append(m["fpopp/actor_lr"])
        critic_lrs.append(m["fpopp/critic_lr"])
    # Iteration 0 is the critic warm-up (the actor's schedule does not move); then 1/4, 2/4, 3/4, 1.
    assert actor_lrs == pytest.approx([2.5e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert critic_lrs == pytest.approx([1e-2] * 6)

def test_target_kl_stops_the_actor_and_the_critic_goes_on():
    cfg = tiny_cfg(critic_warmup_iters=0, lr=3e-2, epochs=20, target_kl=1e-4, minibatch_size=32)
    algo = FPOPP(cfg, EnvSpec((19,), 7), torch.device("cpu"))
    m = algo.update(algo.prepare([_rollout_batch(algo)]))
    # 32 samples = 1 minibatch per epoch: the first step is on policy (KL 0), the second is past
    # the target, so the actor takes 2 steps and the critic all 20
    assert m["fpopp/early_stopped"] == 1.0 and m["fpopp/actor_steps"] == 2 and m["fpopp/critic_steps"] == 20
    m = algo.update(algo.prepare([_rollout_batch(algo, seed=3)]))
    assert m["fpopp/actor_steps"] >= 1

def test_state_dict_round_trip():
    cfg = tiny_cfg(critic_warmup_iters=0)
    a = FPOPP(cfg, EnvSpec((19,), 7), torch.device("cpu"))
    a.update(a.prepare([_rollout_batch(a)]))
    b = FPOPP(cfg, EnvSpec((19,), 7), torch.device("cpu"))
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    batch = _rollout_batch(a, seed=5)
    ma, mb = a.update(a.prepare([batch])), b.update(b.prepare([batch]))
    assert ma["pg_loss"] == mb["pg_loss"] and ma["v_loss"] == mb["v_loss"]
    assert all(torch.equal(v, b.policy.state_dict()[k]) for k, v in a.policy.state_dict().items())
