"""Typed configuration: dataclass schema, YAML loading, `a.b=c` overrides, clear errors.

A config file is YAML with the sections below. Every mistake (unknown key, wrong type,
impossible value) raises :class:`ConfigError` whose message names the key, before Ray starts.

    seed: 0
    name: ppo-pendulum
    algorithm: ppo            # picks the schema of the `algo` section
    env: {family: gym, id: Pendulum-v1}
    train: {iterations: 50}
    runtime: {num_workers: 2, envs_per_worker: 4, rollout_length: 256, ...}
    eval: {interval: 10, episodes: 10}
    algo: {...}               # the algorithm's own hyperparameters
    logging: {wandb: {project: my-project, mode: offline}, mlflow: {tracking_uri: mlruns}}

Constraints live next to the fields as metadata: ``field(default=..., metadata=check(gt=0))``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import yaml

from flowrl_ray.errors import ConfigError  # noqa: F401 - defined there, raised and re-exported here
from flowrl_ray.registry import check_family_kind, env_family, get_algorithm


def check(gt: float | None = None, ge: float | None = None, le: float | None = None,
          lt: float | None = None, help: str | None = None) -> dict:
    """Field metadata with numeric bounds, checked by :func:`validate`, and the key's one-line
    help where a command-line flag is made from it (``flowrl-ray pretrain``)."""
    return {k: v for k, v in dict(gt=gt, ge=ge, le=le, lt=lt, help=help).items() if v is not None}


def check_layer_sizes(sizes: Any, key: str) -> None:
    """A network's hidden sizes: a non-empty list of positive ints, else ConfigError naming `key`."""
    if not sizes or not all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in sizes):
        raise ConfigError(f"config key '{key}': must be a non-empty list of positive ints, got {sizes}")


def check_minibatch_size(cfg: "Config", size: int, key: str = "algo.minibatch_size") -> None:
    """A minibatch no larger than one iteration's batch, else ConfigError naming `key`."""
    rt = cfg.runtime
    batch = rt.num_workers * rt.envs_per_worker * rt.rollout_length
    if size > batch:
        raise ConfigError(f"config key '{key}': {size} is larger than the batch per iteration "
                          f"({batch} = num_workers x envs_per_worker x rollout_length)")
    smallest = batch % size or size                  # the last minibatch of an epoch
    if rt.num_learners > smallest:
        raise ConfigError(f"config key 'runtime.num_learners': {rt.num_learners} learners share each "
                          f"minibatch, but the smallest has {smallest} rows ({key} {size}, batch {batch})")


# --------------------------------------------------------------------------- schema

@dataclass
class EnvConfig:
    """The ``env`` section's keys every family reads. A family with settings of its own declares
    its section as a subclass (its module's ``config_class``: the robot family's
    :class:`flowrl_ray.envs.robot.config.RobotEnvConfig`); the loader builds the family's class."""
    family: str = "gym"                 # adapter family (flowrl_ray.registry.BUILTIN_FAMILIES or a module)
    id: str = "Pendulum-v1"
    kwargs: dict = field(default_factory=dict)       # passed to the env constructor
    max_episode_steps: Optional[int] = field(default=None, metadata=check(gt=0))
    horizon_steps: int = field(default=1, metadata=check(gt=0))    # action chunk the policy emits
    act_steps: int = field(default=1, metadata=check(gt=0))        # rows of it executed per step

    def resolve(self, cfg: "Config") -> None:
        """Settings a family fills in from other sections once the config is built (none here)."""


#: The robot keys every saved config held, at these defaults, before the robot family declared its
#: own section: a run directory of another family written then still loads (they are dropped).
ROBOT_KEYS_BEFORE_SECTIONS = {
    "obs_mode": "low_dim", "cameras": ["agentview"], "image_size": 84, "dataset": None,
    "terminate_on_success": True, "reward": "sparse", "shaping_gamma": None,
    "perturb": {"placement_scale": 1.0, "object_scale": 1.0, "table_friction_scale": 1.0,
                "action_noise_std": 0.0, "camera_shift": [0.0, 0.0, 0.0], "light_scale": 1.0}}


@dataclass
class TrainConfig:
    iterations: int = field(default=100, metadata=check(gt=0))


RAY_ADDRESS_RE = re.compile(r"(ray://)?[\w.\-]+:\d+")   # runtime.ray_address: [ray://]host:port


