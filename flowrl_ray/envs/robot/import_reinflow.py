"""Import a flow policy pretrained with the ReinFlow / ReFlow release (github.com/ReinFlow/ReinFlow)
as a flowrl-ray base policy. Pure torch + numpy (+ h5py for the statistics file); no Ray.

What the release writes (its pretraining agent, every ``save_*``)::

    {"epoch": int, "model": state dict, "ema": state dict, "optimizer": ..., "lr_scheduler": ...}

where both state dicts are a ``ReFlow`` module's: its velocity network ``FlowMLP`` under the
``network.`` prefix,

    network.time_embedding.1 / .3         Linear(td, 2 td), Linear(2 td, td)   (.0: sin/cos, .2: Mish)
    network.mlp_mean.moduleList.{i}.linear_1                                   plain MLP (residual_style false)
    network.mlp_mean.layers.0             Linear(in, H)                        residual MLP (residual_style true)
    network.mlp_mean.layers.{j}.l1 / .l2  Linear(H, H) x 2, one pre-activation block each
    network.mlp_mean.layers.{n + 1}       Linear(H, Ta * Da)

with ``in = Ta * Da + td + obs_dim``, fed [flattened chunk, time embedding, state] in that order,
as this package's :class:`~flowrl_ray.models.flow.VelocityMLP` is. The mapping:

    time_embedding.1 / .3            -> velocity.time_mlp.0 / .2
    mlp_mean.moduleList.{i}.linear_1 -> velocity.net.{2 i}              (velocity_mlp: plain)
    mlp_mean.layers.0                -> velocity.net.first              (velocity_mlp: residual)
    mlp_mean.layers.{j}.l1 / .l2     -> velocity.net.blocks.{j - 1}.fc1 / .fc2
    mlp_mean.layers.{n + 1}          -> velocity.net.last

and the architecture options ``time_embedding: reinflow`` (the release's Diffuser embedding:
sin/cos of t itself at frequencies exp(-ln(1e4) k / (half - 1))) and the activation. The
checkpoint does not record the activation (the release's configs say it: ReLU in its robomimic and
gym ReFlow configs, FlowMLP's default is Mish): it comes from ``activation`` or from the Hydra
config the release writes beside its run (``<run>/.hydra/config.yaml``, the checkpoint being
``<run>/checkpoint/*.pt``).

Time: the release's convention is this package's (t = 0 noise, t = 1 data, x_t = t a + (1 - t) eps,
target a - eps), so no time is flipped. Its sampler (``ReFlow.sample``) takes K Euler steps of
1 / K at t = linspace(0, 1, K) (not k / K) and clips x to the action range [-1, 1] after every
step by default: ``time_grid: linspace`` and ``clip_intermediate: true`` reproduce it.

Normalisation: the release's ``normalization.npz`` (obs_min, obs_max, action_min, action_max) maps
observations with ``2 ((x - min) / (max - min + 1e-6) - 0.5)`` and actions back with
``(a + 1) / 2 (max - min) + min``: the robot env's min/max convention, up to the 1e-6, which the
statistics file written here folds into ``obs_max``. The robot env reads its statistics from
``env.dataset`` (a robomimic hdf5): :func:`write_norm_dataset` writes one that holds no demos, only
the task name and the statistics, for ``env.dataset`` to name.

Not representable (a clear error): image policies (``VisionFlowMLP``: a ViT backbone), an
observation MLP (``cond_mlp_dims``), LayerNorm (``use_layernorm``), an observation history
(``cond_steps`` > 1: the state width then is a multiple of the statistics').
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
import yaml

from flowrl_ray.config import ConfigError
from flowrl_ray.models.flow import FLOW_ARCH_DEFAULTS

#: the release's activation names (model/common/mlp.py) -> this package's (models/mlp.py)
ACTIVATION_NAMES = {"ReLU": "relu", "Mish": "mish", "Tanh": "tanh", "ELU": "elu", "GELU": "gelu",
                    "SiLU": "silu", "Softplus": "softplus"}
#: the release's observation normalisation divides by (max - min + this)
REINFLOW_OBS_EPS = 1e-6
NORM_KEYS = ("obs_min", "obs_max", "action_min", "action_max")
PREFIX = "network."


class ReinFlowImportError(ConfigError):
    """A file that is not (or not a supported) ReinFlow / ReFlow checkpoint; one line naming it."""


# --------------------------------------------------------------------------- reading

def read_reinflow_state(path: str | Path, use_ema: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """The velocity network's state dict (``network.`` stripped) of a release checkpoint, from its
    ``ema`` or ``model`` weights, and {"epoch": .., "weights": "ema" | "model"}."""
    path = Path(path)
    if not path.is_file():
        raise ReinFlowImportError(f"checkpoint: no such file {str(path)!r}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user mistake
        raise ReinFlowImportError(f"checkpoint: cannot read {str(path)!r} as a torch file: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        found = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        hint = " (a flowrl-ray checkpoint: load it as is)" if isinstance(ckpt, dict) and "policy" in ckpt else ""
        raise ReinFlowImportError(f"checkpoint: {str(path)!r} is not a ReinFlow/ReFlow pretraining checkpoint "
                                  f"(expected a dict with 'model' and 'ema' state dicts, found {found}){hint}")
    weights = "ema" if use_ema else "model"
    if weights not in ckpt or not isinstance(ckpt[weights], dict):
        raise ReinFlowImportError(f"checkpoint: {str(path)!r} has no {weights!r} state dict "
                                  f"(has {sorted(ckpt)})")
    state = ckpt[weights]
    if not state or not all(isinstance(k, str) and k.startswith(PREFIX) for k in state):
        odd = [k for k in state if not str(k).startswith(PREFIX)][:4]
        raise ReinFlowImportError(f"checkpoint: {str(path)!r} {weights!r} is not a ReFlow model's state dict "
                                  f"(expected every key under 'network.', found {odd or 'none'}; "
                                  f"fine-tuning checkpoints are not supported)")
    net = {k[len(PREFIX):]: v for k, v in state.items()}
    return net, {"epoch": ckpt.get("epoch"), "weights": weights}


def read_normalization(path: str | Path) -> dict[str, np.ndarray]:
    """The release's ``normalization.npz``: {obs_min, obs_max [D], action_min, action_max [A]}
    as float64."""
    path = Path(path)
    if not path.is_file():
        raise ReinFlowImportError(f"--normalization: no such file {str(path)!r}")
    try:
        with np.load(path) as f:
            missing = [k for k in NORM_KEYS if k not in f.files]
            if missing:
                raise ReinFlowImportError(f"--normalization: {str(path)!r} has no {missing} "
                                          f"(has {sorted(f.files)})")
            stats = {k: np.asarray(f[k], np.float64).reshape(-1) for k in NORM_KEYS}
    except ReinFlowImportError:
        raise
    except Exception as e:  # noqa: BLE001 - not an npz
        raise ReinFlowImportError(f"--normalization: cannot read {str(path)!r} as an npz: {e}") from None
    for kind in ("obs", "action"):
        lo, hi = stats[f"{kind}_min"], stats[f"{kind}_max"]
        if lo.shape != hi.shape or not np.all(np.isfinite(lo)) or not np.all(np.isfinite(hi)) or np.any(hi < lo):
            raise ReinFlowImportError(f"--normalization: {str(path)!r} {kind}_min / {kind}_max are not finite "
                                      f"bounds of one shape with min <= max")
    return stats


def hydra_activation(checkpoint: str | Path) -> str | None:
    """``model.network.activation_type`` of the Hydra config the release writes next to its run
    (``<run>/.hydra/config.yaml`` for ``<run>/checkpoint/x.pt``), or None when there is none."""
    for cfg_path in (Path(checkpoint).parent.parent / ".hydra" / "config.yaml",
                     Path(checkpoint).parent / ".hydra" / "config.yaml"):
        if cfg_path.is_file():
            try:
                cfg = yaml.safe_load(cfg_path.read_text())
                return cfg["model"]["network"].get("activation_type", "Mish")   # FlowMLP's default
            except (yaml.YAMLError, KeyError, TypeError, AttributeError):
                return None
    return None


# --------------------------------------------------------------------------- mapping

def _shape(state: dict, key: str) -> tuple[int, ...]:
    if key not in state:
        raise ReinFlowImportError(f"checkpoint: missing parameter 'network.{key}'")
    return tuple(state[key].shape)


def _linear(state: dict, src: str, dst: str, out: dict, shape: tuple[int, int]) -> None:
    """Copy Linear ``src`` -> ``dst`` (weight [out, in], bias [out]) after checking its shape."""
    for suffix, want in (("weight", shape), ("bias", shape[:1])):
        got = _shape(state, f"{src}.{suffix}")
        if got != want:
            raise ReinFlowImportError(f"checkpoint: 'network.{src}.{suffix}' has shape {list(got)}, "
                                      f"expected {list(want)}")
        out[f"velocity.{dst}.{suffix}"] = state[f"{src}.{suffix}"].detach().clone().float()


def _reject_unsupported(state: dict) -> None:
    keys = list(state)
    for pattern, what in ((r"^(backbone|compress\d?)\.", "an image policy (VisionFlowMLP, a ViT backbone)"),
                          (r"^cond_mlp\.", "an observation MLP (cond_mlp_dims)"),
                          (r"\.(norm_1|norm1|norm2)\.", "LayerNorm layers (use_layernorm: true)")):
        hits = [k for k in keys if re.search(pattern, k)]
        if hits:
            raise ReinFlowImportError(f"checkpoint: 'network.{hits[0]}': {what} is not supported")
    unknown = [k for k in keys if not re.match(r"^(time_embedding\.[13]|mlp_mean\.(moduleList\.\d+\.linear_1"
                                               r"|layers\.\d+(\.l[12])?))\.(weight|bias)$", k)]
    if unknown:
        raise ReinFlowImportError(f"checkpoint: unknown layout: 'network.{unknown[0]}' is not a FlowMLP "
                                  f"parameter (time_embedding.*, mlp_mean.*)")


def convert_flow_mlp(state: dict[str, torch.Tensor], obs_dim: int, action_dim: int
                     ) -> tuple[dict[str, torch.Tensor], dict]:
    """A FlowMLP state dict (no prefix) -> (this package's FlowPolicy state dict, architecture
    {hidden_sizes, time_dim, horizon_steps, velocity_mlp}). ``obs_dim`` and ``action_dim`` come
    from the normalisation statistics; every shape is checked against them."""
    _reject_unsupported(state)
    out: dict[str, torch.Tensor] = {}
    td = _shape(state, "time_embedding.1.weight")[-1]
    _linear(state, "time_embedding.1", "time_mlp.0", out, (2 * td, td))
    _linear(state, "time_embedding.3", "time_mlp.2", out, (td, 2 * td))

    plain = sorted(int(m.group(1)) for k in state
                   if (m := re.match(r"^mlp_mean\.moduleList\.(\d+)\.linear_1\.weight$", k)))
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r"^mlp_mean\.layers\.(\d+)\.", k))})
    if plain and layers or not (plain or layers):
        raise ReinFlowImportError("checkpoint: unknown layout: expected 'network.mlp_mean.moduleList.*' (plain MLP) "
                                  "or 'network.mlp_mean.layers.*' (residual MLP)")
    if plain:                                    # Linear, act, .., Linear: sizes d_0 .. d_L
        if plain != list(range(len(plain))) or len(plain) < 2:
            raise ReinFlowImportError(f"checkpoint: unknown layout: mlp_mean.moduleList layers {plain}")
        shapes = [_shape(state, f"mlp_mean.moduleList.{i}.linear_1.weight") for i in plain]   # [out, in]
        sizes = [shapes[0][1]] + [s[0] for s in shapes]
        for i in plain:
            _linear(state, f"mlp_mean.moduleList.{i}.linear_1", f"net.{2 * i}", out, (sizes[i + 1], sizes[i]))
        velocity_mlp = "plain"
    else:                                        # first, blocks 1 .. n, last
        n = len(layers) - 2
        if layers != list(range(n + 2)) or n < 0:
            raise ReinFlowImportError(f"checkpoint: unknown layout: mlp_mean.layers {layers}")
        width, in_dim = _shape(state, "mlp_mean.layers.0.weight")
        chunk = _shape(state, f"mlp_mean.layers.{n + 1}.weight")[0]
        _linear(state, "mlp_mean.layers.0", "net.first", out, (width, in_dim))
        for j in range(1, n + 1):
            for src, dst in (("l1", "fc1"), ("l2", "fc2")):
                _linear(state, f"mlp_mean.layers.{j}.{src}", f"net.blocks.{j - 1}.{dst}", out, (width, width))
        _linear(state, f"mlp_mean.layers.{n + 1}", "net.last", out, (chunk, width))
        sizes = [in_dim] + [width] * (1 + 2 * n) + [chunk]
        velocity_mlp = "residual"

    chunk = sizes[-1]
    if chunk % action_dim:
        raise ReinFlowImportError(f"checkpoint: the velocity output has {chunk} entries, not a multiple of the "
                                  f"normalisation's {action_dim} action dims (statistics of another task?)")
    horizon = chunk // action_dim
    cond_dim = sizes[0] - chunk - td
    if cond_dim != obs_dim:
        more = (f" (an observation history of {cond_dim // obs_dim} steps, cond_steps > 1, is not supported)"
                if cond_dim > obs_dim and cond_dim % obs_dim == 0 else " (statistics of another task?)")
        raise ReinFlowImportError(f"checkpoint: the velocity input is {sizes[0]} = {chunk} (chunk) + {td} (time) + "
                                  f"{cond_dim} (state), but the normalisation has {obs_dim} observation dims{more}")
    arch = {"hidden_sizes": sizes[1:-1], "time_dim": td, "horizon_steps": horizon, "velocity_mlp": velocity_mlp}
    return out, arch


# --------------------------------------------------------------------------- the checkpoint

def import_reinflow_checkpoint(path: str | Path, normalization_npz: str | Path, use_ema: bool = False,
                               activation: str | None = None, flow_steps: int = 4) -> dict:
    """A release ReFlow checkpoint + its ``normalization.npz`` -> a flowrl-ray pretraining
    checkpoint (the layout ``flowrl-ray pretrain`` writes: {"policy", "arch", "config", ...}),
    loadable by ``load_base_policy`` and ``FlowPolicy.load_state_dict``.

    ``use_ema``: the EMA weights (what the release evaluates and fine-tunes from) rather than the
    raw ones. ``activation``: the velocity MLP's, in the release's spelling ("ReLU") or this
    package's ("relu"); None reads it from the run's Hydra config. ``flow_steps``: recorded as the
    suggested K (the checkpoint does not store the steps it was evaluated with; the release
    fine-tunes with 4 in its gym and robomimic state configs, 1 in its robomimic image ones).
    Extra entries: "normalization" (the npz's statistics, lists), "sampler" (the release's),
    "source" (path, weights, epoch).
    """
    stats = read_normalization(normalization_npz)
    state, source = read_reinflow_state(path, use_ema)
    act = activation if activation is not None else hydra_activation(path)
    if act is None:
        raise ReinFlowImportError("--activation: the checkpoint does not record its activation and no readable "
                                  "<run>/.hydra/config.yaml names it; pass the FlowMLP's activation_type (the "
                                  "release's state ReFlow configs use ReLU; FlowMLP's default is Mish)")
    act_name = ACTIVATION_NAMES.get(act, act if act in ACTIVATION_NAMES.values() else None)
    if act_name is None:
        raise ReinFlowImportError(f"--activation: unknown activation {act!r}; choose one of "
                                  f"{', '.join(ACTIVATION_NAMES)}")
    obs_dim, action_dim = len(stats["obs_min"]), len(stats["action_min"])
    policy, shapes = convert_flow_mlp(state, obs_dim, action_dim)
    options = {"time_embedding": "reinflow", "velocity_mlp": shapes["velocity_mlp"], "velocity_activation": act_name}
    # the keys policy_arch writes, then the options that differ from this package's defaults
    arch = {"hidden_sizes": shapes["hidden_sizes"], "time_dim": shapes["time_dim"], "feature_dim": 64,
            "horizon_steps": shapes["horizon_steps"], "obs_mode": "low_dim", "image_shape": None,
            **{k: v for k, v in options.items() if v != FLOW_ARCH_DEFAULTS[k]}}
    return {"policy": policy, "arch": arch, "config": None, "dataset": None,
            "obs_dim": obs_dim, "action_dim": action_dim,
            "normalization": {k: v.tolist() for k, v in stats.items()} | {"obs_span_eps": REINFLOW_OBS_EPS},
            "sampler": {"flow_steps": flow_steps, "time_grid": "linspace", "clip_intermediate": True},
            "source": {"checkpoint": str(path), "normalization": str(normalization_npz), **source}}


def config_overrides(ckpt: dict, base_policy: str | Path, norm_dataset: str | Path | None = None) -> list[str]:
    """The ``key=value`` overrides a flow-policy config needs to fine-tune an imported base with
    the release's network and sampler (and, as the release does, executing whole chunks)."""
    arch, sampler = ckpt["arch"], ckpt["sampler"]
    out = [f"algo.base_policy={base_policy}",
           f"algo.hidden_sizes=[{','.join(str(h) for h in arch['hidden_sizes'])}]",
           f"algo.time_dim={arch['time_dim']}", f"env.horizon_steps={arch['horizon_steps']}",
           f"env.act_steps={arch['horizon_steps']}"]
    out += [f"algo.{k}={arch.get(k, default)}" for k, default in FLOW_ARCH_DEFAULTS.items()]
    out += [f"algo.flow_steps={sampler['flow_steps']}", f"algo.flow_time_grid={sampler['time_grid']}",
            f"algo.flow_clip_intermediate={str(sampler['clip_intermediate']).lower()}"]
    if norm_dataset is not None:
        out.append(f"env.dataset={norm_dataset}")
    return out


