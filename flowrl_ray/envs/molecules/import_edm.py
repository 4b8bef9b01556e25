"""Import an EDM checkpoint written by the original EDM code (Hoogeboom et al. 2022, the public
repository ehoogeboom/e3_diffusion_for_molecules, and its forks) as a flowrl-ray base model: the
file ``algo.base_model`` loads (:func:`flowrl_ray.models.edm.load_base_model`). Pure torch; no Ray.

What the original code leaves in a run folder (``outputs/<exp_name>/``)::

    args.pickle                 its training script's arguments, an argparse.Namespace
    generative_model_ema.npy    torch.save of the diffusion module's state dict, EMA weights
    generative_model.npy        the same, raw weights

Its evaluation loads the EMA file when ``ema_decay`` > 0, else the raw one; so does this importer.
Loading runs no code: ``args.pickle`` goes through an unpickler that resolves only
``argparse.Namespace`` (and the builtin set types a Namespace may hold) and refuses every other
global, and the state dict through ``torch.load(weights_only=True)``.

The arguments become ``algo.model`` (:class:`~flowrl_ray.models.edm.EDMModelConfig`)::

    nf, n_layers, inv_sublayers         -> hidden_size, num_layers, inv_sublayers
    attention, tanh, norm_constant      -> the same names
    sin_embedding                       -> sin_embedding
    normalization_factor                -> aggregation_factor  (aggregation_method must be 'sum')
    diffusion_steps                     -> diffusion_steps
    diffusion_noise_schedule            -> 'polynomial_<p>' -> schedule_power p
    diffusion_noise_precision           -> noise_precision
    include_charges                     -> include_charges (atom_charges: the atomic numbers)
    normalize_factors [1, a, c]         -> atom_type_scale a, charge_scale c
    (QM9 with hydrogens)                -> max_atoms 29, num_atom_types 5 (H C N O F, EDM's order)
    (its dynamics' coords_range)        -> coords_range 15 (EDM's QM9 dynamics never sets another)

The state dict's names map onto :class:`~flowrl_ray.models.edm.EDM`'s, every one of them
(i = block, j = invariant sublayer)::

    dynamics.egnn.embedding / embedding_out          -> the same names
    dynamics.egnn.e_block_i.gcl_j.edge_mlp.0 / .2    -> dynamics.egnn.blocks.i.gcls.j.edge_in / edge_out
    dynamics.egnn.e_block_i.gcl_j.att_mlp.0          -> dynamics.egnn.blocks.i.gcls.j.att
    dynamics.egnn.e_block_i.gcl_j.node_mlp.0 / .2    -> dynamics.egnn.blocks.i.gcls.j.node_mlp.0 / .2
    dynamics.egnn.e_block_i.gcl_equiv.coord_mlp.0 / .2 / .4
                                                     -> dynamics.egnn.blocks.i.update.inp / mid / out
    gamma.gamma     the schedule's gamma_t table [T + 1]: recomputed here from the arguments and
                    checked against it (a schedule this package would compute otherwise is refused)
    buffer          a [1] placeholder of the diffusion module: checked, dropped

Refused with one line naming the key (:class:`EDMImportError`, a ConfigError): another model
(``model`` other than egnn_dynamics, ``probabilistic_model`` other than diffusion), a learned or
cosine schedule, another data set than QM9 with hydrogens (``dataset``, ``remove_h``), conditional
models (``conditioning``, ``context_node_nf``), no time input (``condition_time``), mean
aggregation, positions scaled (``normalize_factors[0]`` != 1), an argument unknown to EDM's QM9
training script, and any parameter name, shape or missing parameter the mapping does not cover.
The atom-count histogram that prompts are drawn from is this package's QM9 train split's (EDM's
split sizes), as for the bases trained here.
"""

from __future__ import annotations

import argparse
import io
import math
import pickle
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from flowrl_ray.config import ConfigError
from flowrl_ray.envs.molecules.chemistry import ATOM_TYPES, ATOMIC_NUMBERS
from flowrl_ray.envs.molecules.qm9 import MAX_ATOMS
from flowrl_ray.models.edm import EDM, EDMModelConfig, NoiseSchedule