@dataclass
class RuntimeConfig:
    num_workers: int = field(default=2, metadata=check(gt=0))
    envs_per_worker: int = field(default=4, metadata=check(gt=0))
    rollout_length: int = field(default=256, metadata=check(gt=0))   # env steps per env per batch
    num_cpus_per_worker: float = field(default=1.0, metadata=check(ge=0))
    num_gpus_per_worker: float = field(default=0.0, metadata=check(ge=0))
    learner_num_cpus: float = field(default=1.0, metadata=check(ge=0))
    learner_num_gpus: Optional[float] = field(default=None, metadata=check(ge=0))  # None: 1 if a GPU is visible
    # The learner group: ranks that split each minibatch and sum their gradients (torch.distributed:
    # gloo on CPUs, NCCL on GPUs), each with learner_num_cpus / learner_num_gpus, in one placement
    # group (pack: as few nodes as fit; spread: one node each where possible). 1: one learner.
    num_learners: int = field(default=1, metadata=check(gt=0))
    learner_placement: Literal["pack", "spread"] = "pack"
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = field(default=1, metadata=check(ge=0))     # async: policy versions a batch may lag
    max_worker_restarts: int = field(default=3, metadata=check(ge=0))
    max_learner_restarts: int = field(default=1, metadata=check(ge=0))   # each resumes from the last checkpoint
    sample_timeout_s: float = field(default=600.0, metadata=check(gt=0))
    checkpoint_interval: int = field(default=10, metadata=check(ge=0))  # 0: only at the end
    keep_checkpoints: int = field(default=3, metadata=check(gt=0))
    num_cpus: Optional[int] = field(default=None, metadata=check(gt=0))  # private local Ray only
    # The Ray cluster to use (the --address flag sets it; else $RAY_ADDRESS): host:port, ray://host:port,
    # "auto" (the cluster `ray start` last started on this machine) or "local" (a private local Ray,
    # even when RAY_ADDRESS is set). None and no RAY_ADDRESS: a private local Ray.
    ray_address: Optional[str] = None
    # local Ray only: nice value of its worker processes (Ray's default 15; the actors' children,
    # e.g. browsers, inherit it). 0 runs rollouts at the priority of any other program.
    worker_niceness: Optional[int] = field(default=None, metadata=check(ge=0, le=19))
    torch_threads: int = field(default=1, metadata=check(gt=0))          # per actor

    def __post_init__(self):
        a = self.ray_address
        if a is not None and a not in ("auto", "local") and not RAY_ADDRESS_RE.fullmatch(a):
            raise ConfigError(f"config key 'runtime.ray_address': expected host:port, ray://host:port, "
                              f"'auto' or 'local', got {a!r}")


@dataclass
class MediaConfig:
    """Pictures of behaviour written at evaluations: the first `episodes` evaluation episodes
    (tasks, samples) at every `every`-th evaluation. 0 episodes: none."""
    episodes: int = field(default=0, metadata=check(ge=0))
    every: int = field(default=1, metadata=check(gt=0))


@dataclass
class VideoConfig(MediaConfig):
    """Robot tasks: MP4s of evaluation episodes from one robosuite camera, size x size pixels
    (a multiple of 16, as H.264 wants), one frame per low-level step at the control frequency."""
    camera: str = "agentview"
    size: int = field(default=256, metadata=check(gt=0))


@dataclass
class EvalConfig:
    interval: int = field(default=10, metadata=check(ge=0))   # iterations; 0 disables periodic eval
    episodes: int = field(default=10, metadata=check(gt=0))
    # zero: deterministic actions (a Gaussian's mean, a flow integrated from eps = 0);
    # random: sampled as in training
    sampling: Literal["zero", "random"] = "zero"
    at_start: bool = False      # also evaluate the initial policy (a pretrained one) as iteration 0
    # robot tasks: videos of evaluation episodes, runs/<name>/videos/iter_<i>_<k>_<success|failure>.mp4,
    # at the evaluations numbered 0 (at_start), every, 2 * every, ... (iteration // interval) and the last
    video: VideoConfig = field(default_factory=VideoConfig)
    # forms and molecules: still pictures of evaluation outputs (page screenshots with the
    # submitted values and reward; a grid of sampled molecules marked stable/valid) in media/
    snapshots: MediaConfig = field(default_factory=MediaConfig)


