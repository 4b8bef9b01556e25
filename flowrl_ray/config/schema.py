"""The config's schema: one dataclass per section (``env``, ``train``, ``runtime``, ``eval``,
``logging``, the ``pretrain`` sections, and the whole :class:`Config`); constraints live next to
the fields as metadata (:func:`check`), checked when a section is built (``loading``)."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from flowrl_ray.errors import ConfigError


def check(gt: float | None = None, ge: float | None = None, le: float | None = None,
          lt: float | None = None, help: str | None = None) -> dict:
    """Field metadata: numeric bounds, checked when the section is built (``loading.build_section``),
    and the key's one-line help where a command-line flag is made from it (``flowrl-ray pretrain``)."""
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
    # env-step runs: > 0 evaluates the starting policy before the first iteration and the final one
    # after the last on the same compare_episodes seeded episodes, by `sampling` and by the other
    # rule, and prints the paired gain with its 95 % bootstrap CI (start_vs_final.json and .png)
    compare_episodes: int = field(default=0, metadata=check(ge=0))
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
