"""Building a :class:`~flowrl_ray.config.schema.Config` from a mapping, key by key (unknown keys,
wrong types and bounds are a ConfigError naming the key), ``defaults:`` composition, ``a.b=c``
overrides, reading and saving YAML files."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from flowrl_ray.config.compat import ROBOT_KEYS_BEFORE_SECTIONS, _canonical_path, resolve_aliases
from flowrl_ray.config.schema import Config, EnvConfig, check_logging
from flowrl_ray.errors import ConfigError
from flowrl_ray.registry import check_family_kind, env_family, get_algorithm


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