@dataclass
class WandbConfig:
    """Weights & Biases run of a training (flowrl_ray.runtime.tracking). Offline runs are written
    under the run directory's wandb/ (or $WANDB_DIR) and uploaded later with `wandb sync`."""
    project: Optional[str] = None       # required unless mode is 'disabled'
    entity: Optional[str] = None        # user or team; None: the API key's default entity
    mode: Optional[Literal["online", "offline", "disabled"]] = None   # None: $WANDB_MODE, else online
    tags: list = field(default_factory=list)
    name: Optional[str] = None          # display name; None: the config's `name`
    group: Optional[str] = None         # e.g. the seeds of one experiment


@dataclass
class MlflowConfig:
    """MLflow run of a training (flowrl_ray.runtime.tracking)."""
    # http(s)://server:port, or a local store: a directory path or a file: URI (no server needed)
    tracking_uri: str = "mlruns"
    experiment: Optional[str] = None    # None: the config's `name`
    run_name: Optional[str] = None      # None: the config's `name`


@dataclass
class LoggingConfig:
    """Optional experiment trackers, next to metrics.jsonl and TensorBoard (always written).
    A section that is absent (null) is off; its library is imported only when it is on."""
    wandb: Optional[WandbConfig] = None
    mlflow: Optional[MlflowConfig] = None


def check_logging(cfg: "LoggingConfig") -> None:
    """Constraints of the `logging` section that need no network (the reachability of a tracking
    server is checked by flowrl_ray.runtime.tracking.preflight, before Ray starts)."""
    w = cfg.wandb
    if w is not None and w.mode != "disabled" and not w.project and not os.environ.get("WANDB_PROJECT"):
        raise ConfigError("config key 'logging.wandb.project': required (the W&B project to log to), "
                          "or set logging.wandb.mode: disabled")
    if w is not None and not all(isinstance(t, str) and t for t in w.tags):
        raise ConfigError(f"config key 'logging.wandb.tags': must be a list of non-empty strings, got {w.tags}")
    if cfg.mlflow is not None and not cfg.mlflow.tracking_uri.strip():
        raise ConfigError("config key 'logging.mlflow.tracking_uri': must not be empty")


# --------------------------------------------------------------------------- pretraining
# The `pretrain:` section: the settings of `flowrl-ray pretrain` (flowrl_ray.pretrain), one schema
# per method, chosen by the algorithm (its `pretrain_config_class`). Its command-line flags set
# the same keys. Each schema names its method (the module flowrl_ray.pretrain.<method>, whose
# `run` trains) and the `algo` key of the file it writes.

@dataclass
class FlowBCPretrainConfig:
    """Flow-matching behaviour cloning of the config's flow policy on robot demos (FPO++, ReinFlow,
    FlowSAR): writes the checkpoint ``algo.base_policy`` loads."""
    method: ClassVar[str] = "flow_bc"
    writes: ClassVar[str] = "base_policy"
    dataset: Optional[str] = field(default=None, metadata=check(help="the robomimic hdf5 (None: env.dataset)"))
    out: Optional[str] = field(default=None, metadata=check(help="the checkpoint (None: algo.base_policy)"))
    epochs: int = field(default=50, metadata=check(gt=0, help="passes over the demos"))
    batch_size: int = field(default=256, metadata=check(gt=0, help="pairs per step"))
    lr: float = field(default=1e-3, metadata=check(gt=0, help="Adam's learning rate"))
    eval_episodes: int = field(default=0, metadata=check(
        ge=0, help="then evaluate in the env: success by zero and by random sampling"))
    seed: Optional[int] = field(default=None, metadata=check(ge=0, help="None: the config's seed"))


