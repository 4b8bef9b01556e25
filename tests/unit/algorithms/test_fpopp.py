"""FPO++: the CFM losses, ratios and trust-region surrogates against hand computation, the
gradient paths, and the update on rollout batches (no Ray here; the CLI run is in
test_fpopp_robot.py)."""

import copy
import dataclasses

import pytest
import torch

from flowrl_ray.algorithms.fpopp import FPOPP, fpopp_objective, fpopp_ratios
from flowrl_ray.algorithms.losses import aspo_objective, ppo_clip_objective, spo_objective
from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.config import ConfigError, config_from_dict
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.flow import FlowPolicy, cfm_losses, euler_sample, random_shift, sum_rows

SPEC = EnvSpec(obs_shape=(5,), action_dim=2, max_episode_steps=50)


def tiny_cfg(**algo):
    return config_from_dict({
        "algorithm": "fpopp", "env": {"family": "robot", "id": "lift", "horizon_steps": 3, "act_steps": 2},
        "train": {"iterations": 10},
        "runtime": {"num_workers": 1, "envs_per_worker": 4, "rollout_length": 8},
        "algo": {"hidden_sizes": [32, 32], "critic_hidden_sizes": [16], "minibatch_size": 16,
                 "n_mc": 4, "flow_steps": 4, **algo}})


# ------------------------------------------------------------------ CFM losses and the sampler

def test_cfm_losses_match_hand_computation():
    # v(x, tau | o) = x + o (o broadcast over the chunk). One action, two (tau, eps) pairs.
    velocity = lambda x, tau, obs: x + obs[:, None, :]               # noqa: E731
    obs = torch.tensor([[0.5, -1.0]])                                 # [B=1, 2]
    a = torch.tensor([[[1.0, 2.0]]])                                  # [B, Ta=1, Da=2]
    taus = torch.tensor([[0.25, 1.0]])                                # [B, N=2]
    eps = torch.tensor([[[[0.0, 4.0]], [[2.0, -2.0]]]])               # [B, N, Ta, Da]
    # pair 1: x = .25*[1,2] + .75*[0,4] = [.25, 3.5]; v = [.75, 2.5]; target a - eps = [1, -2]
    #         l = (.75 - 1)^2 + (2.5 + 2)^2 = .0625 + 20.25 = 20.3125
    # pair 2: x = a = [1, 2]; v = [1.5, 1]; target = [-1, 4]; l = 2.5^2 + 3^2 = 15.25
    out = cfm_losses(velocity, obs, a, taus, eps, reduction="sum")
    assert out.shape == (1, 2)
    torch.testing.assert_close(out, torch.tensor([[20.3125, 15.25]]))
    # The default (the FPO++ paper's scale) averages over the Da = 2 action dims instead.
    torch.testing.assert_close(cfm_losses(velocity, obs, a, taus, eps), torch.tensor([[10.15625, 7.625]]))
    with pytest.raises(ValueError, match="reduction"):
        cfm_losses(velocity, obs, a, taus, eps, reduction="mean")


def test_cfm_losses_average_over_action_dims_and_sum_over_rows_by_hand():
    # v = 0: the error of each element is -(a - eps) = eps - a. Ta = 3 rows, Da = 2 dims, N = 1.
    velocity = lambda x, tau, obs: torch.zeros_like(x)               # noqa: E731
    a = torch.tensor([[[1.0, 3.0], [2.0, 0.0], [0.0, -4.0]]])        # [B=1, Ta=3, Da=2]
    eps = torch.zeros(1, 1, 3, 2)
    taus = torch.tensor([[0.5]])
    # squared errors per row: [1, 9], [4, 0], [0, 16]; row means 5, 2, 8; row sums 10, 4, 16
    torch.testing.assert_close(cfm_losses(velocity, torch.zeros(1, 1), a, taus, eps), torch.tensor([[15.0]]))
    torch.testing.assert_close(cfm_losses(velocity, torch.zeros(1, 1), a, taus, eps, reduction="sum"),
                               torch.tensor([[30.0]]))