ARGS_FILE = "args.pickle"
EMA_FILE, RAW_FILE = "generative_model_ema.npy", "generative_model.npy"
#: EDM's QM9 dynamics scale its coordinate update by this (its EGNN's default, never overridden)
EDM_COORDS_RANGE = 15.0
#: arguments of EDM's QM9 training script that shape training, data loading or logging only (not
#: the function the network computes nor the sampler): read and ignored
TRAINING_ONLY_ARGS = frozenset({
    "exp_name", "diffusion_loss_type", "n_epochs", "batch_size", "lr", "brute_force", "actnorm",
    "break_train_epoch", "dp", "clip_grad", "trace", "ode_regularization", "datadir", "filter_n_atoms",
    "dequantization", "n_report_steps", "wandb_usr", "no_wandb", "online", "no_cuda", "cuda", "save_model",
    "generate_epochs", "num_workers", "test_epochs", "data_augmentation", "resume", "start_epoch",
    "ema_decay", "augment_noise", "n_stability_samples", "visualize_every_batch", "current_epoch"})
#: arguments that shape the model, each mapped or checked below; a missing one takes the script's default
MODEL_ARG_DEFAULTS: dict[str, Any] = {
    "model": "egnn_dynamics", "probabilistic_model": "diffusion", "dataset": "qm9", "remove_h": False,
    "conditioning": [], "context_node_nf": 0, "condition_time": True, "nf": 128, "n_layers": 6,
    "inv_sublayers": 1, "attention": True, "tanh": True, "norm_constant": 1, "sin_embedding": False,
    "normalization_factor": 1, "aggregation_method": "sum", "diffusion_steps": 500,
    "diffusion_noise_schedule": "polynomial_2", "diffusion_noise_precision": 1e-5,
    "include_charges": True, "normalize_factors": [1, 4, 1]}
#: EDM parameter name -> this package's (regex, template); every EDM parameter matches exactly one
PARAMETER_MAP = (
    (r"dynamics\.egnn\.(embedding|embedding_out)\.(weight|bias)", r"dynamics.egnn.\1.\2"),
    (r"dynamics\.egnn\.e_block_(\d+)\.gcl_(\d+)\.edge_mlp\.0\.(weight|bias)", r"dynamics.egnn.blocks.\1.gcls.\2.edge_in.\3"),
    (r"dynamics\.egnn\.e_block_(\d+)\.gcl_(\d+)\.edge_mlp\.2\.(weight|bias)", r"dynamics.egnn.blocks.\1.gcls.\2.edge_out.\3"),
    (r"dynamics\.egnn\.e_block_(\d+)\.gcl_(\d+)\.att_mlp\.0\.(weight|bias)", r"dynamics.egnn.blocks.\1.gcls.\2.att.\3"),
    (r"dynamics\.egnn\.e_block_(\d+)\.gcl_(\d+)\.node_mlp\.([02])\.(weight|bias)", r"dynamics.egnn.blocks.\1.gcls.\2.node_mlp.\3.\4"),
    (r"dynamics\.egnn\.e_block_(\d+)\.gcl_equiv\.coord_mlp\.0\.(weight|bias)", r"dynamics.egnn.blocks.\1.update.inp.\2"),
    (r"dynamics\.egnn\.e_block_(\d+)\.gcl_equiv\.coord_mlp\.2\.(weight|bias)", r"dynamics.egnn.blocks.\1.update.mid.\2"),
    (r"dynamics\.egnn\.e_block_(\d+)\.gcl_equiv\.coord_mlp\.4\.weight", r"dynamics.egnn.blocks.\1.update.out.weight"),
)
SCHEDULE_KEY, BUFFER_KEY = "gamma.gamma", "buffer"
#: |gamma_EDM - gamma_here| allowed (EDM stores its float64 table in float32)
GAMMA_TOLERANCE = 1e-4


class EDMImportError(ConfigError):
    """A folder that is not (or not a supported) EDM checkpoint; one line naming the key or file."""