@dataclass
class TextSFTPretrainConfig:
    """Masked-diffusion SFT of Flow-GRPO's language model on the forms train split (prompt ->
    gold action script): writes the checkpoint directory ``algo.sft_checkpoint`` loads."""
    method: ClassVar[str] = "text_sft"
    writes: ClassVar[str] = "sft_checkpoint"
    out: Optional[str] = field(default=None, metadata=check(help="the checkpoint directory (None: algo.sft_checkpoint)"))
    steps: Optional[int] = field(default=None, metadata=check(gt=0, help="optimiser steps (None and no epochs: 2000)"))
    epochs: Optional[int] = field(default=None, metadata=check(gt=0, help="passes, instead of steps"))
    batch_size: int = field(default=32, metadata=check(gt=0, help="task pairs per step"))
    lr: float = field(default=1e-3, metadata=check(gt=0, help="AdamW's peak learning rate"))
    tasks_per_form: int = field(default=200, metadata=check(
        gt=0, help="tasks drawn per training form (the sft task set: its own values, disjoint from RL and evaluation)"))
    copy_aux: float = field(default=0.0, metadata=check(
        ge=0, help="auxiliary 'repeat the quoted value' pairs per task pair"))
    init_from: Optional[str] = field(default=None, metadata=check(
        help="an SFT checkpoint directory whose weights and tokenizer are trained further (None: a new model)"))
    checkpoint_every: int = field(default=0, metadata=check(
        ge=0, help="also write the checkpoint every N steps (for --resume after a stop)"))
    max_minutes: float = field(default=0.0, metadata=check(
        ge=0, help="stop at the first step after M minutes of this invocation (resumable; 0: no limit)"))
    resume: bool = field(default=False, metadata=check(
        help="continue the unfinished run whose checkpoint is at the output path, exactly"))
    seed: Optional[int] = field(default=None, metadata=check(ge=0, help="None: the config's seed"))

    def __post_init__(self):
        if self.steps is not None and self.epochs is not None:
            raise ConfigError(f"config keys 'pretrain.steps' and 'pretrain.epochs': give one SFT budget, "
                              f"not both (got {self.steps} steps and {self.epochs} epochs)")


@dataclass
class EDMPretrainConfig:
    """EDM on QM9's train split for FED-GRPO: writes the checkpoint ``algo.base_model`` loads."""
    method: ClassVar[str] = "edm_qm9"
    writes: ClassVar[str] = "base_model"
    out: Optional[str] = field(default=None, metadata=check(help="the checkpoint (None: algo.base_model)"))
    steps: int = field(default=2000, metadata=check(gt=0, help="optimiser steps in all"))
    batch_size: Optional[int] = field(default=None, metadata=check(
        gt=0, help="molecules per step (None: 64; resumed: the checkpoint's)"))
    lr: Optional[float] = field(default=None, metadata=check(
        gt=0, help="AdamW's learning rate (None: 1e-4; resumed: the checkpoint's)"))
    eval_samples: int = field(default=1000, metadata=check(
        ge=0, help="then sample N molecules for EDM's stability, validity and uniqueness (0: skip)"))
    curve_every: int = field(default=0, metadata=check(
        ge=0, help="every N steps sample the EMA weights for a stability point and write the checkpoint"))
    curve_samples: int = field(default=200, metadata=check(gt=0, help="molecules per curve point"))
    checkpoint_every: int = field(default=0, metadata=check(ge=0, help="also write the checkpoint every N steps"))
    max_minutes: float = field(default=0.0, metadata=check(
        ge=0, help="end this invocation at the first checkpoint after M minutes (resumable; 0: no limit)"))
    resume: bool = field(default=False, metadata=check(
        help="continue the run whose checkpoint is at the output path (a new run when there is none)"))
    init_from: Optional[str] = field(default=None, metadata=check(
        help="a base checkpoint whose weights start a new run (e.g. one import-edm wrote)"))
    qm9: Optional[str] = field(default=None, metadata=check(
        help="a pack of QM9's train split (`flowrl-ray qm9-pack`) instead of the qm9pack package"))
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=check(
        help="where to train (auto: CUDA when there is one)"))
    seed: Optional[int] = field(default=None, metadata=check(ge=0, help="None: the config's seed"))


#: the built-in pretraining sections, whose keys ``flowrl-ray pretrain`` takes as flags
PRETRAIN_SECTIONS = (FlowBCPretrainConfig, TextSFTPretrainConfig, EDMPretrainConfig)


