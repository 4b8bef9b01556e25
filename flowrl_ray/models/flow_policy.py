"""The flow policy that FPO++, FlowSAR and ReinFlow fine-tune and `flowrl-ray pretrain` trains:
its construction from a config, the architecture a base checkpoint records and the check that a
config matches it, the base checkpoint's loader, and the executed-row mask of a chunk. One place
for all of them, so that no algorithm imports another and pretraining imports no algorithm."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from flowrl_ray.checkpoint import load_base_checkpoint
from flowrl_ray.config import Config, ConfigError
from flowrl_ray.models.flow import FLOW_ARCH_DEFAULTS, FlowPolicy


class Shapes(Protocol):
    """What a flow policy needs of an env: its flat observation and action sizes (an env's
    ``EnvSpec`` has them; models import no env)."""
    @property
    def obs_dim(self) -> int: ...
    @property
    def action_dim(self) -> int: ...


ARCH_KEYS = ("hidden_sizes", "time_dim", "feature_dim", *FLOW_ARCH_DEFAULTS)


def check_flow_arch(cfg: Config) -> None:
    """The flow policy's keys that no field check covers: a residual velocity MLP needs an odd
    number of equal hidden sizes (the input layer's, then one pair per residual block)."""
    c = cfg.algo
    hidden = list(c.hidden_sizes)
    if getattr(c, "velocity_mlp", "plain") == "residual" and (len(hidden) % 2 == 0 or len(set(hidden)) != 1):
        raise ConfigError(f"config key 'algo.hidden_sizes': a residual velocity MLP needs an odd number of "
                          f"equal sizes (e.g. [512, 512, 512]), got {hidden}")
    if getattr(c, "time_embedding", "flowrl") == "reinflow" and c.time_dim < 4:
        raise ConfigError(f"config key 'algo.time_dim': the reinflow time embedding needs >= 4, got {c.time_dim}")


def image_shape(cfg: Config) -> tuple[int, int, int] | None:
    """(C, H, W) of the image observation, or None for low-dim observations."""
    if cfg.env.family != "robot" or cfg.env.obs_mode != "image":
        return None
    return 3 * len(cfg.env.cameras), cfg.env.image_size, cfg.env.image_size


def make_flow_policy(cfg: Config, spec: Shapes) -> FlowPolicy:
    """The flow policy a config describes (pretraining builds the same one)."""
    c = cfg.algo
    # n_mc: the (tau, eps) pairs FPO++ records per action; other algorithms record none.
    # The architecture and sampler options default to this package's network where a config
    # has no such keys.
    return FlowPolicy(spec.obs_dim, spec.action_dim, cfg.env.horizon_steps, c.hidden_sizes, c.time_dim,
                      c.flow_steps, getattr(c, "n_mc", 0), image_shape(cfg), c.feature_dim,
                      getattr(c, "cfm_huber_delta", 0.0), getattr(c, "cfm_reduction", "mean_dims"),
                      record_old_losses=records_old_losses(cfg),
                      **{k: getattr(c, k, default) for k, default in FLOW_ARCH_DEFAULTS.items()},
                      time_grid=getattr(c, "flow_time_grid", "left"),
                      clip_intermediate=getattr(c, "flow_clip_intermediate", False))


def records_old_losses(cfg: Config) -> bool:
    """Whether the rollout workers record the old CFM losses: only in async mode, where the
    learner no longer holds the weights a batch was sampled with (sync: the learner computes them
    in ``prepare``)."""
    return cfg.runtime.mode == "async"


def load_base_policy(path: str | Path) -> dict:
    """A pretraining checkpoint: {"policy": state dict, "arch": {...}, ...}."""
    return load_base_checkpoint(path, "algo.base_policy", ("policy", "arch"),
                                "a flowrl-ray pretraining checkpoint", "make one with `flowrl-ray pretrain`")


def check_base_policy(cfg: Config) -> None:
    """``algo.base_policy`` (when set) is a readable pretraining checkpoint whose architecture
    matches the config's; ConfigError naming the mismatched key otherwise."""
    c = cfg.algo
    if c.base_policy is None:
        return
    arch = load_base_policy(c.base_policy)["arch"]
    mine = policy_arch(cfg)
    # the architecture options are recorded only where they differ from the defaults
    theirs = {**arch, **{k: arch.get(k, default) for k, default in FLOW_ARCH_DEFAULTS.items()}}
    mine = {**mine, **{k: mine.get(k, default) for k, default in FLOW_ARCH_DEFAULTS.items()}}
    for key, value in theirs.items():
        if key in mine and mine[key] != value:
            where = {"image_shape": "env.cameras/env.image_size"}.get(
                key, f"algo.{key}" if key in ARCH_KEYS else f"env.{key}")
            raise ConfigError(f"config key '{where}': {mine[key]!r} does not match the base "
                              f"policy's {value!r} ({c.base_policy})")


def executed_row_mask(executed: torch.Tensor | None, count: int, horizon_steps: int,
                      act_steps: int, device: torch.device) -> torch.Tensor:
    """[M, Ta] float: 1 on the rows of each chunk the env executed, 0 on the rows it never ran.
    ``executed`` [M] (rows run per chunk step, as the env reports them) or None (every chunk ran
    its ``act_steps`` rows)."""
    if executed is None:
        executed = torch.full((count,), act_steps, device=device)
    rows = torch.arange(horizon_steps, device=device)[None]                  # [1, Ta]
    return (rows < executed.clamp(max=act_steps)[:, None]).float()           # [M, Ta]


def policy_arch(cfg: Config) -> dict:
    """What a base policy and the config must agree on. The velocity network's architecture
    options (:data:`FLOW_ARCH_DEFAULTS`) appear only where they differ from their defaults, so the
    dict of a default network is what it always was."""
    c = cfg.algo
    arch = {"hidden_sizes": list(c.hidden_sizes), "time_dim": c.time_dim, "feature_dim": c.feature_dim,
            "horizon_steps": cfg.env.horizon_steps, "obs_mode": "image" if image_shape(cfg) else "low_dim",
            "image_shape": list(image_shape(cfg)) if image_shape(cfg) else None}
    for key, default in FLOW_ARCH_DEFAULTS.items():
        if getattr(c, key, default) != default:
            arch[key] = getattr(c, key)
    return arch
