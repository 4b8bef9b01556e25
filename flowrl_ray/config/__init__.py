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

The package: ``schema`` (the sections' dataclasses and their checks), ``loading`` (building a
Config from a mapping key by key, ``defaults:`` composition, overrides, YAML files) and ``compat``
(earlier names and layouts that configs and run directories still use: aliases, flattened
sections, the robot keys every section held before the families declared their own). Import
from ``flowrl_ray.config``.
"""

from flowrl_ray.config.compat import ROBOT_KEYS_BEFORE_SECTIONS, lift_flattened, resolve_aliases
from flowrl_ray.config.loading import (apply_overrides, build_env_section, build_section, check_known_keys,
                                       check_snapshots, config_from_dict, load_config, merge_config,
                                       parse_override, read_yaml, save_config)
from flowrl_ray.config.schema import (PRETRAIN_SECTIONS, RAY_ADDRESS_RE, Config, EDMPretrainConfig, EnvConfig,
                                      EvalConfig, FlowBCPretrainConfig, LoggingConfig, MediaConfig, MlflowConfig,
                                      RuntimeConfig, TextSFTPretrainConfig, TrainConfig, VideoConfig, WandbConfig,
                                      check, check_layer_sizes, check_logging, check_minibatch_size)
from flowrl_ray.errors import ConfigError

__all__ = ["ConfigError", "ROBOT_KEYS_BEFORE_SECTIONS", "lift_flattened", "resolve_aliases", "apply_overrides",
           "build_env_section", "build_section", "check_known_keys", "check_snapshots", "config_from_dict",
           "load_config", "merge_config", "parse_override", "read_yaml", "save_config", "PRETRAIN_SECTIONS",
           "RAY_ADDRESS_RE", "Config", "EDMPretrainConfig", "EnvConfig", "EvalConfig", "FlowBCPretrainConfig",
           "LoggingConfig", "MediaConfig", "MlflowConfig", "RuntimeConfig", "TextSFTPretrainConfig", "TrainConfig",
           "VideoConfig", "WandbConfig", "check", "check_layer_sizes", "check_logging", "check_minibatch_size"]