@dataclass
class Config:
    algorithm: str = "ppo"
    name: str = "run"
    seed: int = field(default=0, metadata=check(ge=0))
    env: EnvConfig = field(default_factory=EnvConfig)   # an instance of the family's config_class
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    algo: Any = None                  # instance of the algorithm's `config_class`
    pretrain: Any = None              # its `pretrain_config_class`'s (None: no pretraining)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- building

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`; return it (ints widen to float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"config key '{key}': must be one of {list(choices)}, got {value!r}")
        return value
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp in (dict, list) or origin in (dict, list):
        if isinstance(value, origin or tp):
            return value
    raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {value!r} "
                      f"({type(value).__name__})")


def check_known_keys(data: dict, allowed: list[str], prefix: str) -> None:
    """ConfigError for the first key of ``data`` not in ``allowed``, with the closest valid key
    (``prefix`` is the section's path with its trailing dot, e.g. ``"algo.model."``)."""
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else \
                f"; valid keys: {', '.join(prefix + f for f in allowed)}"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")


def resolve_aliases(cls: type, data: dict, prefix: str) -> dict:
    """One name per concept: a section's ``ALIASES`` (a class attribute of its dataclass: earlier
    or paper names, e.g. Flow-GRPO's ``learning_rate`` for ``lr``) are accepted in configs,
    overrides and old run directories and mapped to the one name; both given is a ConfigError.
    Its ``FLATTENED`` names earlier nested sections whose keys now live in the section itself
    (FlowSAR's ``algo.flowsar.lr`` is ``algo.lr``)."""
    data = lift_flattened(data, getattr(cls, "FLATTENED", ()), prefix)
    aliases = getattr(cls, "ALIASES", None)
    if not aliases or not any(k in data for k in aliases):
        return data
    data = dict(data)
    for alias, name in aliases.items():
        if alias in data:
            if name in data:
                raise ConfigError(f"config keys '{prefix}{alias}' and '{prefix}{name}': one setting given "
                                  f"twice ('{alias}' is another name of '{name}')")
            data[name] = data.pop(alias)
    return data


def lift_flattened(data: dict, flattened: tuple, prefix: str) -> dict:
    """``data`` with the keys of its ``flattened`` subsections moved up into it (a new mapping);
    a key given both ways is a ConfigError naming both."""
    if not any(sub in data for sub in flattened):
        return data
    out = {k: v for k, v in data.items() if k not in flattened}
    for sub in flattened:
        if sub not in data:
            continue
        inner = data[sub]
        if not isinstance(inner, dict):
            raise ConfigError(f"config key '{prefix}{sub}': expected a mapping, got {inner!r}")
        for k, v in inner.items():
            if k in out:
                raise ConfigError(f"config keys '{prefix}{sub}.{k}' and '{prefix}{k}': one setting given twice "
                                  f"('{sub}.{k}' is the earlier name of '{k}')")
            out[k] = v
    return out


def build_section(cls: type, data: dict, prefix: str) -> Any:
    """The dataclass ``cls`` from a config mapping, every key checked: unknown keys (with the
    closest valid one), aliases, types (nested dataclasses built the same way) and the bounds of
    each field's ``check(...)`` metadata; a ConfigError names the key (``prefix`` + field). The one
    schema checker: the config's sections and the env families' settings (``env.kwargs``) use it."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}': expected a mapping, "
                          f"got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    data = resolve_aliases(cls, data, prefix)
    check_known_keys(data, list(fields), prefix)
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        key, value, tp = prefix + name, data[name], hints[name]
        optional = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is typing.Union and len(optional) == 1 and dataclasses.is_dataclass(optional[0]):
            # an optional section (e.g. logging.wandb): null is off, a mapping (even {}) is on
            kwargs[name] = None if value is None else build_section(optional[0], value, key + ".")
        elif dataclasses.is_dataclass(tp):
            kwargs[name] = build_section(tp, value, key + ".")
        else:
            kwargs[name] = _coerce(value, tp, key)
    obj = cls(**kwargs)
    _check_bounds(obj, prefix)
    return obj


def _check_bounds(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        key, m = prefix + f.name, f.metadata
        if m and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key '{key}': must be a finite number, got {value}")
        if "gt" in m and not value > m["gt"]:
            raise ConfigError(f"config key '{key}': must be > {m['gt']}, got {value}")
        if "ge" in m and not value >= m["ge"]:
            raise ConfigError(f"config key '{key}': must be >= {m['ge']}, got {value}")
        if "lt" in m and not value < m["lt"]:
            raise ConfigError(f"config key '{key}': must be < {m['lt']}, got {value}")
        if "le" in m and not value <= m["le"]:
            raise ConfigError(f"config key '{key}': must be <= {m['le']}, got {value}")


def config_from_dict(data: dict) -> Config:
    """Build and validate a Config. The `algo` section's schema is the `config_class` of the
    algorithm that `algorithm` names (a built-in name, or "package.module:Class" for a plugin),
    the `pretrain` section's its `pretrain_config_class`; the algorithm's `validate_config(cfg)`
    then checks constraints that span sections."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping at the top level, got {type(data).__name__}")
    data = dict(data)
    algorithm_cls = get_algorithm(data.get("algorithm", "ppo"))
    algo_data = data.pop("algo", None) or {}
    pretrain_data = data.pop("pretrain", None)
    env_data = data.pop("env", None)
    cfg = build_section(Config, data, "")
    cfg.env = build_env_section({} if env_data is None else env_data)
    cfg.algo = build_section(algorithm_cls.config_class, algo_data, "algo.")
    pretrain_cls = getattr(algorithm_cls, "pretrain_config_class", None)
    if pretrain_cls is not None:
        cfg.pretrain = build_section(pretrain_cls, pretrain_data or {}, "pretrain.")
    elif pretrain_data:
        raise ConfigError(f"config key 'pretrain': algorithm {cfg.algorithm!r} has no pretraining "
                          f"(flowrl-ray pretrain starts fpopp, reinflow, flowsar, flow_grpo and fed_grpo)")
    gpus = cfg.runtime.learner_num_gpus
    if cfg.runtime.num_learners > 1 and gpus is not None and 0 < gpus < 1:
        raise ConfigError(f"config key 'runtime.learner_num_gpus': {gpus:g} GPU per rank; the ranks of a "
                          f"learner group (runtime.num_learners > 1) need a whole GPU each (NCCL)")
    if cfg.runtime.num_learners > 1 and not getattr(algorithm_cls, "data_parallel", False):
        raise ConfigError(f"config key 'runtime.num_learners': {cfg.algorithm!r} updates on one learner "
                          f"(its update does not split minibatches across a learner group yet); set it to 1")
    check_logging(cfg.logging)
    cfg.env.resolve(cfg)
    algorithm_cls.validate_config(cfg)
    check_family_kind(cfg.env.family, env_family(cfg.env.family), algorithm_cls.rollout_kind, cfg.algorithm)
    check_snapshots(cfg, algorithm_cls.rollout_kind)
    return cfg


def build_env_section(data: dict) -> EnvConfig:
    """The ``env`` section as its family's class (the family module's ``config_class``, else
    :class:`EnvConfig`), every key checked like any section's. A run directory of another family
    saved before the robot family declared its own section holds every robot key at its default
    (:data:`ROBOT_KEYS_BEFORE_SECTIONS`): such a section loads without them. Any other robot key
    on another family (one of them, or a changed value) is a ConfigError naming the key and the
    family."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key 'env': expected a mapping, got {data!r}")
    family = data.get("family", EnvConfig.family)
    cls = getattr(env_family(family), "config_class", EnvConfig)
    if not (isinstance(cls, type) and issubclass(cls, EnvConfig)):
        raise ConfigError(f"config key 'env.family': {family!r} declares config_class {cls!r}, "
                          f"which does not extend flowrl_ray.config.EnvConfig")
    own = {f.name for f in dataclasses.fields(cls)}
    foreign = [k for k in ROBOT_KEYS_BEFORE_SECTIONS if k in data and k not in own]
    saved_before = len(foreign) == len(ROBOT_KEYS_BEFORE_SECTIONS) and all(
        data[k] == ROBOT_KEYS_BEFORE_SECTIONS[k] for k in foreign)      # a whole saved section, untouched
    if foreign and not saved_before:      # name a changed key first, else the first one given
        key = next((k for k in foreign if data[k] != ROBOT_KEYS_BEFORE_SECTIONS[k]), foreign[0])
        raise ConfigError(f"config key 'env.{key}': a robot-family setting; env family "
                          f"{family!r} does not take it")
    return build_section(cls, {k: v for k, v in data.items() if k not in foreign}, "env.")


def check_snapshots(cfg: Config, rollout_kind: str) -> None:
    """eval.snapshots pictures what a scoring family's evaluation produced (forms, molecules):
    an env-step task (gym, robot: eval.video) or more pictures than evaluation samples is a
    ConfigError naming the key."""
    n = cfg.eval.snapshots.episodes
    if n and rollout_kind != "group":
        raise ConfigError(f"config key 'eval.snapshots.episodes': still pictures are made for the forms and "
                          f"molecules families (group algorithms); env family {cfg.env.family!r} records "
                          f"eval.video instead")
    if n > cfg.eval.episodes:
        raise ConfigError(f"config key 'eval.snapshots.episodes': {n} pictures of {cfg.eval.episodes} "
                          f"evaluation samples (eval.episodes)")


# --------------------------------------------------------------------------- overrides & files

def parse_override(text: str) -> tuple[list[str], Any]:
    """`algo.lr=1e-3` -> (['algo', 'lr'], 0.001). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.load(raw, Loader=_FloatLoader) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``key.sub=value`` overrides on a config mapping. An override of an `algo` key given by
    either of its names (see :func:`resolve_aliases`) replaces the setting however the file
    named it."""
    data = _deepcopy(data)
    schema = _algo_schema(data.get("algorithm", "ppo"))
    if isinstance(data.get("algo"), dict):
        data["algo"] = resolve_aliases(schema, data["algo"], "algo.")       # the one names
    for text in overrides:
        path, value = parse_override(text)
        if path[0] == "algo" and len(path) > 1:
            path = ["algo", *_canonical_path(schema, path[1:])]
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def _canonical_path(schema: type | None, path: list[str]) -> list[str]:
    """An `algo` key path by the one names: an earlier nested section's key lifted
    (``flowsar.lr`` -> ``lr``), an alias mapped (``learning_rate`` -> ``lr``)."""
    if len(path) > 1 and path[0] in getattr(schema, "FLATTENED", ()):
        path = path[1:]
    return [dict(getattr(schema, "ALIASES", None) or {}).get(path[0], path[0]), *path[1:]]


def merge_config(base: dict, top: dict) -> dict:
    """``top`` over ``base``, two config mappings (a new mapping): sections merge key by key, any
    other value (a list included) replaces; an `algo` key given by either of its names replaces
    the setting however ``base`` named it (both `algo` sections are read by their one names,
    :func:`resolve_aliases`, before they merge)."""
    schema = _algo_schema(top.get("algorithm", base.get("algorithm", "ppo")))
    base, top = ({**d, "algo": resolve_aliases(schema, d["algo"], "algo.")} if isinstance(d.get("algo"), dict) else d
                 for d in (base, top))
    return _merge(base, top)


def _merge(base: dict, top: dict) -> dict:
    out = _deepcopy(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else _deepcopy(value)
    return out


def _algo_schema(algorithm: Any) -> type | None:
    """The `algo` section's dataclass of an algorithm name (None when it does not resolve: the
    config check then names the key)."""
    try:
        return get_algorithm(algorithm).config_class
    except ConfigError:
        return None


def _deepcopy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deepcopy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deepcopy(v) for v in data]
    return data


class _FloatLoader(yaml.SafeLoader):
    """A SafeLoader that also reads `3e-4` (no dot) as a float, as people write it (YAML 1.1
    would read it as a string)."""


_FloatLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"))


def read_yaml(path: str | os.PathLike, _including: tuple = ()) -> dict:
    """A config file as a mapping, its ``defaults:`` composed: the files it lists (paths relative
    to it, each maybe composing others) merged in order, then the file's own keys over them
    (:func:`merge_config`). The result holds no ``defaults`` key: a run saves it resolved."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=_FloatLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    defaults = data.pop("defaults", None)
    if defaults is None:
        return data
    if isinstance(defaults, str):
        defaults = [defaults]
    if not isinstance(defaults, list) or not all(isinstance(d, str) and d for d in defaults):
        raise ConfigError(f"config key 'defaults' in {path}: expected a list of config files (paths relative "
                          f"to {path.parent}), got {defaults!r}")
    chain = (*_including, path.resolve())
    merged: dict = {}
    for entry in defaults:
        block = path.parent / entry
        if block.resolve() in chain:
            cycle = " -> ".join(str(p) for p in (*chain, block.resolve()))
            raise ConfigError(f"config key 'defaults' in {path}: {entry!r} includes itself ({cycle})")
        if not block.is_file():
            raise ConfigError(f"config key 'defaults' in {path}: no such file {entry!r} (looked at {block})")
        merged = merge_config(merged, read_yaml(block, chain))
    return merge_config(merged, data)


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> Config:
    """Load a YAML config, apply `key.sub=value` overrides, validate; raises ConfigError."""
    return config_from_dict(apply_overrides(read_yaml(path), overrides or []))


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    from flowrl_ray.utils import atomic_write_text
    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