def test_cfm_losses_count_only_the_executed_rows_by_hand():
    # v = 0 again; two chunks, Ta = 3, Da = 2, N = 2 pairs. Chunk 0 ran its act_steps = 2 rows;
    # chunk 1's episode ended after its first row.
    velocity = lambda x, tau, obs: torch.zeros_like(x)               # noqa: E731
    a = torch.tensor([[[1.0, 3.0], [2.0, 0.0], [0.0, -4.0]],
                      [[2.0, 2.0], [1.0, 1.0], [3.0, 1.0]]])          # [B=2, Ta=3, Da=2]
    eps = torch.zeros(2, 2, 3, 2)
    eps[:, 1] = 1.0                                                   # pair 1: error eps - a = 1 - a
    taus = torch.full((2, 2), 0.5)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # chunk 0 row means: pair 0 (a^2): 5, 2, (8 cut); pair 1 ((1-a)^2 = [0, 4], [1, 1]): 2, 1
    # chunk 1 row means: pair 0: 4, (1, 5 cut); pair 1 ((1-a)^2 = [1, 1]): 1
    expected = torch.tensor([[7.0, 3.0], [4.0, 1.0]])
    out = cfm_losses(velocity, torch.zeros(2, 1), a, taus, eps, row_mask=mask)
    torch.testing.assert_close(out, expected)
    rows = cfm_losses(velocity, torch.zeros(2, 1), a, taus, eps, per_row=True)
    assert rows.shape == (2, 2, 3)
    torch.testing.assert_close(sum_rows(rows, mask), expected)
    torch.testing.assert_close(sum_rows(rows), cfm_losses(velocity, torch.zeros(2, 1), a, taus, eps))


def test_cfm_losses_with_the_huber_error_by_hand():
    # The same two pairs as above, elementwise errors d: pair 1 [-.25, 4.5], pair 2 [2.5, -3].
    # delta = 1: |d| <= 1 -> d^2, else 2|d| - 1:  pair 1 .0625 + 8 = 8.0625; pair 2 4 + 5 = 9.
    velocity = lambda x, tau, obs: x + obs[:, None, :]               # noqa: E731
    obs, a = torch.tensor([[0.5, -1.0]]), torch.tensor([[[1.0, 2.0]]])
    taus, eps = torch.tensor([[0.25, 1.0]]), torch.tensor([[[[0.0, 4.0]], [[2.0, -2.0]]]])
    torch.testing.assert_close(cfm_losses(velocity, obs, a, taus, eps, huber_delta=1.0, reduction="sum"),
                               torch.tensor([[8.0625, 9.0]]))
    # A delta above every |d| is the squared error.
    torch.testing.assert_close(cfm_losses(velocity, obs, a, taus, eps, huber_delta=10.0),
                               cfm_losses(velocity, obs, a, taus, eps))


def test_a_huber_policy_records_and_recomputes_the_same_losses_but_clones_with_squared_error():
    policy = FlowPolicy(5, 2, 3, [32], n_mc=4, cfm_huber_delta=0.1)
    obs = torch.randn(8, 5)
    actions, record = policy.act(obs, generator=torch.Generator().manual_seed(0))
    recomputed = policy.cfm_losses(obs, actions, record["taus"], record["mc_eps"])
    torch.testing.assert_close(sum_rows(record["cfm_old"]), recomputed)          # ratios exactly 1
    squared = policy.cfm_losses(obs, actions, record["taus"], record["mc_eps"], huber_delta=0.0)
    assert (recomputed < squared).all()                                # untrained: errors exceed 0.1
    gen = torch.Generator().manual_seed(1)
    bc = policy.bc_loss(obs, actions, generator=gen)
    gen = torch.Generator().manual_seed(1)
    taus, eps = torch.rand(8, 1, generator=gen), torch.randn(8, 1, 3, 2, generator=gen)
    torch.testing.assert_close(bc, squared.new_tensor(float(
        policy.cfm_losses(obs, actions, taus, eps, huber_delta=0.0, reduction="sum").mean() / 6)))


