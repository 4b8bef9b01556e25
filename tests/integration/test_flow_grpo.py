"""Flow-GRPO's updates on a tiny masked-diffusion model (seconds each on a busy 2-core machine,
more than the unit folder's 2 s): behaviour log-probs and ratios of one, the update's
directions, minibatches and step subsampling, invalid episodes, a non-finite loss, the KL
estimator. The math and the checks: tests/unit/algorithms/test_flow_grpo.py."""

import math

import numpy as np
import pytest
import torch

from flowrl_ray.algorithms.flow_grpo import FlowGRPO, k3_kl
from flowrl_ray.batch import Batch, BatchMeta

from unit.algorithms.test_flow_grpo import TINY_MODEL, _algorithm, sft_dir  # noqa: F401 (a fixture)


def _scored(algo: FlowGRPO, chunks: list[dict], rewards: list[float]) -> list[Batch]:
    ids = np.concatenate([c["ids"] for c in chunks])
    r = np.asarray(rewards, np.float32)[ids]
    zeros = np.zeros_like(r)
    data = {"ids": ids, "rewards": r, "task_completion": zeros, "field_accuracy": r,
            "execution_completeness": zeros, "unparseable_lines": zeros}
    return [Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=len(ids)))]

def test_recorded_behaviour_log_probs_give_first_epoch_ratios_of_one(sft_dir):
    from flowrl_ray.models.masked_diffusion import trajectory_log_probs
    algo = _algorithm(sft_dir)
    chunks = algo.generate(2, "train")
    assert [c["task_ids"][0].split("/")[0] for c in chunks] == ["train", "train"]
    traj = algo.pending["trajectory"]
    steps, rows = traj["logp"].shape
    assert rows == 4 and steps == 6                       # 2 prompts x G=2, 6 unmasking steps
    algo.lm.model.train()                                 # the update's mode: dropout is 0
    recomputed = trajectory_log_probs(algo.lm.model, traj, algo.c.generation_temperature)
    # before any update rho = 1: the log-probs agree up to float32 summation order, a few ulps of
    # the step sums (up to ~150 nats here); dropout on would move them by whole nats
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(recomputed, traj["logp"], rtol=8 * eps, atol=1e-5)

@pytest.mark.parametrize("kl_estimator", ["step", "token"])
def test_tied_rewards_leave_the_model_unchanged(sft_dir, kl_estimator):
    # A = 0 for every rollout and k3's gradient is 0 while theta == ref: no update at all.
    algo = _algorithm(sft_dir, lr=1e-2, kl_estimator=kl_estimator)
    before = {k: v.clone() for k, v in algo.lm.model.state_dict().items()}
    chunks = algo.generate(1, "train")
    metrics = algo.update(algo.prepare(_scored(algo, chunks, [0.5, 0.5, 0.5, 0.5])))
    assert metrics["flow_grpo/advantage_abs_mean"] == 0.0
    after = algo.lm.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

def test_update_raises_the_log_prob_of_the_better_rollout_and_moves_away_from_the_reference(sft_dir):
    from flowrl_ray.models.masked_diffusion import trajectory_log_probs
    from flowrl_ray.utils import frozen_copy
    algo = _algorithm(sft_dir, lr=3e-3, epochs=1, kl_coeff=0.0)
    assert algo.reference is None                     # no KL term: no reference kept
    start = frozen_copy(algo.lm.model)
    chunks = algo.generate(1, "train")
    traj = algo.pending["trajectory"]
    old = traj["logp"].sum(0)                                           # [4] log pi_old(completion)
    # within each group the first rollout is rewarded: A = (+1, -1, +1, -1)
    metrics = algo.update(algo.prepare(_scored(algo, chunks, [1.0, 0.0, 1.0, 0.0])))
    assert metrics["nonzero_reward_count"] == 2 and metrics["reward_mean"] == 0.5
    with torch.no_grad():
        algo.lm.model.eval()
        new = trajectory_log_probs(algo.lm.model, traj, algo.c.generation_temperature).sum(0)
        ref = trajectory_log_probs(start, traj, algo.c.generation_temperature).sum(0)
    change = new - old
    assert change[0] > 0 and change[2] > 0 and change[1] < 0 and change[3] < 0
    assert torch.allclose(ref, old, atol=1e-5)                          # the start policy
    assert (k3_kl(new, ref) > 0).all()

