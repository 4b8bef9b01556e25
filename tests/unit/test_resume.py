"""Extending a run: learning-rate schedules re-anchored to a new train.iterations (per algorithm,
with hand-computed values) and the config rule of a resume. `train --resume` /
`--resume-if-exists` through the CLI: tests/e2e/test_resume.py."""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch

from flowrl_ray.optim import LRSchedule, load_scheduler
from flowrl_ray.config import ConfigError, config_from_dict, load_config
from flowrl_ray.envs import EnvSpec

from conftest import REPO, tiny_config


def _round_trip(state: dict) -> dict:
    """Through serialisation, as a checkpoint does."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _cos(p: float, end: float = 0.0) -> float:
    return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * p))


# ---------------------------------------------------------------------- the schedule itself

def test_linear_schedule_extended_after_its_end_goes_on_from_its_last_value():
    f = LRSchedule("linear", 4)
    assert [f(i) for i in range(4)] == [1.0, 0.75, 0.5, 0.25]
    f.extend(8, next_step=4)                      # 4 steps taken: the last (step 3) ran at 0.25
    # anchor (3, p 0.75); the remaining progress 0.25 over the 5 steps to 8: 0.05 a step
    assert f(3) == 0.25
    assert [f(i) for i in range(4, 9)] == pytest.approx([0.2, 0.15, 0.1, 0.05, 0.0])
    assert (f.anchor_step, f.anchor_progress, f.total) == (3, 0.75, 8)


def test_linear_schedule_extended_mid_run_and_twice():
    f = LRSchedule("linear", 10)
    f.extend(20, next_step=5)                     # last step 4 at 0.6 (p 0.4); 0.6 over 16 steps
    assert f(4) == pytest.approx(0.6)
    assert [f(i) for i in (5, 6, 19, 20)] == pytest.approx([0.6 - 0.6 / 16, 0.6 - 1.2 / 16, 0.6 / 16, 0.0])
    f.extend(40, next_step=12)                    # again: last step 11 at 0.6 - 7 * 0.6 / 16
    last = 0.6 - 7 * 0.6 / 16
    assert f(11) == pytest.approx(last)
    assert [f(i) for i in (12, 39, 40)] == pytest.approx([last * 28 / 29, last / 29, 0.0])


def test_cosine_with_warmup_extended_keeps_the_warmup_and_its_shape():
    f = LRSchedule("cosine", 12, warmup=2, end=0.3)
    # still warming up (1 step taken): the warm-up stays, the cosine now runs from step 2 to 22
    f.extend(22, next_step=1)
    assert [f(0), f(1), f(2)] == [0.5, 1.0, 1.0]
    assert f(12) == pytest.approx(_cos(0.5, 0.3)) and f(22) == pytest.approx(0.3)
    # after the warm-up: last step 7 at p 0.25 of the cosine; p 0.25 -> 1 over the 15 steps to 22
    g = LRSchedule("cosine", 22, warmup=2, end=0.3)
    g.extend(37, next_step=8)
    assert g(7) == pytest.approx(_cos(0.25, 0.3))
    assert [g(8), g(22), g(37)] == pytest.approx([_cos(0.25 + 0.75 / 30, 0.3), _cos(0.25 + 0.75 * 15 / 30, 0.3), 0.3])


def test_an_unchanged_total_changes_nothing_and_constant_stays_one():
    f, g = LRSchedule("cosine", 30, warmup=3, end=0.1), LRSchedule("cosine", 30, warmup=3, end=0.1)
    g.extend(30, next_step=11)
    assert all(f(i) == pytest.approx(g(i), abs=1e-15) for i in range(11, 40))
    c = LRSchedule("constant", 5, warmup=2)
    c.extend(50, next_step=5)
    assert [c(i) for i in (0, 1, 5, 49, 60)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="lr schedule"):
        LRSchedule("exponential", 5)


def test_load_scheduler_sets_the_optimisers_lr_and_words_the_change():
    def make(total):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, LRSchedule("linear", total))
    opt, sched = make(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # scheduler steps without optimiser steps
        for _ in range(4):
            sched.step()
    assert opt.param_groups[0]["lr"] == 0.0      # the end of the old schedule
    state = _round_trip(sched.state_dict())
    assert state["lr_lambdas"][0]["total"] == 4  # the total is in the checkpoint
    opt2, sched2 = make(8)
    notes = load_scheduler(sched2, state, "test lr")
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.02) and sched2.get_last_lr() == pytest.approx([0.02])
    assert notes == ["test lr schedule (iterations 4 -> 8) re-anchored after iteration 4 (lr 0.025): lr 0.02 at "
                     "iteration 5 (was 0), down to 0 over the remaining 4 iterations"]
    opt3, sched3 = make(4)                       # same total: as saved, no note
    assert load_scheduler(sched3, state, "test lr") == [] and opt3.param_groups[0]["lr"] == 0.1


# ---------------------------------------------------------------------- per algorithm

def test_ppo_linear_lr_extended_from_4_to_8_iterations():
    from flowrl_ray.algorithms.ppo import PPO
    from unit.algorithms.test_ppo_math import _synthetic_batch
    spec = EnvSpec((3,), 1)
    a = PPO(tiny_config("train.iterations=4", "algo.lr=0.01", "algo.epochs=1", "algo.minibatch_size=64"),
            spec, torch.device("cpu"))
    lrs = [a.update(a.prepare([_synthetic_batch(a, seed=i)]))["ppo/lr"] for i in range(4)]
    assert lrs == pytest.approx([0.01, 0.0075, 0.005, 0.0025])
    state = _round_trip(a.state_dict())
    longer = tiny_config("train.iterations=8", "algo.lr=0.01", "algo.epochs=1", "algo.minibatch_size=64")
    b = PPO(longer, spec, torch.device("cpu"))
    b.load_state_dict(state)
    assert b.resume_notes and "re-anchored after iteration 4 (lr 0.0025): lr 0.002 at iteration 5" in b.resume_notes[0]
    lrs = [b.update(b.prepare([_synthetic_batch(b, seed=i)]))["ppo/lr"] for i in range(4, 8)]
    # from 0.0025 (iteration 4) down by 0.0025 / 5 per iteration: no iteration at 0, no jump
    assert lrs == pytest.approx([0.002, 0.0015, 0.001, 0.0005])
    # a second resume at the same total is exact: the anchor is in the state
    c = PPO(longer, spec, torch.device("cpu"))
    c.load_state_dict(_round_trip(b.state_dict()))
    assert c.resume_notes == ()
    assert c.scheduler.state_dict()["lr_lambdas"][0]["anchor_step"] == 3
    batch = _synthetic_batch(b, seed=9)
    assert b.update(b.prepare([batch])) == c.update(c.prepare([batch]))


def _fpopp(iterations: int):
    from flowrl_ray.algorithms.fpopp import FPOPP
    from unit.algorithms.test_fpopp import tiny_cfg
    cfg = tiny_cfg(critic_warmup_iters=2, lr=1e-3, critic_lr=1e-2, lr_warmup_iters=1, lr_schedule="cosine")
    cfg.train.iterations = iterations
    return FPOPP(cfg, EnvSpec((19,), 7), torch.device("cpu"))


@pytest.mark.usefixtures("one_torch_thread")
def test_fpopp_cosine_actor_and_critic_extended_from_6_to_10_iterations():
    from unit.algorithms.test_fpopp import _rollout_batch
    a = _fpopp(6)
    rows = [a.update(a.prepare([_rollout_batch(a, seed=i)])) for i in range(6)]
    actor = [r["fpopp/actor_lr"] / 1e-3 for r in rows]
    critic = [r["fpopp/critic_lr"] / 1e-2 for r in rows]
    # the actor's schedule counts its own 4 iterations (after 2 of critic warm-up): 1 step of
    # warm-up, then the cosine over 3 steps, so its last iteration reaches p 2/3 (not 2/5)
    assert actor == pytest.approx([1, 1, 1, 1, _cos(1 / 3), _cos(2 / 3)])
    assert critic == pytest.approx([_cos(i / 6) for i in range(6)])
    b = _fpopp(10)
    b.load_state_dict(_round_trip(a.state_dict()))
    assert len(b.resume_notes) == 2 and "actor iterations 4 -> 8" in b.resume_notes[0]
    rows = [b.update(b.prepare([_rollout_batch(b, seed=i)])) for i in range(6, 10)]
    actor = [r["fpopp/actor_lr"] / 1e-3 for r in rows]
    critic = [r["fpopp/critic_lr"] / 1e-2 for r in rows]
    # actor: anchor step 3 at p 2/3, the remaining 1/3 over the 5 steps to its new total 8
    assert actor == pytest.approx([_cos(2 / 3 + k / 15) for k in range(1, 5)])
    # critic: anchor step 5 at p 5/6, the remaining 1/6 over the 5 steps to 10
    assert critic == pytest.approx([_cos(5 / 6 + k / 30) for k in range(1, 5)])
    assert min(actor + critic) > 0 and actor[0] < _cos(2 / 3) and critic[0] < _cos(5 / 6)


def test_fed_grpo_cosine_in_optimiser_steps_extended_keeps_its_warmup():
    from flowrl_ray.algorithms.fed_grpo import FEDGRPO
    from unit.algorithms.test_fed_grpo import _config

    def algo(iterations):
        data = _config(lr_schedule="cosine", warmup_steps=3, min_lr_ratio=0.2, lr=1e-3)
        data["train"]["iterations"] = iterations
        return FEDGRPO(config_from_dict(data), EnvSpec((1,), 1), torch.device("cpu"))
    a = algo(4)          # 6 rows per iteration in micro-batches of 6: 1 optimiser step each, 4 in all
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):                         # 2 steps taken: still in the 3-step warm-up
            a.scheduler.step()
    b = algo(10)
    b.load_state_dict(_round_trip(a.state_dict()))
    assert b.resume_notes == ()                    # nothing decayed yet: the warm-up goes on
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(8):
            lrs.append(b.scheduler.get_last_lr()[0] / 1e-3)
            b.scheduler.step()
    # step 2: the warm-up's last; then the cosine from step 3 to the new total 10
    assert lrs == pytest.approx([1.0] + [_cos(k / 7, 0.2) for k in range(7)])
    # extended again after the warm-up: the last step (9) ran at p 6/7; to 20 steps
    c = algo(20)
    c.load_state_dict(_round_trip(b.state_dict()))
    assert c.resume_notes and "optimiser steps 10 -> 20" in c.resume_notes[0]
    assert c.scheduler.get_last_lr()[0] / 1e-3 == pytest.approx(_cos(6 / 7 + (1 / 7) / 11, 0.2))


def test_flowsar_ema_and_cma_ppo_lrs_do_not_depend_on_the_total():
    """FlowSAR's EMA coefficient b_i = min(eta_rate i, eta_max) counts iterations (kept in its
    state) and its lr is constant; CMA-PPO's three lrs are constant: an extension changes nothing."""
    from flowrl_ray.algorithms.flowsar import FlowSAR
    from unit.algorithms.test_flowsar import SPEC, make_batch, tiny_cfg
    a = FlowSAR(tiny_cfg(), SPEC, torch.device("cpu"))
    a.iteration = 40
    longer = tiny_cfg()
    longer.train.iterations = 1000
    b = FlowSAR(longer, SPEC, torch.device("cpu"))
    b.load_state_dict(_round_trip(a.state_dict()))
    m = b.update(b.prepare([make_batch(0, ends={(5, 0): "term", (5, 1): "term"}, rewards={(5, 0): 1.0})]))
    assert m["flowsar/ema_coefficient"] == pytest.approx(0.04) and m["flowsar/lr"] == 1e-3

    from flowrl_ray.algorithms.cma_ppo import CMAPPO
    cfg = load_config(REPO / "configs" / "cma_ppo" / "pendulum.yaml", ["train.iterations=3"])
    c = CMAPPO(cfg, EnvSpec((3,), 1), torch.device("cpu"))
    cfg2 = load_config(REPO / "configs" / "cma_ppo" / "pendulum.yaml", ["train.iterations=30"])
    d = CMAPPO(cfg2, EnvSpec((3,), 1), torch.device("cpu"))
    d.load_state_dict(_round_trip(c.state_dict()))
    assert [o.param_groups[0]["lr"] for o in (d.opt_mean, d.opt_var, d.opt_value)] == \
        [cfg.algo.lr_mean, cfg.algo.lr_var, cfg.algo.lr_value]