def test_cfm_losses_of_the_exact_velocity_field_of_a_point_mass():
    # For data concentrated at a*, the flow's velocity is v*(x, tau) = (a* - x) / (1 - tau):
    # its CFM loss is 0 at a*, and ||v* - (a - eps)||^2 = ||(a* - a) / (1 - tau)||^2 elsewhere.
    a_star = torch.tensor([[0.3, -0.7], [0.1, 0.9]])                  # [Ta=2, Da=2]
    velocity = lambda x, tau, obs: (a_star - x) / (1 - tau)[:, None, None]   # noqa: E731
    gen = torch.Generator().manual_seed(0)
    taus = torch.rand(3, 5, generator=gen) * 0.9
    eps = torch.randn(3, 5, 2, 2, generator=gen)
    obs = torch.zeros(3, 1)
    at_star = cfm_losses(velocity, obs, a_star.expand(3, 2, 2), taus, eps)
    torch.testing.assert_close(at_star, torch.zeros(3, 5), atol=1e-5, rtol=0)
    a = a_star + 0.5
    off = cfm_losses(velocity, obs, a.expand(3, 2, 2), taus, eps)
    # each of the 4 elements errs by 0.5 / (1 - tau): the row means 0.25 / (1 - tau)^2, two rows
    torch.testing.assert_close(off, (2 * 0.25) / (1 - taus) ** 2, rtol=1e-5, atol=1e-5)
    # The Euler sampler integrates the same field to a* exactly from any start.
    x = euler_sample(lambda x, tau, o: velocity(x, tau, o), obs, torch.randn(3, 2, 2, generator=gen), 7)
    torch.testing.assert_close(x, a_star.expand(3, 2, 2), atol=1e-5, rtol=0)


def test_euler_sampler_with_a_constant_field_and_zero_sampling():
    c = torch.tensor([[0.2, -0.4]])
    x = euler_sample(lambda x, tau, o: c.expand_as(x), torch.zeros(2, 1), torch.ones(2, 1, 2), steps=10)
    torch.testing.assert_close(x, torch.ones(2, 1, 2) + c)
    policy = FlowPolicy(5, 2, 3, [16], flow_steps=4, n_mc=2)
    obs = torch.randn(6, 5)
    a1, rec1 = policy.act(obs, deterministic=True)
    a2, _ = policy.act(obs, deterministic=True)
    assert torch.equal(a1, a2) and set(rec1) == {"actions"}          # eps = 0: no noise, no MC pairs
    torch.testing.assert_close(a1, policy.sample(obs, torch.zeros(6, 3, 2)))
    a3, rec3 = policy.act(obs, generator=torch.Generator().manual_seed(1))
    assert a3.abs().max() <= 1.0 and not torch.equal(a1, a3)
    assert rec3["taus"].shape == (6, 2) and rec3["mc_eps"].shape == (6, 2, 3, 2)
    assert rec3["cfm_old"].shape == (6, 2, 3) and not rec3["cfm_old"].requires_grad     # per row


def test_random_shift_moves_whole_images_by_integer_offsets():
    img = torch.arange(36.0).view(1, 1, 6, 6).repeat(8, 1, 1, 1)
    out = random_shift(img, pad=2, generator=torch.Generator().manual_seed(0))
    assert out.shape == img.shape
    padded = torch.nn.functional.pad(img[:1], (2, 2, 2, 2), mode="replicate")[0, 0]
    crops = {(i, j): padded[i:i + 6, j:j + 6] for i in range(5) for j in range(5)}
    for k in range(8):                      # every output is one of the 25 crops
        assert any(torch.equal(out[k, 0], c) for c in crops.values())


# ------------------------------------------------------------------ ratios

def test_identical_actor_and_old_actor_give_ratios_exactly_one():
    torch.manual_seed(0)
    policy = FlowPolicy(5, 2, 3, [32, 32], n_mc=6)
    old = copy.deepcopy(policy)
    obs = torch.randn(7, 5)
    actions, record = old.act(obs, generator=torch.Generator().manual_seed(3))
    new = policy.cfm_losses(obs, actions, record["taus"], record["mc_eps"])
    for mode in ("per_sample", "averaged"):
        ratios = fpopp_ratios(sum_rows(record["cfm_old"]), new, 0.0, 5.0, mode)
        assert ratios.shape == (7, 6)
        assert torch.equal(ratios, torch.ones(7, 6))