def write_norm_dataset(ckpt: dict, task: str, path: str | Path) -> Path:
    """A robomimic-layout hdf5 for ``env.dataset`` that holds no demos: the task's env name and
    the imported statistics (``stats/``, read by the robot env), with the release's 1e-6 folded
    into obs_max so that the env's 2 (x - min) / (max - min) - 1 is the release's normalisation.
    Low-dim observations only (the release's state order is the robot env's)."""
    from flowrl_ray.envs.robot.robomimic_data import ROBOSUITE_ENV_TYPE, DemoWriter, NormStats, write_stats
    from flowrl_ray.envs.robot.env import LOW_DIM_KEYS, PROPRIO_DIM, get_task
    t = get_task(task)
    norm = ckpt["normalization"]
    obs_min, obs_max = np.asarray(norm["obs_min"], np.float64), np.asarray(norm["obs_max"], np.float64)
    if len(obs_min) != PROPRIO_DIM + t.object_dim:
        raise ReinFlowImportError(f"--task: {t.name} has {PROPRIO_DIM + t.object_dim}-d low-dim observations, "
                                  f"the imported statistics {len(obs_min)}-d")
    if ckpt["action_dim"] != 7:
        raise ReinFlowImportError(f"--task: robot tasks take 7-d actions, the imported policy emits "
                                  f"{ckpt['action_dim']}-d ones")
    stats = NormStats(LOW_DIM_KEYS, obs_min, obs_max + norm.get("obs_span_eps", 0.0),
                      np.asarray(norm["action_min"], np.float64), np.asarray(norm["action_max"], np.float64))
    path = Path(path)
    env_args = {"env_name": t.env_name, "env_version": None, "type": ROBOSUITE_ENV_TYPE, "env_kwargs": {},
                "flowrl_ray": "normalisation statistics imported from a ReinFlow normalization.npz; no demos"}
    with DemoWriter(path, env_args):
        pass
    write_stats(path, stats)
    return path
