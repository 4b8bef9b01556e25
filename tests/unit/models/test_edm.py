"""EDM policy and its EGNN: equivariance, schedule, log-densities against torch.distributions,
sampler bookkeeping, hand-checked reverse step, and a short fit."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from flowrl_ray.config import ConfigError, build_section
from flowrl_ray.models.edm import (EDM, EDMModelConfig, NodeDistribution, NoiseSchedule, fit_edm,
                                   reference_kl, remove_mean, step_log_prob, transition_log_prob)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(**kw) -> EDMModelConfig:
    base = dict(num_layers=2, hidden_size=16, diffusion_steps=12, max_atoms=7)
    return EDMModelConfig(**{**base, **kw})


def rotation(seed: int, reflect: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q[:, 0] = -q[:, 0]
    if reflect:
        q[:, 2] = -q[:, 2]
    assert torch.allclose(q @ q.T, torch.eye(3, dtype=torch.float64), atol=1e-12)
    assert math.isclose(float(torch.det(q)), -1.0 if reflect else 1.0, abs_tol=1e-9)
    return q


@pytest.fixture(scope="module")
def dyn_case():
    """A float64 model whose coordinate head is not near zero (init gain 1e-3 would make eps_x tiny)."""
    torch.manual_seed(0)
    model = EDM(tiny()).double()
    with torch.no_grad():
        for block in model.dynamics.egnn.blocks:
            block.update.out.weight.normal_(0, 0.3)
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    z = torch.randn(2, 7, model.D, generator=g, dtype=torch.float64) * mask[..., None]
    t = torch.tensor([0.3, 0.8], dtype=torch.float64)
    return model, z, t, mask


@pytest.mark.parametrize("reflect", [False, True])
def test_egnn_e3_equivariance(dyn_case, reflect):
    model, z, t, mask = dyn_case
    q = rotation(3, reflect)
    shift = torch.tensor([1.5, -2.0, 0.7], dtype=torch.float64)
    out = model.dynamics(z, t, mask)
    z2 = z.clone()
    z2[..., :3] = torch.where(mask[..., None], z[..., :3] @ q.T + shift, 0.0)
    out2 = model.dynamics(z2, t, mask)
    assert out[..., :3].abs().max() > 1e-2                         # non-trivial coordinate output
    assert torch.allclose(out2[..., :3], out[..., :3] @ q.T, atol=1e-8)   # rotates, translation-free
    assert torch.allclose(out2[..., 3:], out[..., 3:], atol=1e-8)         # invariant
    assert torch.allclose(out[..., :3].sum(1), torch.zeros(2, 3, dtype=torch.float64), atol=1e-10)


def test_egnn_permutation_and_padding(dyn_case):
    model, z, t, mask = dyn_case
    out = model.dynamics(z, t, mask)
    perm = torch.tensor([5, 2, 0, 6, 3, 1, 4])                      # mixes real and padding slots
    out_p = model.dynamics(z[:, perm], t, mask[:, perm])
    assert torch.allclose(out_p, out[:, perm], atol=1e-10)
    garbage = z.clone()
    garbage[~mask] = torch.randn(int((~mask).sum()), model.D, dtype=torch.float64) * 100
    garbage[0, 6, 0] = float("nan")
    out_g = model.dynamics(garbage, t, mask)
    assert torch.equal(out_g[mask], out[mask]) and (out_g[~mask] == 0).all()


def test_schedule_hand_values():
    T, s = 100, 1e-5
    sch = NoiseSchedule(T, 2.0, s)
    assert sch.gamma.shape == (T + 1,) and (sch.gamma.diff() > 0).all()
    ts = torch.arange(T + 1)
    assert torch.allclose(sch.alpha(ts) ** 2 + sch.sigma(ts) ** 2, torch.ones(T + 1, dtype=torch.float64))
    assert math.isclose(sch.alpha(0), math.sqrt(1 - s), rel_tol=1e-12)      # alpha_0^2 = 1 - s
    # t = 50: EDM's grid point is 50 (T+1)/T, i.e. u = 1/2; (1 - u^2)^2 = 0.5625, unclipped.
    assert math.isclose(sch.alpha(50) ** 2, (1 - 2 * s) * 0.5625 + s, rel_tol=1e-12)
    assert sch.alpha(T) ** 2 < 2e-5                                           # clipped end, ~s
    a_ts, s_ts = sch.transition(50)
    assert math.isclose(a_ts, sch.alpha(50) / sch.alpha(49), rel_tol=1e-10)
    assert math.isclose(s_ts ** 2, 1 - a_ts ** 2, rel_tol=1e-10)


def test_remove_mean_and_node_distribution():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    x = torch.tensor([[[1.0, 2, 3], [3, 2, 1], [9, 9, 9]], [[0.0, 0, 0], [3, 3, 3], [6, 0, 3]]])
    y = remove_mean(x, mask)
    assert torch.allclose(y[0, 0], torch.tensor([-1.0, 0, 1])) and (y[0, 2] == 0).all()
    assert torch.allclose(y[1].sum(0), torch.zeros(3), atol=1e-6)
    dist = NodeDistribution(np.array([0, 0, 3, 0, 1]))
    n = dist.sample(4000, torch.Generator().manual_seed(0))
    assert set(n.tolist()) == {2, 4} and abs((n == 2).float().mean().item() - 0.75) < 0.03
    with pytest.raises(ValueError):
        NodeDistribution(np.array([1, 2, 3]))


def test_config_bounds():
    assert build_section(EDMModelConfig, {"hidden_size": 8}, "algo.model.").hidden_size == 8
    with pytest.raises(ConfigError, match="algo.model.diffusion_steps"):
        build_section(EDMModelConfig, {"diffusion_steps": 0}, "algo.model.")
    assert {f.name for f in dataclasses.fields(EDMModelConfig)} >= {"aggregation_factor", "coords_range"}


def subspace_basis(n: int) -> torch.Tensor:
    """[n, n-1] orthonormal columns orthogonal to the all-ones vector."""
    a = torch.cat([torch.ones(n, 1, dtype=torch.float64), torch.randn(n, n - 1, dtype=torch.float64)], 1)
    q, _ = torch.linalg.qr(a)
    return q[:, 1:]


def test_transition_log_prob_matches_distributions():
    torch.manual_seed(0)
    K, N = 5, 6
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    mu = torch.randn(3, N, 3 + K, dtype=torch.float64)
    zp = torch.randn(3, N, 3 + K, dtype=torch.float64)
    mu[..., :3], zp[..., :3] = remove_mean(mu[..., :3], mask), remove_mean(zp[..., :3], mask)
    mu[~mask], zp[~mask] = 0.0, 0.0
    sigma = torch.tensor([0.7, 0.2, 1.3], dtype=torch.float64)
    got = transition_log_prob(zp, mu, sigma, mask)
    for b in range(3):
        n = int(mask[b].sum())
        lp_h = torch.distributions.Normal(mu[b, :n, 3:], sigma[b]).log_prob(zp[b, :n, 3:]).sum()
        lp_x = torch.tensor(0.0, dtype=torch.float64)
        if n > 1:
            q = subspace_basis(n)                                       # coordinates in the subspace
            cz, cm = (q.T @ zp[b, :n, :3]).reshape(-1), (q.T @ mu[b, :n, :3]).reshape(-1)
            d = 3 * (n - 1)
            lp_x = torch.distributions.MultivariateNormal(
                cm, covariance_matrix=sigma[b] ** 2 * torch.eye(d, dtype=torch.float64)).log_prob(cz)
        assert torch.allclose(got[b], lp_x + lp_h, atol=1e-9), b
    # A float sigma broadcasts; the KL of equal means is 0 and scales as 1/sigma^2.
    assert torch.allclose(transition_log_prob(zp, mu, 0.5, mask),
                          transition_log_prob(zp, mu, torch.full((3,), 0.5, dtype=torch.float64), mask))
    assert torch.allclose(reference_kl(mu, mu, 0.3, mask), torch.zeros(3, dtype=torch.float64))
    kl = reference_kl(zp, mu, 0.5, mask)
    assert torch.allclose(kl, ((zp - mu) ** 2).sum((1, 2)) / 0.5, atol=1e-9)


def test_reverse_mean_std_hand_check(monkeypatch):
    model = EDM(tiny()).double()
    monkeypatch.setattr(model, "predict_eps", lambda z, t, m: torch.zeros_like(z))
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    z = torch.randn(1, 7, model.D, dtype=torch.float64) * mask[..., None]
    z[..., :3] = remove_mean(z[..., :3], mask)
    sch, t = model.schedule, 7
    a_t, a_s, s_t, s_s = sch.alpha(t), sch.alpha(t - 1), sch.sigma(t), sch.sigma(t - 1)
    a_ts = a_t / a_s
    s_ts = math.sqrt(s_t ** 2 - a_ts ** 2 * s_s ** 2)      # VP: sigma_t^2 = a_ts^2 sigma_s^2 + sigma_ts^2
    mu, sigma = model.reverse_mean_std(z, t, mask)
    assert torch.allclose(mu, z / a_ts, atol=1e-12)
    assert math.isclose(sigma, s_ts * s_s / s_t, rel_tol=1e-9)
    with pytest.raises(ValueError):
        model.reverse_mean_std(z, 0, mask)


@pytest.fixture(scope="module")
def sampled():
    torch.manual_seed(0)
    model = EDM(tiny(diffusion_steps=10))
    n_atoms = torch.tensor([3, 3, 3, 5, 5, 5])
    res = model.sample(n_atoms, torch.Generator().manual_seed(7), group_size=3, shared_prefix_steps=4,
                       x0_steps=[10, 6, 2, 0])
    return model, n_atoms, res


def test_sample_shapes_groups_and_prefix(sampled):
    model, n_atoms, res = sampled
    B, N, D, K = 6, 5, model.D, 10 - 4                 # padded to the largest molecule (max_atoms 7)
    tr = res.trajectory
    assert res.positions.shape == (B, N, 3) and res.atom_types.shape == (B, N)
    assert tr["z"].shape == (K + 1, B, N, D) and tr["logp"].shape == (K, B) and tr["sigma"].shape == (K,)
    assert tr["t"].tolist() == list(range(K, 0, -1))
    assert torch.equal(res.node_mask.sum(1), n_atoms) and torch.equal(tr["node_mask"], res.node_mask)
    assert (res.positions[~res.node_mask] == 0).all() and (res.atom_types[~res.node_mask] == -1).all()
    assert ((res.atom_types[res.node_mask] >= 0) & (res.atom_types[res.node_mask] < 5)).all()
    assert torch.allclose(res.positions.sum(1), torch.zeros(B, 3), atol=1e-3)
    assert torch.allclose(tr["z"][..., :3].sum(2), torch.zeros(K + 1, B, 3), atol=1e-3)
    assert (tr["z"][:, ~res.node_mask] == 0).all()
    for g in range(2):
        rows = tr["z"][:, 3 * g:3 * g + 3]
        assert torch.equal(rows[0, 0], rows[0, 1]) and torch.equal(rows[0, 0], rows[0, 2])   # branch point
        assert all((rows[k, 0] - rows[k, 1]).abs().max() > 1e-3 for k in range(1, K + 1))  # then apart
    assert sorted(res.x0_predictions) == [0, 2, 6, 10]
    xp, tp = res.x0_predictions[10]                                     # a shared step: same in group
    assert xp.shape == (B, N, 3) and torch.equal(xp[0], xp[2]) and torch.equal(tp[3], tp[5])
    assert torch.equal(res.x0_predictions[0][0], res.positions)
    sch = model.schedule
    sig = torch.tensor([sch.transition(t)[1] * sch.sigma(t - 1) / sch.sigma(t) for t in range(K, 0, -1)],
                       dtype=torch.float64)
    assert torch.allclose(tr["sigma"].double(), sig, rtol=1e-5)


def test_sample_reproducible_and_validated(sampled):
    model, n_atoms, res = sampled
    again = model.sample(n_atoms, torch.Generator().manual_seed(7), group_size=3, shared_prefix_steps=4)
    assert torch.equal(again.trajectory["z"], res.trajectory["z"])
    assert torch.equal(again.positions, res.positions)
    other = model.sample(n_atoms, torch.Generator().manual_seed(8), group_size=3, shared_prefix_steps=4)
    assert not torch.equal(other.positions, res.positions)
    full = model.sample(n_atoms[:3], torch.Generator().manual_seed(7), group_size=3, shared_prefix_steps=10)
    assert full.trajectory["z"].shape[0] == 1 and full.trajectory["logp"].shape == (0, 3)
    with pytest.raises(ValueError):
        model.sample(torch.tensor([3, 4]), group_size=2)
    with pytest.raises(ValueError):
        model.sample(torch.tensor([3, 3]), group_size=2, shared_prefix_steps=11)


def test_step_log_prob_reproduces_behaviour_and_has_grad(sampled):
    model, _, res = sampled
    tr = res.trajectory
    model.zero_grad()
    total = 0.0
    for k in range(tr["t"].numel()):
        logp, mu = step_log_prob(model, tr["z"][k], tr["z"][k + 1], int(tr["t"][k]), tr["node_mask"])
        assert torch.allclose(logp, tr["logp"][k], rtol=0, atol=1e-5)
        assert torch.exp(logp - tr["logp"][k]).sub(1).abs().max() < 1e-5          # PPO ratio 1
        assert mu.shape == tr["z"][k].shape and mu.requires_grad
        assert torch.allclose(mu, tr["mu"][k], rtol=0, atol=1e-5)                      # recorded behaviour mean
        total = total + logp.sum()
    total.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads) and sum(g.abs().sum() for g in grads) > 0


def test_decode_marks_nan_molecules():
    model = EDM(tiny())
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0]] * 2, dtype=torch.bool)
    z0 = model.noise(mask, torch.Generator().manual_seed(0))
    z0[1, 0, 4] = float("nan")
    pos, types = model.decode(z0, mask)
    assert (types[1] == -1).all() and (types[0, :3] >= 0).all()
    assert torch.isfinite(pos[0]).all() and not torch.isfinite(pos[1, :3]).all()


def test_fit_edm_lowers_loss():
    torch.manual_seed(0)
    model = EDM(EDMModelConfig(num_layers=2, hidden_size=16, diffusion_steps=50, max_atoms=6))
    mol = np.array([[0.0, 0, 0], [1.09, 0, 0], [-0.36, 1.03, 0], [-0.36, -0.51, 0.89], [-0.36, -0.51, -0.89]])
    pos = np.zeros((64, 6, 3), dtype=np.float32)
    pos[:, :5] = mol
    types = np.full((64, 6), -1)
    types[:, :5] = [1, 0, 0, 0, 0]                                       # CH4
    seen = []
    out = fit_edm(model, pos, types, steps=60, batch_size=16, lr=2e-3, ema_decay=0.9,
                  generator=torch.Generator().manual_seed(0), log_every=20,
                  progress=lambda step, total, loss: seen.append((step, total)))
    h = out["loss_history"]
    assert len(h) == 60 and out["skipped_steps"] == 0 and seen == [(20, 60), (40, 60), (60, 60)]
    assert np.mean(h[-15:]) < 0.8 * np.mean(h[:15]), (np.mean(h[:15]), np.mean(h[-15:]))
    ema = out["ema_state_dict"]
    assert ema.keys() == model.state_dict().keys()
    key = "dynamics.egnn.embedding.weight"
    assert not torch.equal(ema[key], model.state_dict()[key])


def test_pair_linear_is_the_concatenated_linear():
    from flowrl_ray.models.egnn import pair_linear
    torch.manual_seed(0)
    lin = torch.nn.Linear(2 * 4 + 2, 5).double()
    h = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    e = torch.randn(2, 3, 3, 2, dtype=torch.float64, requires_grad=True)
    cat = torch.cat([h[:, :, None].expand(2, 3, 3, 4), h[:, None].expand(2, 3, 3, 4), e], -1)
    ref, got = lin(cat), pair_linear(lin, h, e)
    assert torch.allclose(got, ref, atol=1e-12)
    g_ref = torch.autograd.grad(ref.pow(2).sum(), [h, e, lin.weight])
    g_got = torch.autograd.grad(got.pow(2).sum(), [h, e, lin.weight])
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(g_ref, g_got))


def test_charges_channel_encodes_the_types_charge_and_decoding_ignores_it():
    """EDM's QM9 node features: one-hot / 4 and the atomic number / 10; the type decodes from the
    one-hot part alone, and the state's extra channel counts in the transition's dimension."""
    model = EDM(tiny(include_charges=True)).double()
    assert model.D == 3 + 5 + 1 and model.dynamics.egnn.embedding.in_features == 5 + 1 + 1
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    pos = torch.randn(1, 7, 3, dtype=torch.float64)
    types = torch.tensor([[1, 0, 4, -1, -1, -1, -1]])
    xh = model.encode(pos, types, mask)
    assert torch.allclose(xh[0, :3, 3:8], torch.eye(5, dtype=torch.float64)[[1, 0, 4]] / 4)
    assert xh[0, :3, 8].tolist() == [0.6, 0.1, 0.9] and (xh[0, 3:] == 0).all()      # C 6, H 1, F 9
    assert torch.allclose(xh[0, :3, :3].sum(0), torch.zeros(3, dtype=torch.float64), atol=1e-12)
    z0 = xh.clone()
    z0[0, :3, 8] = 5.0                                   # a charge channel above every one-hot entry
    assert model.decode(z0, mask)[1][0, :3].tolist() == [1, 0, 4]
    mu = torch.zeros_like(xh)
    assert math.isclose(float(transition_log_prob(mu, mu, 1.0, mask)), -(3 * 2 + 3 * 6) * 0.5 * math.log(2 * math.pi))
    assert torch.isfinite(model.training_loss(pos, types, mask, torch.Generator().manual_seed(0))).all()
    res = EDM(tiny(include_charges=True, diffusion_steps=4)).sample(torch.tensor([3, 5]), torch.Generator().manual_seed(0))
    assert res.trajectory["z"].shape[-1] == 9 and ((res.atom_types[res.node_mask] >= 0)
                                                   & (res.atom_types[res.node_mask] < 5)).all()


def test_new_model_keys_keep_old_checkpoints_and_name_their_mistakes(tmp_path):
    from flowrl_ray.models.edm import check_base_model, check_model_config
    with pytest.raises(ConfigError, match=r"algo\.model\.atom_charges"):
        check_model_config(tiny(include_charges=True, atom_charges=[1, 6]))
    with pytest.raises(ConfigError, match=r"algo\.model\.atom_charges"):
        EDM(tiny(include_charges=True, atom_charges=[1, 6, 7, 8, "F"]))
    model = EDM(tiny())
    old_keys = {"num_layers", "hidden_size", "diffusion_steps", "noise_precision", "schedule_power", "max_atoms",
                "num_atom_types", "atom_type_scale", "attention", "tanh", "coords_range", "norm_constant",
                "aggregation_factor"}                    # a checkpoint written before the charges channel
    path = tmp_path / "old.pt"
    torch.save({"state_dict": model.state_dict(), "node_histogram": np.eye(8)[3],
                "model_config": {k: v for k, v in dataclasses.asdict(model.cfg).items() if k in old_keys}}, path)

    class Cfg:                                           # the two keys check_base_model reads
        class algo:
            base_model, model = str(path), tiny()
    check_base_model(Cfg)                                # defaults: the old behaviour
    Cfg.algo.model = tiny(include_charges=True)
    with pytest.raises(ConfigError, match=r"algo\.model\.include_charges"):
        check_base_model(Cfg)


def test_sample_molecules_batches_by_size_and_keeps_the_drawn_order():
    from flowrl_ray.models.edm import NodeDistribution
    from flowrl_ray.pretrain.edm_qm9 import sample_molecules
    torch.manual_seed(0)
    model = EDM(tiny(diffusion_steps=4))
    histogram = np.zeros(8)
    histogram[[2, 5, 7]] = [0.4, 0.3, 0.3]
    drawn = NodeDistribution(histogram).sample(9, torch.Generator().manual_seed(3))
    mols = sample_molecules(model, histogram, 9, seed=3, batch_size=4)
    assert [len(t) for _, t in mols] == drawn.tolist()          # molecule i has the i-th drawn count
    again = sample_molecules(model, histogram, 9, seed=3, batch_size=4)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(mols, again))
