"""The registries: a config's ``algorithm`` key -> its class, and its ``env.family`` -> the
family's adapter module, each imported on first use. They sit below the config (which reads an
algorithm's schema and an env family's section through them) and import no algorithm or family
module themselves, so nothing points up from the config to the algorithms or the envs."""

from __future__ import annotations

import difflib
import importlib

from types import ModuleType
from typing import Any, Protocol, runtime_checkable

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


@runtime_checkable
class EnvStepFamily(Protocol):
    """What an env-step family's module provides (for env-step algorithms; flowrl_ray.envs says
    what each returns): optional extras are ``config_class``, ``check_config``, ``check_video``,
    ``job_env_vars``."""

    def spec(self, env_cfg) -> Any: ...               # a flowrl_ray.envs.EnvSpec

    def make_vector_env(self, env_cfg, num_envs: int, **kwargs) -> Any: ...

    def snapshot(self, vec) -> bytes: ...

    def read_snapshot(self, blob: bytes) -> dict: ...

    def restore(self, blob: bytes) -> Any: ...


@runtime_checkable
class ScoringFamily(Protocol):
    """What a scoring family's module provides (for group algorithms): optional extras are
    ``save_snapshots`` (pictures at an evaluation) and ``build_section``."""

    def spec(self, env_cfg) -> Any: ...               # a flowrl_ray.envs.EnvSpec

    def make_scorer(self, env_cfg, seed: int, worker_id: int) -> Any: ...


#: the two contracts, by the rollout kind of the algorithms they serve
FAMILY_KINDS = {"env_step": EnvStepFamily, "group": ScoringFamily}


def missing_members(module: ModuleType, contract: type) -> list[str]:
    """The contract's functions that ``module`` does not provide."""
    members = [name for name in vars(contract) if not name.startswith("_")]
    return [name for name in members if not callable(getattr(module, name, None))]


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
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"config key 'env.family': cannot import {module_name!r}: {e}") from None
    if not any(isinstance(module, contract) for contract in FAMILY_KINDS.values()):
        lacks = "; ".join(f"as {'an env-step' if kind == 'env_step' else 'a scoring'} family it lacks "
                          f"{', '.join(missing_members(module, contract))}" for kind, contract in FAMILY_KINDS.items())
        raise ConfigError(f"config key 'env.family': {module_name!r} is not an env family: {lacks} "
                          f"(flowrl_ray.registry.EnvStepFamily / ScoringFamily)")
    return module


def check_family_kind(name: str, module: ModuleType, rollout_kind: str, algorithm: str) -> None:
    """The family of ``env.family`` serves the algorithm's kind of rollouts; ConfigError naming
    the key otherwise (an env-step algorithm on a scoring family, or the reverse)."""
    contract = FAMILY_KINDS[rollout_kind]
    if not isinstance(module, contract):
        needed = "an env-step family (its workers step envs)" if rollout_kind == "env_step" else \
            "a scoring family (its workers score what the learner samples)"
        raise ConfigError(f"config key 'env.family': algorithm {algorithm!r} needs {needed}; {name!r} lacks "
                          f"{', '.join(missing_members(module, contract))}")