def _scored_with(algo: FlowGRPO, chunks: list[dict], rewards: list[float], reasons: list[str]) -> list[Batch]:
    from flowrl_ray.envs.forms.reward import INVALID_REASONS
    [batch] = _scored(algo, chunks, rewards)
    ids = batch.data["ids"]
    batch.data["reason"] = np.array([reasons[i] for i in ids], dtype=str)
    batch.data["valid"] = np.array([reasons[i] not in INVALID_REASONS for i in ids], dtype=bool)
    return [batch]

def _lora_algorithm(sft_dir, **algo) -> FlowGRPO:
    lora = {"r": 4, "alpha": 8, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
    a = _algorithm(sft_dir, model={**TINY_MODEL, "lora": lora}, **algo)
    with torch.no_grad():                              # B = 0 at init would hide the dropout
        g = torch.Generator().manual_seed(1)
        for n, p in a.lm.model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return a

def test_ratios_are_one_at_the_start_of_an_update_with_lora_dropout(sft_dir):
    from flowrl_ray.models.masked_diffusion import trajectory_log_probs
    algo = _lora_algorithm(sft_dir, epochs=2, timestep_fraction=0.5, minibatch_groups=1)   # 2 minibatches
    drops = [m for m in algo.lm.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == 0.05 for m in drops)
    chunks = algo.generate(1, "train")
    traj = algo.pending["trajectory"]
    # the failure this guards against: recomputing in train mode, LoRA dropout on
    algo.lm.model.train()
    torch.manual_seed(0)
    noisy = torch.exp(trajectory_log_probs(algo.lm.model, traj, algo.c.generation_temperature) - traj["logp"])
    assert (noisy - 1).abs().max() > 1e-3
    # lr 0: the weights never move, so every ratio of the whole update is a start-of-update ratio
    for g in algo.opt.param_groups:
        g["lr"] = 0.0
    metrics = algo.update(algo.prepare(_scored(algo, chunks, [1.0, 0.0, 0.3, 0.0])))
    assert abs(metrics["flow_grpo/ratio_min"] - 1) < 1e-6 and abs(metrics["flow_grpo/ratio_max"] - 1) < 1e-6
    assert metrics["flow_grpo/clipfrac"] == 0.0 and abs(metrics["approx_kl"]) < 1e-12
    assert all(m.training for m in drops)              # the modes are back after the update
    assert metrics["flow_grpo/sampler_logp_gap"] < 1e-3    # the sampler's own log-probs agree (eval mode)

def test_update_plan_uses_whole_groups_and_k_of_s_steps_and_resumes_the_same_picks(sft_dir):
    algo = _algorithm(sft_dir, prompts_per_iteration=4, minibatch_groups=2, epochs=3, timestep_fraction=0.5)
    minibatches, epochs = algo._update_plan(groups=4, steps=7)
    assert len(minibatches) == 2 and len(epochs) == 3
    rows = torch.cat(minibatches).sort().values
    assert torch.equal(rows, torch.arange(8))                          # a partition of the 4 x G=2 rows
    for mb in minibatches:                                             # whole groups: pairs (2g, 2g+1)
        assert torch.equal(mb.view(-1, 2)[:, 1] - mb.view(-1, 2)[:, 0], torch.ones(2, dtype=torch.long))
        assert (mb.view(-1, 2)[:, 0] % 2 == 0).all()
    for plan in epochs:
        assert sorted(m for m, _ in plan) == [0, 1]
        assert all(len(steps) == 4 and len(set(steps)) == 4 and max(steps) < 7 for _, steps in plan)   # ceil(0.5 * 7)
        # a minibatch keeps its steps across epochs (old and reference log-probs once per step)
        assert dict(plan) == dict(epochs[0])
    assert [m for m, _ in epochs[0]] != [m for m, _ in epochs[1]] or [m for m, _ in epochs[1]] != \
        [m for m, _ in epochs[2]]                                      # the order is reshuffled
    # resume: the update generator's state is in the state_dict
    state = algo.state_dict()
    nxt = algo._update_plan(4, 7)
    resumed = _algorithm(sft_dir, prompts_per_iteration=4, minibatch_groups=2, epochs=3, timestep_fraction=0.5)
    fresh = resumed._update_plan(4, 7)
    resumed.load_state_dict(state)
    again = resumed._update_plan(4, 7)
    assert again[1] == nxt[1] and all(torch.equal(a, b) for a, b in zip(again[0], nxt[0]))
    assert fresh[1] != nxt[1]                                          # without the state: other picks
    full = _algorithm(sft_dir, timestep_fraction=1.0)._update_plan(2, 7)[1]
    assert all(steps == list(range(7)) for plan in full for _, steps in plan)

def test_update_takes_one_step_per_minibatch_per_epoch_and_reports_the_metrics(sft_dir):
    algo = _algorithm(sft_dir, prompts_per_iteration=2, minibatch_groups=1, epochs=2, timestep_fraction=0.5,
                      lr=1e-3)
    chunks = algo.generate(1, "train")
    metrics = algo.update(algo.prepare(_scored_with(algo, chunks, [1.0, 0.0, 0.0, 1.0], ["", "", "", ""])))
    assert metrics["flow_grpo/optimizer_steps"] == 4 and metrics["flow_grpo/steps"] == 6
    assert metrics["flow_grpo/steps_per_minibatch"] == 3                # ceil(0.5 * 6)
    for k in ("flow_grpo/ratio_mean", "flow_grpo/ratio_min", "flow_grpo/ratio_max", "approx_kl", "kl",
              "clipfrac", "task_completion", "field_accuracy", "execution_completeness", "invalid_episodes"):
        assert math.isfinite(metrics[k]), k
    assert metrics["flow_grpo/ratio_min"] <= metrics["flow_grpo/ratio_mean"] <= metrics["flow_grpo/ratio_max"]
    assert metrics["flow_grpo/ratio_max"] > 1.0 or metrics["flow_grpo/ratio_min"] < 1.0    # the 2nd epoch moved
    assert metrics["kl"] > 0 and metrics["invalid_episodes"] == 0

def test_invalid_episodes_are_counted_and_left_out_of_the_loss(sft_dir):
    algo = _algorithm(sft_dir, lr=1e-2)
    before = {k: v.clone() for k, v in algo.lm.model.state_dict().items()}
    chunks = algo.generate(1, "train")
    # each group has one valid member: no advantage; the invalid ones would have +-1 if counted as 0
    p = algo.prepare(_scored_with(algo, chunks, [1.0, 0.0, 0.0, 1.0], ["", "timeout", "browser_crash", ""]))
    assert torch.equal(p["advantages"], torch.zeros(4))
    metrics = algo.update(p)
    assert metrics["invalid_episodes"] == 2 and metrics["invalid/timeout"] == 1
    assert metrics["invalid/browser_crash"] == 1 and metrics["invalid/page_error"] == 0
    after = algo.lm.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)       # A = 0 and k3 = 0 at theta = ref

