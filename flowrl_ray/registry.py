"""The registries: a config's ``algorithm`` key -> its class, and its ``env.family`` -> the
family's adapter module, each imported on first use. They sit below the config (which reads an
algorithm's schema and an env family's section through them) and import no algorithm or family
module themselves, so nothing points up from the config to the algorithms or the envs."""

from __future__ import annotations

import difflib
import importlib

from types import ModuleType

from flowrl_ray.errors import ConfigError

#: built-in name -> "module:Class"; imported on first use
BUILTIN_ALGORITHMS = {"ppo": "flowrl_ray.algorithms.ppo:PPO",
                      "cma_ppo": "flowrl_ray.algorithms.cma_ppo:CMAPPO",
                      "fpopp": "flowrl_ray.algorithms.fpopp:FPOPP",
                      "reinflow": "flowrl_ray.algorithms.reinflow:ReinFlow",
                      "flowsar": "flowrl_ray.algorithms.flowsar:FlowSAR",
                      "flow_grpo": "flowrl_ray.algorithms.flow_grpo:FlowGRPO",
                      "fed_grpo": "flowrl_ray.algorithms.fed_grpo:FEDGRPO"}


def get_algorithm(name: str) -> type:
    """The Algorithm class for a config's ``algorithm`` key; ConfigError naming the key if unknown."""
    target = BUILTIN_ALGORITHMS.get(name, name)
    if not isinstance(name, str) or ":" not in target:
        close = difflib.get_close_matches(str(name), list(BUILTIN_ALGORITHMS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"config key 'algorithm': unknown algorithm {name!r} (built in: "
                          f"{', '.join(BUILTIN_ALGORITHMS)}; plugins as 'package.module:Class'){hint}")
    module_name, attr = target.split(":", 1)
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"config key 'algorithm': cannot import {target!r}: {e}") from None
    # the kind classes of algorithms/base.py set rollout_kind (not imported here: base.py's
    # annotations name the config, which resolves `algorithm` through this function)
    if getattr(cls, "rollout_kind", None) not in ("env_step", "group"):
        raise ConfigError(f"config key 'algorithm': {target!r} is not an algorithm: subclass "
                          f"flowrl_ray.algorithms.base.EnvStepAlgorithm (rollout workers step envs with "
                          f"a policy copy) or GroupAlgorithm (the learner samples, workers score)")
    return cls


#: built-in family name -> module; any other name is imported as a module path (a plugin family)
BUILTIN_FAMILIES = {"gym": "flowrl_ray.envs.gym", "robot": "flowrl_ray.envs.robot", "forms": "flowrl_ray.envs.forms",
                    "molecules": "flowrl_ray.envs.molecules"}


def env_family(name: str) -> ModuleType:
    """The adapter module for ``env.family`` (imported lazily: families have heavy deps)."""
    module_name = BUILTIN_FAMILIES.get(name, name) if isinstance(name, str) else ""
    if "." not in module_name:
        raise ConfigError(f"config key 'env.family': unknown env family {name!r} (built in: "
                          f"{', '.join(BUILTIN_FAMILIES)}; plugins as 'package.module')")
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"config key 'env.family': cannot import {module_name!r}: {e}") from None