# ---------------------------------------------------------------------- the config rule

def test_a_resume_may_change_iterations_eval_and_resources_only(tmp_path):
    from flowrl_ray.resume import check_resume, config_changes
    run = tiny_config()
    ok = tiny_config("train.iterations=30", "eval.interval=5", "runtime.checkpoint_interval=2",
                     "runtime.learner_num_gpus=0", "runtime.torch_threads=2", "runtime.num_learners=2")
    assert check_resume(run, ok, tmp_path) == {
        "eval.interval": (0, 5), "runtime.checkpoint_interval": (0, 2), "runtime.learner_num_gpus": (None, 0.0),
        "runtime.torch_threads": (1, 2), "train.iterations": (3, 30), "runtime.num_learners": (1, 2)}
    for frozen in ("algo.lr=0.5", "algo.hidden_sizes=[8, 8]", "env.id=MountainCarContinuous-v0", "seed=3",
                   "runtime.num_workers=3", "runtime.rollout_length=32"):
        key = frozen.split("=")[0]
        with pytest.raises(ConfigError) as e:
            check_resume(run, tiny_config(frozen), tmp_path)
        assert f"{key} (" in str(e.value) and "train.iterations" in str(e.value), frozen
    assert set(config_changes(run, tiny_config("algo.lr=0.5", "seed=3"))) == {"algo.lr", "seed"}
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "iter_000005.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="train.iterations.*: 4 is below the 5 iterations"):
        check_resume(run, tiny_config("train.iterations=4"), tmp_path)