def test_ratio_modes_and_clamps_by_hand():
    old = torch.tensor([[1.0, 3.0, 10.0]])
    new = torch.tensor([[1.5, 1.0, 0.5]])
    per = fpopp_ratios(old, new, 0.0, 0.0, "per_sample")
    torch.testing.assert_close(per, torch.exp(torch.tensor([[-0.5, 2.0, 9.5]])))
    avg = fpopp_ratios(old, new, 0.0, 0.0, "averaged")                 # mean diff = 11 / 3
    torch.testing.assert_close(avg, torch.full((1, 3), float(torch.exp(torch.tensor(11.0 / 3)))))
    diff_clamped = fpopp_ratios(old, new, 0.0, 2.0, "per_sample")       # 9.5 -> 2
    torch.testing.assert_close(diff_clamped, torch.exp(torch.tensor([[-0.5, 2.0, 2.0]])))
    loss_clamped = fpopp_ratios(old, new, 2.0, 0.0, "per_sample")       # old -> [1, 2, 2]
    torch.testing.assert_close(loss_clamped, torch.exp(torch.tensor([[-0.5, 1.0, 1.5]])))
    with pytest.raises(ValueError, match="ratio mode"):
        fpopp_ratios(old, new, 0.0, 0.0, "mean")


def test_extreme_noise_gives_finite_ratios_and_gradients():
    torch.manual_seed(0)
    policy = FlowPolicy(5, 2, 3, [32, 32], n_mc=4)
    obs, actions = torch.randn(4, 5), torch.rand(4, 3, 2) * 2 - 1
    taus = torch.rand(4, 4)
    eps = torch.full((4, 4, 3, 2), 8.0) * torch.sign(torch.randn(4, 4, 3, 2))   # 8 sigma
    with torch.no_grad():
        old = policy.cfm_losses(obs, actions, taus, eps) + 500.0       # far from the new losses
    new = policy.cfm_losses(obs, actions, taus, eps)
    ratios = fpopp_ratios(old, new, 0.0, 5.0)
    objective = fpopp_objective(ratios, torch.tensor([1.0, -1.0, 2.0, -0.5]), 0.05, use_aspo=True)
    objective.mean().backward()
    assert torch.isfinite(ratios).all() and ratios.max() <= torch.exp(torch.tensor(5.0)) + 1e-3
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)


def test_gradients_reach_the_actor_and_never_the_old_actor():
    torch.manual_seed(0)
    actor = FlowPolicy(5, 2, 3, [32], n_mc=4)
    old_actor = copy.deepcopy(actor)
    obs = torch.randn(6, 5)
    actions, record = old_actor.act(obs, generator=torch.Generator().manual_seed(0))   # old losses stored
    with torch.no_grad():                      # a step away from the old actor
        for p in actor.parameters():
            p.add_(0.01 * torch.randn_like(p))
    new = actor.cfm_losses(obs, actions, record["taus"], record["mc_eps"])
    ratios = fpopp_ratios(sum_rows(record["cfm_old"]), new, 0.0, 5.0)
    (-fpopp_objective(ratios, torch.randn(6), 0.2, use_aspo=False).mean()).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in actor.parameters())
    assert all(p.grad is None for p in old_actor.parameters())


def test_per_sample_and_averaged_ratios_give_the_same_first_gradient():
    # On-policy (all ratios 1) Eq. 9 and Eq. 10 have the same gradient (the spec's remark).
    torch.manual_seed(0)
    grads = []
    obs = torch.randn(5, 5)
    policy0 = FlowPolicy(5, 2, 3, [32], n_mc=4)
    actions, record = policy0.act(obs, generator=torch.Generator().manual_seed(0))
    adv = torch.tensor([1.0, -2.0, 0.5, 0.3, -0.1])
    for mode in ("per_sample", "averaged"):
        policy = copy.deepcopy(policy0)
        new = policy.cfm_losses(obs, actions, record["taus"], record["mc_eps"])
        fpopp_objective(fpopp_ratios(sum_rows(record["cfm_old"]), new, 0.0, 5.0, mode), adv, 0.05, False).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ surrogates