# --------------------------------------------------------------------------- reading (no code runs)

class _NamespaceUnpickler(pickle.Unpickler):
    """Resolves argparse.Namespace and the builtin set types, nothing else."""
    ALLOWED = {("argparse", "Namespace"): argparse.Namespace, ("builtins", "set"): set,
               ("builtins", "frozenset"): frozenset}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise EDMImportError(f"{ARGS_FILE}: refuses the global '{module}.{name}' (only argparse.Namespace "
                                 f"and plain values are read; loading runs no code)")
        return self.ALLOWED[(module, name)]


def read_edm_args(path: str | Path) -> dict[str, Any]:
    """``args.pickle`` -> its Namespace's attributes, through :class:`_NamespaceUnpickler`."""
    path = Path(path)
    if not path.is_file():
        raise EDMImportError(f"{ARGS_FILE}: no such file {str(path)!r}")
    try:
        args = _NamespaceUnpickler(io.BytesIO(path.read_bytes())).load()
    except EDMImportError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable pickle is the same user mistake
        raise EDMImportError(f"{ARGS_FILE}: cannot read {str(path)!r} as a pickled argparse.Namespace: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(args, argparse.Namespace):
        raise EDMImportError(f"{ARGS_FILE}: {str(path)!r} holds a {type(args).__name__}, not an argparse.Namespace")
    return vars(args)


def read_edm_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict saved by the original code, through ``torch.load(weights_only=True)``."""
    path = Path(path)
    if not path.is_file():
        raise EDMImportError(f"{path.name}: no such file {str(path)!r}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise EDMImportError(f"{path.name}: cannot read {str(path)!r} as a torch state dict: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise EDMImportError(f"{path.name}: {str(path)!r} is not a state dict (names -> tensors)")
    return state


# --------------------------------------------------------------------------- arguments -> algo.model

def _refuse(key: str, value: Any, why: str) -> EDMImportError:
    return EDMImportError(f"{ARGS_FILE}: '{key}' is {value!r}; {why}")


def _flag(args: dict, key: str) -> bool:
    value = args[key]
    if not isinstance(value, bool):
        raise _refuse(key, value, "expected True or False")
    return value


def _positive(args: dict, key: str, kind: type) -> Any:
    value = args[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok or (kind is int and int(value) != value):
        raise _refuse(key, value, f"expected a positive {kind.__name__}")
    return kind(value)


def model_config_of(args: dict[str, Any]) -> EDMModelConfig:
    """EDM's arguments -> :class:`EDMModelConfig`; EDMImportError naming the first argument that
    this package cannot reproduce (then the first argument it does not know)."""
    a = {**MODEL_ARG_DEFAULTS, **args}
    for key, want in (("model", "egnn_dynamics"), ("probabilistic_model", "diffusion"), ("dataset", "qm9"),
                      ("aggregation_method", "sum")):
        if a[key] != want:
            raise _refuse(key, a[key], f"only {want!r} is supported (EDM's QM9 equivariant diffusion model)")
    if _flag(a, "remove_h"):
        raise _refuse("remove_h", True, "QM9 without hydrogens (4 atom types) is not supported")
    if a["conditioning"] or a["context_node_nf"]:
        key = "conditioning" if a["conditioning"] else "context_node_nf"
        raise _refuse(key, a[key], "conditional models are not supported")
    if not _flag(a, "condition_time"):
        raise _refuse("condition_time", False, "the dynamics here always see the diffusion time")
    schedule = a["diffusion_noise_schedule"]
    m = re.fullmatch(r"polynomial_(\d+(?:\.\d*)?)", schedule) if isinstance(schedule, str) else None
    if m is None or not float(m.group(1)) > 0:
        raise _refuse("diffusion_noise_schedule", schedule, "only EDM's polynomial_<power> schedules are supported")
    factors = a["normalize_factors"]
    if (not isinstance(factors, (list, tuple)) or len(factors) != 3 or not all(
            isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0 for f in factors)):
        raise _refuse("normalize_factors", factors, "expected three positive numbers [x, one-hot, charge]")
    if factors[0] != 1:
        raise _refuse("normalize_factors", factors, "positions scaled (normalize_factors[0] != 1) are not supported")
    precision = a["diffusion_noise_precision"]
    if not (isinstance(precision, (int, float)) and not isinstance(precision, bool) and 0 < precision < 0.5):
        raise _refuse("diffusion_noise_precision", precision, "expected a number in (0, 0.5)")
    norm_constant = a["norm_constant"]
    if not (isinstance(norm_constant, (int, float)) and not isinstance(norm_constant, bool) and norm_constant >= 0):
        raise _refuse("norm_constant", norm_constant, "expected a number >= 0")
    unknown = sorted(k for k in args if k not in MODEL_ARG_DEFAULTS and k not in TRAINING_ONLY_ARGS)
    if unknown:
        raise _refuse(unknown[0], args[unknown[0]], "not an argument of EDM's QM9 training script; what it would "
                                                    "change in the model is unknown")
    return EDMModelConfig(
        num_layers=_positive(a, "n_layers", int), hidden_size=_positive(a, "nf", int),
        diffusion_steps=_positive(a, "diffusion_steps", int), noise_precision=float(precision),
        schedule_power=float(m.group(1)), max_atoms=MAX_ATOMS, num_atom_types=len(ATOM_TYPES),
        atom_type_scale=float(factors[1]), attention=_flag(a, "attention"), tanh=_flag(a, "tanh"),
        coords_range=EDM_COORDS_RANGE, norm_constant=float(norm_constant),
        aggregation_factor=_positive(a, "normalization_factor", float),
        inv_sublayers=_positive(a, "inv_sublayers", int), sin_embedding=_flag(a, "sin_embedding"),
        include_charges=_flag(a, "include_charges"), charge_scale=float(factors[2]),
        atom_charges=list(ATOMIC_NUMBERS))


# --------------------------------------------------------------------------- parameters

def parameter_name(edm_key: str) -> Optional[str]:
    """This package's name of EDM's parameter ``edm_key`` (:data:`PARAMETER_MAP`), or None."""
    for pattern, template in PARAMETER_MAP:
        if re.fullmatch(pattern, edm_key):
            return re.sub(pattern, template, edm_key)
    return None


def edm_parameter_names(cfg: EDMModelConfig) -> list[str]:
    """The parameter names EDM's code gives the model of ``cfg`` (its EGNN_dynamics_QM9 inside the
    diffusion module), in its order; the schedule table and the buffer are not among them."""
    names = [f"dynamics.egnn.embedding.{p}" for p in ("weight", "bias")]
    for i in range(cfg.num_layers):
        block = f"dynamics.egnn.e_block_{i}"
        for j in range(cfg.inv_sublayers):
            layers = ["edge_mlp.0", "edge_mlp.2", "node_mlp.0", "node_mlp.2"] + (["att_mlp.0"] if cfg.attention else [])
            names += [f"{block}.gcl_{j}.{layer}.{p}" for layer in layers for p in ("weight", "bias")]
        names += [f"{block}.gcl_equiv.coord_mlp.{k}.{p}" for k in (0, 2) for p in ("weight", "bias")]
        names.append(f"{block}.gcl_equiv.coord_mlp.4.weight")
    return names + [f"dynamics.egnn.embedding_out.{p}" for p in ("weight", "bias")]


def convert_state(state: dict[str, torch.Tensor], cfg: EDMModelConfig, source: str = EMA_FILE
                  ) -> dict[str, torch.Tensor]:
    """EDM's state dict -> :class:`EDM` ``(cfg)``'s, float32. Every EDM key is mapped (the
    schedule table and the placeholder buffer checked) and every parameter here is filled with its
    shape; anything else is an EDMImportError naming the key (``source``: the file, for messages)."""
    expected = edm_parameter_names(cfg)
    extra = [k for k in state if k not in expected and k not in (SCHEDULE_KEY, BUFFER_KEY)]
    if BUFFER_KEY in state and state[BUFFER_KEY].numel() != 1:
        extra.insert(0, BUFFER_KEY)
    if extra:
        raise EDMImportError(f"{source}: unknown parameter '{extra[0]}' (not one of EDM's egnn_dynamics model "
                             f"of {ARGS_FILE}: {cfg.num_layers} layers x {cfg.inv_sublayers} sublayers, "
                             f"attention {cfg.attention})")
    for key in expected + [SCHEDULE_KEY]:
        if key not in state:
            raise EDMImportError(f"{source}: no parameter '{key}' (the model of {ARGS_FILE} has it)")
    _check_schedule(state[SCHEDULE_KEY], cfg, source)
    want = {k: tuple(v.shape) for k, v in EDM(cfg).state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for key in expected:
        name = parameter_name(key)
        if name not in want:
            raise EDMImportError(f"{source}: '{key}' has no counterpart here (mapped to {name!r})")
        if tuple(state[key].shape) != want[name]:
            raise EDMImportError(f"{source}: '{key}' has shape {list(state[key].shape)}, the model of "
                                 f"{ARGS_FILE} expects {list(want[name])}")
        out[name] = state[key].detach().to(torch.float32).clone().contiguous()
    unfilled = [k for k in want if k not in out]
    if unfilled:
        raise EDMImportError(f"{source}: nothing maps onto '{unfilled[0]}'")
    return out


def _check_schedule(gamma: torch.Tensor, cfg: EDMModelConfig, source: str) -> None:
    here = NoiseSchedule(cfg.diffusion_steps, cfg.schedule_power, cfg.noise_precision).gamma
    if tuple(gamma.shape) != tuple(here.shape):
        raise EDMImportError(f"{source}: '{SCHEDULE_KEY}' has {gamma.numel()} entries, {ARGS_FILE}'s "
                             f"diffusion_steps={cfg.diffusion_steps} gives {here.numel()}")
    gap = float((gamma.double() - here).abs().max())
    if not gap <= GAMMA_TOLERANCE:
        raise EDMImportError(f"{source}: '{SCHEDULE_KEY}' differs from the polynomial schedule of {ARGS_FILE} "
                             f"by up to {gap:.3g} (a schedule this package does not compute)")


# --------------------------------------------------------------------------- the checkpoint

def qm9_train_histogram() -> np.ndarray:
    """P(atom count) of this package's QM9 train split (what its own bases sample prompts from)."""
    from flowrl_ray.envs.molecules.qm9 import atom_count_histogram, load_qm9, qm9_splits
    data = load_qm9()
    return atom_count_histogram(data.subset(qm9_splits(len(data), seed=0)["train"]).n_atoms, MAX_ATOMS)


