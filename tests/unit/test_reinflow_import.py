"""`flowrl-ray import-reinflow`: a ReinFlow / ReFlow pretraining checkpoint becomes a flowrl-ray base
policy whose velocity and Euler sampler are the release's.

The release's modules are rebuilt here from their definitions (model/flow/mlp_flow.py FlowMLP,
model/common/mlp.py MLP / ResidualMLP, model/diffusion/modules.py SinusoidalPosEmb,
model/flow/reflow.py ReFlow): the same submodule names and parameter shapes (so the state dict is
the release's, key for key) and the same forward math, written independently of the importer."""

import json
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

from flowrl_ray import cli
from flowrl_ray.models.flow_policy import check_base_policy, load_base_policy, make_flow_policy, policy_arch
from flowrl_ray.algorithms.fpopp import FPOPP
from flowrl_ray.config import ConfigError, apply_overrides, config_from_dict
from flowrl_ray.envs import EnvSpec
from flowrl_ray.models.flow import FlowPolicy
from flowrl_ray.envs.robot.import_reinflow import (ReinFlowImportError, config_overrides, import_reinflow_checkpoint,
                                               write_norm_dataset)

OBS_DIM, ACTION_DIM, HORIZON, TIME_DIM = 23, 7, 4, 16          # the can task's low-dim widths
SPEC = EnvSpec(obs_shape=(OBS_DIM,), action_dim=ACTION_DIM, max_episode_steps=300)
ACTS = {"ReLU": nn.ReLU, "Mish": nn.Mish}


# --------------------------------------------------------------------------- the release's modules