def test_ppo_spo_aspo_objectives_by_hand():
    ratio = torch.tensor([0.5, 1.0, 1.5, 2.0, 0.9])
    clip = 0.25
    pos, neg = torch.ones(5), -torch.ones(5)
    # PPO, A = 1: min(r, clip(r, .75, 1.25)) = [.5, 1, 1.25, 1.25, .9]
    torch.testing.assert_close(ppo_clip_objective(ratio, pos, clip), torch.tensor([0.5, 1.0, 1.25, 1.25, 0.9]))
    # SPO, A = -1: -r - (r - 1)^2 / (2 * .25) = -r - 2 (r - 1)^2
    spo = torch.tensor([-0.5 - 0.5, -1.0, -1.5 - 0.5, -2.0 - 2.0, -0.9 - 0.02])
    torch.testing.assert_close(spo_objective(ratio, neg, clip), spo)
    # ASPO: exactly PPO for all-positive advantages, exactly SPO for all-negative
    assert torch.equal(aspo_objective(ratio, pos, clip), ppo_clip_objective(ratio, pos, clip))
    assert torch.equal(aspo_objective(ratio, neg, clip), spo_objective(ratio, neg, clip))
    mixed = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0])
    expect = torch.where(mixed >= 0, ppo_clip_objective(ratio, mixed, clip), spo_objective(ratio, mixed, clip))
    assert torch.equal(aspo_objective(ratio, mixed, clip), expect)
    # fpopp_objective shares A over the N samples and picks ASPO or PPO
    r2 = ratio[:4].view(2, 2)
    a2 = torch.tensor([1.0, -1.0])
    torch.testing.assert_close(fpopp_objective(r2, a2, clip, True),
                               torch.stack([ppo_clip_objective(r2[0], a2[0].expand(2), clip),
                                            spo_objective(r2[1], a2[1].expand(2), clip)]))
    torch.testing.assert_close(fpopp_objective(r2, a2, clip, False), ppo_clip_objective(r2, a2[:, None].expand(2, 2), clip))


def _grad(fn, r: float, a: float, clip: float = 0.1) -> float:
    ratio = torch.tensor(r, requires_grad=True)
    fn(ratio, torch.tensor(a), clip).backward()
    return float(ratio.grad)


def test_spo_pulls_ratios_back_toward_one_for_negative_advantages():
    # A < 0, ratio > 1: ascent on SPO lowers the ratio, more strongly the further it is from 1
    # (d/dr = A - |A| (r - 1) / eps), while PPO's pessimistic min gives a constant A.
    assert _grad(spo_objective, 1.5, -1.0) == pytest.approx(-1.0 - 5.0)
    assert _grad(ppo_clip_objective, 1.5, -1.0) == pytest.approx(-1.0)
    assert _grad(spo_objective, 1.5, -1.0) < _grad(spo_objective, 1.2, -1.0) < _grad(ppo_clip_objective, 1.5, -1.0)
    # A < 0, ratio below the trust region: PPO's clip gives no gradient at all; SPO's pushes
    # the ratio up, back toward 1.
    assert _grad(ppo_clip_objective, 0.5, -1.0) == 0.0
    assert _grad(spo_objective, 0.5, -1.0) == pytest.approx(-1.0 + 5.0)
    # ASPO follows PPO for A >= 0: clipped above the trust region
    assert _grad(aspo_objective, 1.5, 1.0) == 0.0


# ------------------------------------------------------------------ the algorithm on batches