def import_edm_checkpoint(folder: str | Path, histogram: Optional[np.ndarray] = None) -> dict:
    """An EDM run folder -> a base-model checkpoint {"state_dict", "model_config",
    "node_histogram", "source", "edm_args", ...} (the layout ``flowrl-ray pretrain`` writes, with
    no training state). ``histogram``: P(atom count) ``[max_atoms + 1]``; None reads QM9's train
    split (:func:`qm9_train_histogram`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise EDMImportError(f"DIR: no such folder {str(folder)!r}")
    args = read_edm_args(folder / ARGS_FILE)
    cfg = model_config_of(args)
    ema = args.get("ema_decay", 0.999)
    weights = EMA_FILE if isinstance(ema, (int, float)) and ema > 0 else RAW_FILE
    state = convert_state(read_edm_state(folder / weights), cfg, weights)
    histogram = qm9_train_histogram() if histogram is None else np.asarray(histogram, dtype=np.float64)
    plain = {k: v for k, v in args.items() if isinstance(v, (bool, int, float, str, list, tuple, type(None)))}
    return {"state_dict": state, "model_config": asdict(cfg), "node_histogram": histogram,
            "steps": None, "eval": None, "curve": [], "config": None,
            "source": {"format": "edm", "folder": str(folder), "weights": weights,
                       "epoch": args.get("current_epoch"), "exp_name": args.get("exp_name")},
            "edm_args": plain}
