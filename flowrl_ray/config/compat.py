"""Earlier names and layouts that configs, overrides and saved run directories still use: a
section's ``ALIASES`` (one name per concept) and ``FLATTENED`` subsections, and the robot keys
every ``env`` section held before the families declared their own sections."""

from __future__ import annotations

from flowrl_ray.errors import ConfigError


#: The robot keys every saved config held, at these defaults, before the robot family declared its
#: own section: a run directory of another family written then still loads (they are dropped).
ROBOT_KEYS_BEFORE_SECTIONS = {
    "obs_mode": "low_dim", "cameras": ["agentview"], "image_size": 84, "dataset": None,
    "terminate_on_success": True, "reward": "sparse", "shaping_gamma": None,
    "perturb": {"placement_scale": 1.0, "object_scale": 1.0, "table_friction_scale": 1.0,
                "action_noise_std": 0.0, "camera_shift": [0.0, 0.0, 0.0], "light_scale": 1.0}}


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


def _canonical_path(schema: type | None, path: list[str]) -> list[str]:
    """An `algo` key path by the one names: an earlier nested section's key lifted
    (``flowsar.lr`` -> ``lr``), an alias mapped (``learning_rate`` -> ``lr``)."""
    if len(path) > 1 and path[0] in getattr(schema, "FLATTENED", ()):
        path = path[1:]
    return [dict(getattr(schema, "ALIASES", None) or {}).get(path[0], path[0]), *path[1:]]