def _rollout_batch(algo: FPOPP, t: int = 8, n: int = 4, seed: int = 0) -> Batch:
    """A time-major batch as the EnvRunner writes it, from the algorithm's own policy."""
    gen = torch.Generator().manual_seed(seed)
    obs = torch.randn(t, n, 19, generator=gen)
    data = {"obs": obs.numpy(), "rewards": (torch.rand(t, n, generator=gen) > 0.7).float().numpy(),
            "terminated": torch.zeros(t, n, dtype=torch.bool).numpy(),
            "truncated": torch.zeros(t, n, dtype=torch.bool).numpy(),
            "final_obs": torch.zeros(t, n, 19).numpy(), "last_obs": torch.randn(n, 19, generator=gen).numpy()}
    records = [algo.policy.act(obs[i], generator=gen)[1] for i in range(t)]
    for k in records[0]:
        data[k] = torch.stack([r[k] for r in records]).numpy()
    return Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=t * n))


def test_buffer_shapes_after_prepare():
    cfg = tiny_cfg()
    algo = FPOPP(cfg, EnvSpec((19,), 7), torch.device("cpu"))
    b = algo.prepare([_rollout_batch(algo), _rollout_batch(algo, seed=1)])
    m = 8 * 8
    assert b["obs"].shape == (m, 19) and b["actions"].shape == (m, 3, 7)
    assert b["taus"].shape == (m, 4) and b["mc_eps"].shape == (m, 4, 3, 7) and b["cfm_old"].shape == (m, 4)
    assert b["row_mask"].shape == (m, 3)
    assert b["advantages"].shape == b["returns"].shape == b["values_old"].shape == (m,)


def test_prepare_keeps_only_the_executed_rows_in_the_old_losses_and_the_ratio():
    # Chunks of Ta = 3 with act_steps = 2: row 2 never runs; env 1's episode ends after the first
    # row of its chunk at step 2 (the env reports 1 executed row there).
    # Async mode: the worker records each row's old loss, prepare sums the executed ones.
    cfg = tiny_cfg(critic_warmup_iters=0)
    cfg.runtime = dataclasses.replace(cfg.runtime, mode="async")
    algo = FPOPP(cfg, EnvSpec((19,), 7), torch.device("cpu"))
    batch = _rollout_batch(algo)
    executed = torch.full((8, 4), 2, dtype=torch.int64)
    executed[2, 1] = 1
    batch.data["executed_rows"] = executed.numpy()
    b = algo.prepare([batch])
    cut = 2 * 4 + 1                                                   # flat index t * N + n
    mask = torch.tensor([1.0, 1.0, 0.0]).repeat(32, 1)
    mask[cut] = torch.tensor([1.0, 0.0, 0.0])
    assert torch.equal(b["row_mask"], mask)
    rows = torch.as_tensor(batch.data["cfm_old"]).reshape(32, 4, 3)   # the worker's per-row losses
    expected = rows[..., 0] + rows[..., 1]
    expected[cut] = rows[cut, :, 0]
    torch.testing.assert_close(b["cfm_old"], expected)
    # The update's new losses use the same rows: at theta = theta_old every ratio is 1.
    _, stats = algo._losses(b, torch.arange(32), torch.arange(32), True)
    assert abs(stats["ratio_min"] - 1) < 1e-6 and abs(stats["ratio_max"] - 1) < 1e-6
    # Sync mode computes the same old losses on the learner (no per-row record from the worker).
    sync = FPOPP(tiny_cfg(critic_warmup_iters=0), EnvSpec((19,), 7), torch.device("cpu"))
    sync.load_state_dict(algo.state_dict())
    del batch.data["cfm_old"]
    b_sync = sync.prepare([batch])
    assert torch.equal(b_sync["row_mask"], mask)
    torch.testing.assert_close(b_sync["cfm_old"], expected)
    # Without the env's report every chunk ran its act_steps rows.
    del batch.data["executed_rows"]
    assert torch.equal(sync.prepare([batch])["row_mask"], torch.tensor([1.0, 1.0, 0.0]).repeat(32, 1))