def test_a_non_finite_loss_skips_and_counts_the_minibatch_step(sft_dir):
    algo = _algorithm(sft_dir, lr=1e-2, epochs=2)
    before = {k: v.clone() for k, v in algo.lm.model.state_dict().items()}
    chunks = algo.generate(1, "train")
    p = algo.prepare(_scored(algo, chunks, [1.0, 0.0, 0.0, 1.0]))
    p["advantages"][0] = float("nan")
    metrics = algo.update(p)
    assert metrics["flow_grpo/skipped_updates"] == 2 == metrics["flow_grpo/optimizer_steps"]   # 1 minibatch x 2 epochs
    after = algo.lm.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)

def test_the_kl_estimator_setting_reaches_the_update(sft_dir):
    """Same seed, same batch, same rewards: the first optimiser step is the same (both penalties
    and their gradients are 0 at the reference); the second epoch's penalty, once the policy has
    moved, is the chosen estimator's, so the logged KL and the weights differ."""
    logged, weights = {}, {}
    for estimator in ("step", "token"):
        algo = _algorithm(sft_dir, lr=1e-2, kl_coeff=1.0, kl_estimator=estimator)
        chunks = algo.generate(1, "train")
        logged[estimator] = algo.update(algo.prepare(_scored(algo, chunks, [1.0, 0.0, 1.0, 0.0])))["flow_grpo/kl"]
        weights[estimator] = {k: v.clone() for k, v in algo.lm.model.state_dict().items()}
    assert logged["step"] > 0 and logged["token"] > 0 and logged["step"] != pytest.approx(logged["token"])
    assert any(not torch.equal(weights["step"][k], weights["token"][k]) for k in weights["step"])


