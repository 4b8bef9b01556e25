"""`flowrl-ray import-edm`: a checkpoint of the original EDM code becomes a flowrl-ray base model
whose network computes EDM's function.

EDM's modules are rebuilt here from the paper's equations (Hoogeboom et al. 2022, its EGNN of
Satorras et al. 2021) under the original code's submodule names and parameter shapes, so that
their state dict is the original format key for key; their forward runs molecule by molecule on
an edge list (sums with index_add), independently of the package's dense, padded EGNN."""

import argparse
import json
import math
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from flowrl_ray import cli
from flowrl_ray.config import ConfigError
from flowrl_ray.envs.molecules.import_edm import (BUFFER_KEY, SCHEDULE_KEY, EDMImportError,
                                                  edm_parameter_names, import_edm_checkpoint, model_config_of,
                                                  parameter_name)
from flowrl_ray.models.edm import EDM, check_base_model, load_base_model, model_of_base, remove_mean

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REAL = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "edm_qm9_small"
HISTOGRAM = np.eye(30)[6] * 0.5 + np.eye(30)[4] * 0.5            # molecules of 4 or 6 atoms


# --------------------------------------------------------------------------- EDM, from the paper

class RefGCL(nn.Module):
    """m_ij = phi_e(h_i, h_j, e_ij) (x att(m_ij)); h_i += phi_h(h_i, sum_j m_ij / Z)."""

    def __init__(self, hidden, edge_dim, attention):
        super().__init__()
        self.edge_mlp = nn.Sequential(nn.Linear(2 * hidden + edge_dim, hidden), nn.SiLU(),
                                      nn.Linear(hidden, hidden), nn.SiLU())
        self.node_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        if attention:
            self.att_mlp = nn.Sequential(nn.Linear(hidden, 1), nn.Sigmoid())
        self.attention = attention


class RefCoordUpdate(nn.Module):
    """x_i += sum_j (x_i - x_j) / (|x_i - x_j| + c) * [tanh](phi_x(h_i, h_j, e_ij)) [* 15] / Z."""

    def __init__(self, hidden, edge_dim):
        super().__init__()
        self.coord_mlp = nn.Sequential(nn.Linear(2 * hidden + edge_dim, hidden), nn.SiLU(),
                                       nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 1, bias=False))


class RefSchedule(nn.Module):
    def __init__(self, T, power, s):
        super().__init__()
        u = np.arange(T + 1) / T                                # EDM's grid: linspace(0, T+1, T+1) / (T+1)
        a2 = (1 - u ** power) ** 2
        steps = np.clip(a2 / np.concatenate([[1.0], a2[:-1]]), 0.001, 1.0)
        a2 = (1 - 2 * s) * np.cumprod(steps) + s
        self.gamma = nn.Parameter(torch.from_numpy(np.log(1 - a2) - np.log(a2)).float(), requires_grad=False)