class RefSinusoidalPosEmb(nn.Module):
    """[B, 1] times -> [B, 1, dim]: sin/cos of t at exp(-ln(1e4) k / (half - 1))."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, t):
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half) * -(math.log(10000) / (half - 1)))
        angles = t[:, None] * freqs[None, :]
        return torch.cat((angles.sin(), angles.cos()), dim=-1)


class RefMLP(nn.Module):
    """moduleList.{i} = Sequential(linear_1, act_1); no activation after the last layer."""

    def __init__(self, dims, activation):
        super().__init__()
        self.moduleList = nn.ModuleList()
        for i in range(len(dims) - 1):
            last = i == len(dims) - 2
            self.moduleList.append(nn.Sequential(OrderedDict(
                [("linear_1", nn.Linear(dims[i], dims[i + 1])), ("act_1", nn.Identity() if last else ACTS[activation]())])))

    def forward(self, x):
        for m in self.moduleList:
            x = m(x)
        return x


class RefResBlock(nn.Module):
    def __init__(self, width, activation):
        super().__init__()
        self.l1, self.l2, self.act = nn.Linear(width, width), nn.Linear(width, width), ACTS[activation]()

    def forward(self, x):
        return x + self.l2(self.act(self.l1(self.act(x))))


class RefResidualMLP(nn.Module):
    """layers = [Linear(in, H), (len(dims) - 3) / 2 blocks, Linear(H, out), Identity]."""

    def __init__(self, dims, activation):
        super().__init__()
        width, hidden_layers = dims[1], len(dims) - 3
        assert hidden_layers % 2 == 0
        self.layers = nn.ModuleList([nn.Linear(dims[0], width)])
        self.layers.extend(RefResBlock(width, activation) for _ in range(1, hidden_layers, 2))
        self.layers.append(nn.Linear(width, dims[-1]))
        self.layers.append(nn.Identity())

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class RefFlowMLP(nn.Module):
    def __init__(self, horizon_steps, action_dim, cond_dim, time_dim, mlp_dims, activation, residual):
        super().__init__()
        self.time_dim = time_dim
        self.time_embedding = nn.Sequential(RefSinusoidalPosEmb(time_dim), nn.Linear(time_dim, 2 * time_dim),
                                            nn.Mish(), nn.Linear(2 * time_dim, time_dim))
        dims = [time_dim + horizon_steps * action_dim + cond_dim, *mlp_dims, horizon_steps * action_dim]
        self.mlp_mean = (RefResidualMLP if residual else RefMLP)(dims, activation)

    def forward(self, action, time, cond):
        b, ta, da = action.shape
        temb = self.time_embedding(time.view(b, 1)).view(b, self.time_dim)
        feature = torch.cat([action.view(b, -1), temb, cond["state"].view(b, -1)], dim=-1)
        return self.mlp_mean(feature).view(b, ta, da)


class RefReFlow(nn.Module):
    """ReFlow: the network under ``network``; sample() is its Euler sampler."""

    def __init__(self, network):
        super().__init__()
        self.network = network

    @torch.no_grad()
    def sample(self, cond, inference_steps, clip_intermediate_actions=True, z=None):
        x = z.clone()
        dt = (1 / inference_steps) * torch.ones_like(x)
        steps = torch.linspace(0, 1, inference_steps).repeat(x.shape[0], 1)
        for i in range(inference_steps):
            x += self.network(x, steps[:, i], cond) * dt
            if clip_intermediate_actions or i == inference_steps - 1:
                x = x.clamp(-1, 1)
        return x


VARIANTS = {"residual": dict(mlp_dims=[32, 32, 32], activation="ReLU", residual=True),
            "plain": dict(mlp_dims=[32, 24], activation="Mish", residual=False)}


def make_reference(variant: str, seed: int = 0) -> RefReFlow:
    torch.manual_seed(seed)
    model = RefReFlow(RefFlowMLP(HORIZON, ACTION_DIM, OBS_DIM, TIME_DIM, **VARIANTS[variant]))
    with torch.no_grad():          # non-zero biases and a field large enough to move samples
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def save_release_run(tmp_path, variant: str, hydra: bool = False):
    """A checkpoint in the release's layout (+ its normalization.npz and, optionally, the Hydra
    config the release writes beside the run). Returns (ckpt path, npz path, model, ema)."""
    run = tmp_path / f"run_{variant}"
    (run / "checkpoint").mkdir(parents=True)
    model, ema = make_reference(variant, 0), make_reference(variant, 1)
    path = run / "checkpoint" / "state_50.pt"
    torch.save({"epoch": 50, "model": model.state_dict(), "ema": ema.state_dict(),
                "optimizer": {}, "lr_scheduler": {}}, path)
    rng = np.random.default_rng(0)
    obs_min = rng.normal(size=OBS_DIM).astype(np.float32)
    act_min = -rng.uniform(0.5, 1.0, ACTION_DIM).astype(np.float32)
    npz = run / "normalization.npz"
    np.savez(npz, obs_min=obs_min, obs_max=obs_min + rng.uniform(0.01, 2.0, OBS_DIM).astype(np.float32),
             action_min=act_min, action_max=-act_min)
    if hydra:
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text(
            "model:\n  _target_: model.flow.reflow.ReFlow\n  network:\n    _target_: model.flow.mlp_flow.FlowMLP\n"
            f"    activation_type: {VARIANTS[variant]['activation']}\n    residual_style: {VARIANTS[variant]['residual']}\n")
    return path, npz, model, ema


def fpopp_config(overrides: list[str] = (), **algo):
    data = {"algorithm": "fpopp", "env": {"family": "robot", "id": "can", "horizon_steps": HORIZON, "act_steps": 2},
            "train": {"iterations": 2},
            "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 8},
            "algo": {"critic_hidden_sizes": [16], "minibatch_size": 16, "n_mc": 2, **algo}}
    return config_from_dict(apply_overrides(data, list(overrides)))     # as the CLI applies them


def imported_policy(ckpt: dict, tmp_path, name="base.pt") -> tuple[FlowPolicy, list[str]]:
    """The policy a fine-tuning config builds for the imported base (checked and loaded as
    FPO++ does); also the overrides that config used."""
    path = tmp_path / name
    torch.save(ckpt, path)
    overrides = config_overrides(ckpt, path)
    cfg = fpopp_config(overrides)
    FPOPP.preflight(cfg, SPEC)                              # check_base_policy: the arch matches
    policy = make_flow_policy(cfg, SPEC)
    policy.load_state_dict(load_base_policy(path)["policy"])   # strict: every key, every shape
    return policy.eval(), overrides


# --------------------------------------------------------------------------- the network and the sampler

@pytest.mark.parametrize("variant", ["residual", "plain"])
def test_imported_velocity_is_the_release_flow_mlp(tmp_path, variant):
    path, npz, model, _ = save_release_run(tmp_path, variant)
    ckpt = import_reinflow_checkpoint(path, npz, activation=VARIANTS[variant]["activation"])
    residual = VARIANTS[variant]["residual"]
    assert ckpt["arch"] == {"hidden_sizes": VARIANTS[variant]["mlp_dims"], "time_dim": TIME_DIM, "feature_dim": 64,
                            "horizon_steps": HORIZON, "obs_mode": "low_dim", "image_shape": None,
                            "time_embedding": "reinflow", **({"velocity_mlp": "residual"} if residual else {}),
                            **({"velocity_activation": "relu"} if residual else {})}   # mish is the default
    policy, _ = imported_policy(ckpt, tmp_path)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, HORIZON, ACTION_DIM, generator=gen)
    tau = torch.rand(64, generator=gen)
    tau[:3] = torch.tensor([0.0, 1.0, 0.5])
    obs = torch.randn(64, OBS_DIM, generator=gen)
    with torch.no_grad():
        ours = policy.velocity(x, tau, policy.encoder(obs))
        theirs = model.network(x, tau, {"state": obs[:, None, :]})      # cond_steps = 1: [B, 1, D]
    assert ours.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", ["residual", "plain"])
@pytest.mark.parametrize("steps", [1, 4, 10])
def test_euler_sample_is_the_release_sampler(tmp_path, variant, steps):
    path, npz, model, _ = save_release_run(tmp_path, variant)
    policy, overrides = imported_policy(import_reinflow_checkpoint(path, npz, activation=VARIANTS[variant]["activation"]),
                                        tmp_path)
    assert {"algo.flow_time_grid=linspace", "algo.flow_clip_intermediate=true"} <= set(overrides)
    gen = torch.Generator().manual_seed(4)
    eps = torch.randn(32, HORIZON, ACTION_DIM, generator=gen)
    obs = torch.randn(32, OBS_DIM, generator=gen)
    with torch.no_grad():
        ours = policy.sample(obs, eps, steps)
        theirs = model.sample({"state": obs[:, None, :]}, steps, clip_intermediate_actions=True, z=eps)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
        # the release without intermediate clipping: the same option off
        policy.clip_intermediate = False
        torch.testing.assert_close(policy.sample(obs, eps, steps),
                                   model.sample({"state": obs[:, None, :]}, steps, clip_intermediate_actions=False, z=eps),
                                   atol=1e-6, rtol=1e-6)
        if steps > 1:       # this package's grid k / K is another sampler: the option matters
            policy.time_grid = "left"
            assert not torch.allclose(policy.sample(obs, eps, steps), theirs, atol=1e-4)


def test_ema_or_raw_weights(tmp_path):
    path, npz, model, ema = save_release_run(tmp_path, "residual", hydra=True)
    x, tau, obs = torch.randn(8, HORIZON, ACTION_DIM), torch.rand(8), torch.randn(8, OBS_DIM)
    for use_ema, ref in ((True, ema), (False, model)):
        ckpt = import_reinflow_checkpoint(path, npz, use_ema=use_ema)        # activation from .hydra
        assert ckpt["source"]["weights"] == ("ema" if use_ema else "model") and ckpt["source"]["epoch"] == 50
        policy, _ = imported_policy(ckpt, tmp_path, f"base_{use_ema}.pt")
        with torch.no_grad():
            torch.testing.assert_close(policy.velocity(x, tau, obs), ref.network(x, tau, {"state": obs}),
                                       atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- normalisation

def test_statistics_file_normalises_as_the_release(tmp_path):
    from flowrl_ray.envs import robot
    from flowrl_ray.envs.robot.config import RobotEnvConfig
    path, npz, _, _ = save_release_run(tmp_path, "residual")
    ckpt = import_reinflow_checkpoint(path, npz, activation="ReLU")
    raw = np.load(npz)
    for k in ("obs_min", "obs_max", "action_min", "action_max"):
        np.testing.assert_array_equal(np.asarray(ckpt["normalization"][k], np.float32), raw[k])
    norm_path = write_norm_dataset(ckpt, "can", tmp_path / "base.norm.hdf5")
    env_cfg = RobotEnvConfig(family="robot", id="can", horizon_steps=HORIZON, act_steps=2, dataset=str(norm_path))
    assert robot.spec(env_cfg).obs_dim == OBS_DIM                   # a valid env.dataset for the task
    norm = robot.load_norm(env_cfg)
    rng = np.random.default_rng(1)
    obs = raw["obs_min"] + rng.uniform(-0.2, 1.2, (50, OBS_DIM)) * (raw["obs_max"] - raw["obs_min"])
    theirs = 2 * ((obs - raw["obs_min"]) / (raw["obs_max"] - raw["obs_min"] + 1e-6) - 0.5)
    np.testing.assert_allclose(norm.normalize_obs(obs), theirs, atol=1e-6)
    a = rng.uniform(-1, 1, (50, ACTION_DIM))
    np.testing.assert_allclose(norm.unnormalize_action(a),
                               (a + 1) / 2 * (raw["action_max"] - raw["action_min"]) + raw["action_min"], atol=1e-6)
    with pytest.raises(ReinFlowImportError, match=r"--task: lift has 19-d low-dim observations"):
        write_norm_dataset(ckpt, "lift", tmp_path / "lift.norm.hdf5")


# --------------------------------------------------------------------------- the base-policy contract

def test_defaults_leave_the_arch_and_the_network_unchanged(tmp_path):
    cfg = fpopp_config(hidden_sizes=[32, 32])
    assert set(policy_arch(cfg)) == {"hidden_sizes", "time_dim", "feature_dim", "horizon_steps", "obs_mode",
                                     "image_shape"}
    names = set(make_flow_policy(cfg, SPEC).state_dict())
    assert "velocity.net.0.weight" in names and "velocity.time_mlp.0.weight" in names
    # an old checkpoint (no options in its arch) still checks against a default config
    torch.save({"policy": {}, "arch": policy_arch(cfg)}, tmp_path / "old.pt")
    check_base_policy(fpopp_config(hidden_sizes=[32, 32], base_policy=str(tmp_path / "old.pt")))


def test_config_must_name_the_imported_architecture(tmp_path):
    path, npz, _, _ = save_release_run(tmp_path, "residual")
    ckpt = import_reinflow_checkpoint(path, npz, activation="ReLU")
    torch.save(ckpt, tmp_path / "base.pt")
    same_shapes = dict(base_policy=str(tmp_path / "base.pt"), hidden_sizes=[32, 32, 32], time_dim=TIME_DIM)
    with pytest.raises(ConfigError, match=r"config key 'algo\.time_embedding': 'flowrl' does not match .*'reinflow'"):
        FPOPP.preflight(fpopp_config(**same_shapes), SPEC)
    with pytest.raises(ConfigError, match=r"config key 'algo\.velocity_activation': 'mish' does not match .*'relu'"):
        FPOPP.preflight(fpopp_config(**same_shapes, time_embedding="reinflow", velocity_mlp="residual"), SPEC)
    with pytest.raises(ConfigError, match=r"config key 'algo\.hidden_sizes': a residual velocity MLP needs an odd"):
        FPOPP.validate_config(fpopp_config(hidden_sizes=[32, 32], velocity_mlp="residual"))


# --------------------------------------------------------------------------- bad input

def test_bad_inputs_give_one_clear_line(tmp_path):
    path, npz, model, _ = save_release_run(tmp_path, "plain")

    def fails(match, ckpt=path, norm=npz, **kw):
        with pytest.raises(ReinFlowImportError, match=match) as e:
            import_reinflow_checkpoint(ckpt, norm, **{"activation": "Mish", **kw})
        assert "\n" not in str(e.value)

    fails(r"checkpoint: no such file", ckpt=tmp_path / "none.pt")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    fails(r"checkpoint: cannot read .*junk\.pt", ckpt=tmp_path / "junk.pt")
    torch.save({"policy": {}, "arch": {}}, tmp_path / "ours.pt")
    fails(r"not a ReinFlow/ReFlow pretraining checkpoint .*flowrl-ray checkpoint", ckpt=tmp_path / "ours.pt")
    torch.save({"model": model.state_dict()}, tmp_path / "no_ema.pt")
    fails(r"has no 'ema' state dict", ckpt=tmp_path / "no_ema.pt", use_ema=True)
    torch.save({"model": model.network.state_dict()}, tmp_path / "bare.pt")
    fails(r"every key under 'network\.'", ckpt=tmp_path / "bare.pt")

    def variant(edit, name):
        sd = dict(model.state_dict())
        edit(sd)
        torch.save({"model": sd, "ema": sd}, tmp_path / name)
        return tmp_path / name

    fails(r"'network\.cond_mlp\.moduleList\.0\.linear_1\.weight': an observation MLP \(cond_mlp_dims\) is not supported",
          ckpt=variant(lambda sd: sd.update({"network.cond_mlp.moduleList.0.linear_1.weight": torch.zeros(4, 4)}), "c.pt"))
    fails(r"LayerNorm layers \(use_layernorm: true\) is not supported",
          ckpt=variant(lambda sd: sd.update({"network.mlp_mean.moduleList.0.norm_1.weight": torch.zeros(32)}), "n.pt"))
    fails(r"unknown layout: 'network\.extra\.weight'",
          ckpt=variant(lambda sd: sd.update({"network.extra.weight": torch.zeros(1)}), "u.pt"))
    fails(r"'network\.mlp_mean\.moduleList\.1\.linear_1\.weight' has shape \[24, 31\], expected \[24, 32\]",
          ckpt=variant(lambda sd: sd.update({"network.mlp_mean.moduleList.1.linear_1.weight": torch.zeros(24, 31)}),
                       "s.pt"))
    fails(r"missing parameter 'network\.time_embedding\.3\.bias'",
          ckpt=variant(lambda sd: sd.pop("network.time_embedding.3.bias"), "m.pt"))
    # statistics of another task: the state width does not add up
    np.savez(tmp_path / "other.npz", obs_min=np.zeros(19), obs_max=np.ones(19), action_min=-np.ones(7),
             action_max=np.ones(7))
    fails(r"velocity input is 67 = 28 \(chunk\) \+ 16 \(time\) \+ 23 \(state\), but the normalisation has 19",
          norm=tmp_path / "other.npz")
    np.savez(tmp_path / "partial.npz", obs_min=np.zeros(23))
    fails(r"--normalization: .*has no \['obs_max', 'action_min', 'action_max'\]", norm=tmp_path / "partial.npz")
    fails(r"--normalization: no such file", norm=tmp_path / "none.npz")
    fails(r"--activation: unknown activation 'Swish'", activation="Swish")
    fails(r"--activation: the checkpoint does not record its activation", activation=None)


# --------------------------------------------------------------------------- the CLI

def test_cli_import_reinflow(tmp_path, capsys):
    path, npz, _, ema = save_release_run(tmp_path, "residual", hydra=True)
    out = tmp_path / "pretrained" / "can_reflow.pt"
    code = cli.main(["import-reinflow", str(path), "--normalization", str(npz), "--out", str(out), "--ema",
                     "--task", "can"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["weights"] == "ema" and summary["norm_dataset"] == str(tmp_path / "pretrained" / "can_reflow.norm.hdf5")
    assert f"env.dataset={summary['norm_dataset']}" in summary["overrides"]
    assert "algo.velocity_activation=relu" in summary["overrides"]
    ckpt = load_base_policy(out)
    assert ckpt["dataset"] == summary["norm_dataset"] and ckpt["arch"]["velocity_mlp"] == "residual"
    # the printed overrides make a config that checks, builds and loads the base (env.dataset included)
    cfg = fpopp_config(summary["overrides"])
    FPOPP.preflight(cfg, SPEC)
    policy = make_flow_policy(cfg, SPEC)
    policy.load_state_dict(ckpt["policy"])
    x, tau, obs = torch.randn(8, HORIZON, ACTION_DIM), torch.rand(8), torch.randn(8, OBS_DIM)
    with torch.no_grad():
        torch.testing.assert_close(policy.velocity(x, tau, obs), ema.network(x, tau, {"state": obs}),
                                   atol=1e-6, rtol=1e-6)

    code = cli.main(["import-reinflow", str(tmp_path / "none.pt"), "--normalization", str(npz), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_USER_ERROR and err.count("\n") == 0
    assert err.startswith("flowrl-ray import-reinflow: error: checkpoint: no such file")