def test_token_ratios_are_one_at_the_start_and_each_step_part_is_an_optimiser_step(sft_dir):
    algo = _algorithm(sft_dir, ratio="token", epochs=2, timestep_fraction=1.0, step_minibatches=3,
                      minibatch_groups=1)                   # 2 minibatches x 3 parts x 2 epochs
    chunks = algo.generate(1, "train")
    for g in algo.opt.param_groups:                         # lr 0: every ratio is a start-of-update one
        g["lr"] = 0.0
    metrics = algo.update(algo.prepare(_scored(algo, chunks, [1.0, 0.0, 0.3, 0.0])))
    assert metrics["flow_grpo/optimizer_steps"] == 12 and metrics["flow_grpo/steps_per_minibatch"] == 2
    assert metrics["flow_grpo/ratio_min"] == 1.0 == metrics["flow_grpo/ratio_max"]      # to the last bit
    assert metrics["flow_grpo/clipfrac"] == 0.0 and metrics["approx_kl"] == 0.0
    # the parts of an epoch are a random partition of the minibatch's steps, drawn again per epoch
    _, epochs = algo._update_plan(groups=2, steps=6)
    for plan in epochs:
        for m in (0, 1):
            parts = [steps for mb, steps in plan if mb == m]
            assert len(parts) == 3 and sorted(s for p in parts for s in p) == list(range(6))


def test_token_and_step_ratios_give_the_same_first_gradient(sft_dir, monkeypatch):
    """At rho = 1 both surrogates have the gradient sum_j A grad log p_j (sequence advantages):
    the first optimiser step of the two sees the same gradient."""
    from flowrl_ray.optim import Accumulator
    grads = {}
    step = Accumulator.step

    def recording(self):
        grads.setdefault(mode, [p.grad.clone() for p in self.optimizers[0].param_groups[0]["params"]
                                if p.grad is not None])
        return step(self)

    monkeypatch.setattr(Accumulator, "step", recording)
    for mode in ("step", "token"):
        algo = _algorithm(sft_dir, ratio=mode, epochs=1, kl_coeff=0.0)
        chunks = algo.generate(1, "train")
        algo.update(algo.prepare(_scored(algo, chunks, [1.0, 0.0, 0.2, 0.6])))
    assert len(grads["step"]) == len(grads["token"]) > 0
    for a, b in zip(grads["step"], grads["token"]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert any(a.abs().max() > 0 for a in grads["step"])


def test_a_line_update_raises_the_tokens_of_lines_credited_up_and_lowers_the_others(sft_dir):
    """advantage: line, token advantages set by hand (+1 on the first half of row 0's completion,
    -1 on row 1's, 0 elsewhere): after an update the credited tokens' log-probs at their unmasking
    steps move with the sign of their advantage."""
    algo = _algorithm(sft_dir, advantage="line", ratio="token", lr=3e-3, epochs=1, kl_coeff=0.0)
    chunks = algo.generate(1, "train")
    traj = algo.pending["trajectory"]
    p = algo.prepare(_scored(algo, chunks, [0.5, 0.5, 0.5, 0.5]))        # tied: every advantage 0
    assert torch.equal(p["token_advantages"], torch.zeros_like(p["token_advantages"]))
    half = algo.c.gen_length // 2
    p["token_advantages"][0, :half] = 1.0
    p["token_advantages"][1, :half] = -1.0

    def token_logps():
        algo.lm.model.eval()
        with torch.no_grad():
            out = torch.zeros(4, traj["unmasked"].shape[2], dtype=torch.float64)
            for s in range(traj["unmasked"].shape[0]):
                out += algo._token_log_probs(algo.lm.model, traj, s, torch.arange(4))
        return out[:, traj["prompt_len"]:]                                  # [4, Lg] each token once
    before = token_logps()
    algo.update(p)
    change = token_logps() - before
    assert change[0, :half].mean() > 0 and change[1, :half].mean() < 0