def test_the_summed_reduction_reaches_the_old_and_new_losses():
    # algo.cfm_reduction: sum sums the 7 action dims where the default averages them: 7x the losses
    mean = FPOPP(tiny_cfg(critic_warmup_iters=0), EnvSpec((19,), 7), torch.device("cpu"))
    summed = FPOPP(tiny_cfg(critic_warmup_iters=0, cfm_reduction="sum"), EnvSpec((19,), 7), torch.device("cpu"))
    summed.load_state_dict(mean.state_dict())
    assert (mean.policy.cfm_reduction, summed.policy.cfm_reduction) == ("mean_dims", "sum")
    batch = _rollout_batch(mean)
    b_mean, b_sum = mean.prepare([batch]), summed.prepare([batch])
    torch.testing.assert_close(b_sum["cfm_old"], 7 * b_mean["cfm_old"], rtol=1e-5, atol=1e-5)
    _, stats = summed._losses(b_sum, torch.arange(32), torch.arange(32), True)
    assert abs(stats["ratio_min"] - 1) < 1e-6 and abs(stats["ratio_max"] - 1) < 1e-6


def test_the_clamped_fraction_counts_the_pairs_past_the_loss_clamp():
    algo = FPOPP(tiny_cfg(critic_warmup_iters=0), EnvSpec((19,), 7), torch.device("cpu"))
    b = algo.prepare([_rollout_batch(algo)])
    delta = float(b["cfm_old"].median())
    algo.c = dataclasses.replace(algo.c, cfm_loss_clamp=delta)
    _, stats = algo._losses(b, torch.arange(32), torch.arange(32), True)          # theta = theta_old: new = old losses
    assert float(stats["cfm_clamped_frac"]) == pytest.approx(float((b["cfm_old"] > delta).float().mean()), abs=1e-6)
    assert 0.3 < float(stats["cfm_clamped_frac"]) < 0.7        # the median splits them
    algo.c = dataclasses.replace(algo.c, cfm_loss_clamp=0.0)
    assert float(algo._losses(b, torch.arange(32), torch.arange(32), True)[1]["cfm_clamped_frac"]) == 0.0   # no clamp


def test_positive_advantage_actions_get_more_likely():
    # Maximising the surrogate for a single positive-advantage action lowers its CFM loss
    # (raises its ratio), i.e. makes it more likely under the flow.
    cfg = tiny_cfg(critic_warmup_iters=0, lr=1e-3, epochs=3, normalize_advantages=False, clip=10.0)
    algo = FPOPP(cfg, EnvSpec((19,), 7), torch.device("cpu"))
    batch = _rollout_batch(algo)
    b = algo.prepare([batch])
    b["advantages"] = torch.ones_like(b["advantages"])
    algo.update(b)
    with torch.no_grad():
        after = algo.policy.cfm_losses(b["obs"], b["actions"], b["taus"], b["mc_eps"], row_mask=b["row_mask"])
    assert after.mean() < b["cfm_old"].mean()


@pytest.mark.parametrize("override, key", [
    ({"ratio_mode": "mean"}, "algo.ratio_mode"), ({"clip": 0.0}, "algo.clip"), ({"n_mc": 0}, "algo.n_mc"),
    ({"minibatch_size": 1000}, "algo.minibatch_size"), ({"cfm_reduction": "mean"}, "algo.cfm_reduction"), ({"hidden_sizes": []}, "algo.hidden_sizes")])
def test_config_mistakes_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_cfg(**override)


def test_base_policy_is_checked_before_ray_starts(tmp_path):
    cfg = tiny_cfg(base_policy=str(tmp_path / "none.pt"))      # a config may name a file to come
    with pytest.raises(ConfigError, match=r"algo\.base_policy.*pretrain"):
        FPOPP.preflight(cfg, SPEC)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match=r"algo\.base_policy.*cannot read"):
        FPOPP.preflight(tiny_cfg(base_policy=str(tmp_path / "junk.pt")), SPEC)
    torch.save({"policy": {}, "arch": {"hidden_sizes": [8], "horizon_steps": 3}}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match=r"algo\.hidden_sizes.*\[32, 32\].*\[8\]"):
        FPOPP.preflight(tiny_cfg(base_policy=str(tmp_path / "other.pt")), SPEC)
    with pytest.raises(ConfigError, match=r"env\.family"):
        config_from_dict({"algorithm": "fpopp", "env": {"family": "gym", "id": "Pendulum-v1"}})