class RefEDM(nn.Module):
    """The original module tree: gamma.gamma, buffer, dynamics.egnn.{embedding, e_block_i.{gcl_j,
    gcl_equiv}, embedding_out}."""

    def __init__(self, a: argparse.Namespace):
        super().__init__()
        features = 5 + int(a.include_charges)
        self.a = a
        self.gamma = RefSchedule(a.diffusion_steps, float(a.diffusion_noise_schedule.split("_")[1]),
                                 a.diffusion_noise_precision)
        self.register_buffer("buffer", torch.zeros(1))
        self.dynamics = nn.Module()
        egnn = self.dynamics.egnn = nn.Module()
        edge_dim = 24 if a.sin_embedding else 2
        egnn.embedding = nn.Linear(features + 1, a.nf)
        egnn.embedding_out = nn.Linear(a.nf, features + 1)
        for i in range(a.n_layers):
            block = nn.Module()
            for j in range(a.inv_sublayers):
                block.add_module(f"gcl_{j}", RefGCL(a.nf, edge_dim, a.attention))
            block.gcl_equiv = RefCoordUpdate(a.nf, edge_dim)
            egnn.add_module(f"e_block_{i}", block)

    def distance_features(self, sq):
        """[E, 1] squared distances -> [E, 1], or sin/cos of the distance at 2 pi 4^k / 15, k < 6."""
        if not self.a.sin_embedding:
            return sq
        w = 2 * math.pi * 4.0 ** torch.arange(6, dtype=sq.dtype) / 15.0
        angle = torch.sqrt(sq + 1e-8) * w
        return torch.cat([angle.sin(), angle.cos()], -1)

    def eps(self, x, h, t):
        """One molecule: x [n, 3], h [n, F], t in [0, 1] -> (eps_x [n, 3], eps_h [n, F])."""
        a, egnn, n = self.a, self.dynamics.egnn, x.shape[0]
        ii, jj = [k.reshape(-1) for k in torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")]
        ii, jj = ii[ii != jj], jj[ii != jj]                      # edges i <- j, no self-loops

        def sum_to_receiver(v):                                  # [E, C] -> [n, C] / Z
            return torch.zeros(n, v.shape[1], dtype=v.dtype).index_add_(0, ii, v) / a.normalization_factor

        d0 = self.distance_features(((x[ii] - x[jj]) ** 2).sum(-1, keepdim=True))
        hh, xx = egnn.embedding(torch.cat([h, torch.full((n, 1), float(t), dtype=h.dtype)], -1)), x
        for i in range(a.n_layers):
            block = getattr(egnn, f"e_block_{i}")
            diff = xx[ii] - xx[jj]
            sq = (diff ** 2).sum(-1, keepdim=True)
            e = torch.cat([self.distance_features(sq), d0], -1)
            for j in range(a.inv_sublayers):
                gcl = getattr(block, f"gcl_{j}")
                m = gcl.edge_mlp(torch.cat([hh[ii], hh[jj], e], -1))
                if gcl.attention:
                    m = m * gcl.att_mlp(m)
                hh = hh + gcl.node_mlp(torch.cat([hh, sum_to_receiver(m)], -1))
            phi = block.gcl_equiv.coord_mlp(torch.cat([hh[ii], hh[jj], e], -1))
            if a.tanh:
                phi = torch.tanh(phi) * 15.0
            xx = xx + sum_to_receiver(diff / (torch.sqrt(sq + 1e-8) + a.norm_constant) * phi)
        out = egnn.embedding_out(hh)
        eps_x = xx - x
        return eps_x - eps_x.mean(0, keepdim=True), out[:, :-1]


def edm_args(**kw) -> argparse.Namespace:
    """A tiny QM9 model's arguments, with the training-only keys EDM's script also writes."""
    base = dict(exp_name="tiny", model="egnn_dynamics", probabilistic_model="diffusion", diffusion_steps=20,
                diffusion_noise_schedule="polynomial_2", diffusion_noise_precision=1e-5, diffusion_loss_type="l2",
                n_epochs=3, batch_size=8, lr=1e-4, dp=True, condition_time=True, clip_grad=True, n_layers=2,
                inv_sublayers=1, nf=16, tanh=True, attention=True, norm_constant=1, sin_embedding=False,
                dataset="qm9", datadir="qm9/temp", conditioning=[], ema_decay=0.999, normalize_factors=[1, 4, 10],
                remove_h=False, include_charges=True, normalization_factor=1, aggregation_method="sum",
                cuda=False, context_node_nf=0, current_epoch=3)
    return argparse.Namespace(**{**base, **kw})


def save_edm_run(folder: Path, args: argparse.Namespace, seed: int = 0, state_edit=None) -> RefEDM:
    """An EDM run folder in the original format; random weights, the coordinate head made large."""
    torch.manual_seed(seed)
    ref = RefEDM(args)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("coord_mlp.4.weight"):
                p.normal_(0, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "args.pickle").write_bytes(pickle.dumps(args))
    state = ref.state_dict()
    if state_edit is not None:
        state_edit(state)
    torch.save(state, folder / ("generative_model_ema.npy" if args.ema_decay > 0 else "generative_model.npy"))
    return ref


def batch(ref_features: int, seed: int = 1):
    """Two molecules (4 and 6 atoms) padded to 7 slots, float64: z [2, 7, 3 + F], mask [2, 7]."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(7)[None] < torch.tensor([[4], [6]])
    z = torch.randn(2, 7, 3 + ref_features, generator=g, dtype=torch.float64) * mask[..., None]
    z[..., :3] = remove_mean(z[..., :3], mask)
    return z, mask


def assert_same_function(model: EDM, ref: RefEDM, atol: float = 1e-9):
    model, ref = model.double(), ref.double()
    z, mask = batch(model.D - 3)
    t = torch.tensor([0.35, 0.9], dtype=torch.float64)
    with torch.no_grad():
        got = model.dynamics(z, t, mask)
        for b in range(2):
            n = int(mask[b].sum())
            eps_x, eps_h = ref.eps(z[b, :n, :3], z[b, :n, 3:], t[b])
            assert eps_x.abs().max() > 1e-3                        # a non-trivial coordinate output
            torch.testing.assert_close(got[b, :n, :3], eps_x, atol=atol, rtol=0)
            torch.testing.assert_close(got[b, :n, 3:], eps_h, atol=atol, rtol=0)
        assert (got[~mask] == 0).all()


# --------------------------------------------------------------------------- the mapping

@pytest.mark.parametrize("variant", [
    {},                                                            # EDM's QM9 settings, tiny
    dict(attention=False, tanh=False, sin_embedding=True, inv_sublayers=2, norm_constant=0,
         normalization_factor=100, include_charges=False, normalize_factors=[1, 2, 1]),
])
def test_imported_network_computes_edms_function(tmp_path, variant):
    args = edm_args(**variant)
    ref = save_edm_run(tmp_path / "run", args)
    ckpt = import_edm_checkpoint(tmp_path / "run", histogram=HISTOGRAM)
    cfg = ckpt["model_config"]
    assert (cfg["num_layers"], cfg["hidden_size"], cfg["inv_sublayers"], cfg["diffusion_steps"]) == (
        args.n_layers, args.nf, args.inv_sublayers, args.diffusion_steps)
    assert (cfg["attention"], cfg["tanh"], cfg["sin_embedding"], cfg["include_charges"]) == (
        args.attention, args.tanh, args.sin_embedding, args.include_charges)
    assert (cfg["atom_type_scale"], cfg["charge_scale"], cfg["aggregation_factor"], cfg["norm_constant"]) == (
        args.normalize_factors[1], args.normalize_factors[2], args.normalization_factor, args.norm_constant)
    assert ckpt["source"]["weights"] == "generative_model_ema.npy" and ckpt["source"]["epoch"] == 3
    model = model_of_base(ckpt)
    assert model.D == 3 + 5 + int(args.include_charges)
    assert_same_function(model, ref)


def test_the_mapping_covers_every_key_both_ways(tmp_path):
    args = edm_args(inv_sublayers=2)
    ref = save_edm_run(tmp_path / "run", args)
    edm_keys = set(ref.state_dict())
    names = edm_parameter_names(model_config_of(vars(args)))
    assert set(names) | {SCHEDULE_KEY, BUFFER_KEY} == edm_keys and len(names) == len(set(names))
    mapped = [parameter_name(k) for k in names]
    ckpt = import_edm_checkpoint(tmp_path / "run", histogram=HISTOGRAM)
    assert None not in mapped and len(set(mapped)) == len(mapped)
    assert set(mapped) == set(ckpt["state_dict"]) == set(EDM(model_of_base(ckpt).cfg).state_dict())
    for edm_key, ours in zip(names, mapped):
        assert torch.equal(ckpt["state_dict"][ours], ref.state_dict()[edm_key]), edm_key
    assert parameter_name("dynamics.egnn.e_block_1.gcl_equiv.coord_mlp.4.weight") == \
        "dynamics.egnn.blocks.1.update.out.weight"
    assert parameter_name(SCHEDULE_KEY) is None and parameter_name("dynamics.egnn.e_block_0.gcl_0.foo.weight") is None


def test_raw_weights_when_ema_is_off(tmp_path):
    ref = save_edm_run(tmp_path / "run", edm_args(ema_decay=0))
    ckpt = import_edm_checkpoint(tmp_path / "run", histogram=HISTOGRAM)
    assert ckpt["source"]["weights"] == "generative_model.npy"
    assert_same_function(model_of_base(ckpt), ref)


# --------------------------------------------------------------------------- refusals

class RunsACommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def test_refusals_name_the_key(tmp_path):
    def fails(pattern, args=None, state_edit=None, pickled=None):
        folder = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        save_edm_run(folder, edm_args(), state_edit=state_edit)            # weights of a supported model
        if args is not None or pickled is not None:
            (folder / "args.pickle").write_bytes(pickle.dumps(args) if pickled is None else pickled)
        with pytest.raises(EDMImportError, match=pattern) as info:
            import_edm_checkpoint(folder, histogram=HISTOGRAM)
        assert "\n" not in str(info.value) and isinstance(info.value, ConfigError)

    # parameters: unknown, missing, of another shape, a schedule computed otherwise
    fails(r"generative_model_ema\.npy: unknown parameter 'dynamics\.egnn\.e_block_0\.gcl_0\.extra\.weight'",
          state_edit=lambda sd: sd.update({"dynamics.egnn.e_block_0.gcl_0.extra.weight": torch.zeros(2)}))
    fails(r"no parameter 'dynamics\.egnn\.e_block_1\.gcl_0\.att_mlp\.0\.bias'",
          state_edit=lambda sd: sd.pop("dynamics.egnn.e_block_1.gcl_0.att_mlp.0.bias"))
    fails(r"'dynamics\.egnn\.embedding\.weight' has shape \[16, 6\], the model of args\.pickle expects \[16, 7\]",
          state_edit=lambda sd: sd.update({"dynamics.egnn.embedding.weight": torch.zeros(16, 6)}))
    fails(r"'gamma\.gamma' differs from the polynomial schedule",
          state_edit=lambda sd: sd.update({SCHEDULE_KEY: sd[SCHEDULE_KEY] + 0.1}))
    fails(r"unknown parameter 'gamma\.l1\.weight'",
          state_edit=lambda sd: sd.update({"gamma.l1.weight": torch.zeros(1, 1)}))
    # arguments this package cannot reproduce, each named
    for key, value in (("diffusion_noise_schedule", "cosine"), ("aggregation_method", "mean"),
                       ("remove_h", True), ("conditioning", ["alpha"]), ("model", "gnn_dynamics"),
                       ("condition_time", False), ("normalize_factors", [2, 4, 10]), ("dataset", "geom"),
                       ("nf", 0), ("attention", "yes"), ("surprise", 1)):
        fails(rf"args\.pickle: '{key}' is {re.escape(repr(value))};", args=edm_args(**{key: value}))
    # a pickle that names another global: refused before anything runs
    marker = tmp_path.parent / f"{tmp_path.name}-ran"
    fails(r"args\.pickle: refuses the global '(os|posix)\.system'", pickled=pickle.dumps(RunsACommand(marker)))
    assert not marker.exists()
    fails(r"args\.pickle: refuses the global 'collections\.OrderedDict'", pickled=pickle.dumps(
        argparse.Namespace(**{**vars(edm_args()), "extra": __import__("collections").OrderedDict()})))
    fails(r"args\.pickle: .* holds a dict, not an argparse\.Namespace", pickled=pickle.dumps(vars(edm_args())))
    fails(r"args\.pickle: cannot read", pickled=b"not a pickle")
    with pytest.raises(EDMImportError, match=r"DIR: no such folder"):
        import_edm_checkpoint(tmp_path / "nowhere", histogram=HISTOGRAM)


def test_cli_writes_the_base_and_refuses_in_one_line(tmp_path, capsys, monkeypatch):
    import flowrl_ray.envs.molecules.import_edm as import_edm
    monkeypatch.setattr(import_edm, "qm9_train_histogram", lambda: HISTOGRAM)
    ref = save_edm_run(tmp_path / "run", edm_args())
    out = tmp_path / "pretrained" / "edm.pt"
    assert cli.main(["import-edm", str(tmp_path / "run"), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["algo"]["base_model"] == str(out) and summary["parameters"] == sum(
        v.numel() for k, v in ref.state_dict().items() if k not in (SCHEDULE_KEY, BUFFER_KEY))
    assert f"algo.base_model={out}" in summary["overrides"] and "algo.model.atom_charges=[1,6,7,8,9]" in summary["overrides"]
    # the printed algo section makes a FED-GRPO config that accepts the base and loads it
    from flowrl_ray.config import config_from_dict
    cfg = config_from_dict({"algorithm": "fed_grpo", "env": {"family": "molecules", "id": "qm9"},
                            "algo": summary["algo"]})
    check_base_model(cfg)
    model = EDM(cfg.algo.model)
    model.load_state_dict(load_base_model(out)["state_dict"])
    assert_same_function(model, ref)
    # a config with the base but without the charges channel is refused naming the key
    other = config_from_dict({"algorithm": "fed_grpo", "env": {"family": "molecules", "id": "qm9"},
                              "algo": {"base_model": str(out), "model": {**summary["algo"]["model"],
                                                                        "include_charges": False}}})
    with pytest.raises(ConfigError, match=r"algo\.model\.include_charges"):
        check_base_model(other)

    (tmp_path / "run" / "args.pickle").write_bytes(pickle.dumps(edm_args(diffusion_noise_schedule="learned")))
    code = cli.main(["import-edm", str(tmp_path / "run"), "--out", str(tmp_path / "x.pt")])
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_USER_ERROR and err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith("flowrl-ray import-edm: error: args.pickle: 'diffusion_noise_schedule' is 'learned'")
    assert not (tmp_path / "x.pt").exists()


# --------------------------------------------------------------------------- the published small checkpoint

@pytest.fixture(scope="module")
def real():
    if not (REAL / "args.pickle").is_file():
        pytest.skip(f"the small EDM QM9 checkpoint is not here ({REAL.resolve()}; ../shared/data/edm_qm9_small/ "
                    f"relative to the repository)")
    ckpt = import_edm_checkpoint(REAL, histogram=HISTOGRAM)
    return ckpt, model_of_base(ckpt).double()


def test_the_real_checkpoint_imports_as_edm_computes_it(real):
    ckpt, model = real
    cfg = ckpt["model_config"]
    assert (cfg["num_layers"], cfg["hidden_size"], cfg["diffusion_steps"], cfg["include_charges"]) == (5, 128, 200, True)
    state = torch.load(REAL / "generative_model_ema.npy", map_location="cpu", weights_only=True)
    args = argparse.Namespace(**ckpt["edm_args"])
    ref = RefEDM(args)
    ref.load_state_dict(state)                                     # its own names, strictly
    assert_same_function(model, ref, atol=1e-8)


def test_the_real_checkpoint_is_equivariant_and_keeps_zero_com(real):
    ckpt, model = real
    z, mask = batch(model.D - 3, seed=5)
    z[..., 3:8] = torch.nn.functional.one_hot(torch.randint(0, 5, (2, 7)), 5) / 4.0 * mask[..., None]
    t = torch.tensor([0.1, 0.6], dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    q, r = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    with torch.no_grad():
        out = model.dynamics(z, t, mask)
        z2 = z.clone()
        z2[..., :3] = torch.where(mask[..., None], z[..., :3] @ q.T + torch.tensor([0.3, -1.0, 2.0],
                                                                                   dtype=torch.float64), 0.0)
        out2 = model.dynamics(z2, t, mask)
    assert out[..., :3].abs().max() > 1e-3
    torch.testing.assert_close(out2[..., :3], out[..., :3] @ q.T, atol=1e-9, rtol=0)   # x-noise rotates
    torch.testing.assert_close(out2[..., 3:], out[..., 3:], atol=1e-9, rtol=0)          # h-noise invariant
    torch.testing.assert_close(out[..., :3].sum(1), torch.zeros(2, 3, dtype=torch.float64), atol=1e-10, rtol=0)
    model32 = model_of_base(ckpt)
    res = model32.sample(torch.tensor([4, 6]), torch.Generator().manual_seed(0))
    assert torch.isfinite(res.positions).all() and res.trajectory["z"].shape[-1] == 9
    torch.testing.assert_close(res.positions.sum(1), torch.zeros(2, 3), atol=1e-4, rtol=0)  # zero CoM
    assert ((res.atom_types[res.node_mask] >= 0) & (res.atom_types[res.node_mask] < 5)).all()


def test_the_committed_imported_base_fits_its_config_and_is_the_import(monkeypatch):
    from flowrl_ray.config import load_config
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    cfg = load_config("configs/fed_grpo/qm9_edm_small.yaml")
    check_base_model(cfg)                                    # architecture and file agree, or ConfigError
    committed = load_base_model(cfg.algo.base_model)
    assert committed["model_config"]["include_charges"] and committed["source"]["format"] == "edm"
    hist = np.asarray(committed["node_histogram"])
    # QM9 with hydrogens: 3 to 29 atoms, most often 19
    assert hist.shape == (30,) and hist[:3].sum() == 0 and abs(hist.sum() - 1) < 1e-9 and hist.argmax() == 19
    if (REAL / "generative_model_ema.npy").is_file():        # the same weights as a fresh import
        fresh = import_edm_checkpoint(REAL)
        assert fresh["state_dict"].keys() == committed["state_dict"].keys()
        for k, v in fresh["state_dict"].items():
            assert torch.equal(v, committed["state_dict"][k]), k
