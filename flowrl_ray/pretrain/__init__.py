"""Pretraining: the supervised start of a policy, one method per family of algorithms, one entry
point. No Ray.

    method     algorithms                 what it trains                                   writes
    flow_bc    FPO++, ReinFlow, FlowSAR   flow-matching behaviour cloning on robot demos   algo.base_policy
    text_sft   Flow-GRPO                  masked-diffusion SFT on the forms train split    algo.sft_checkpoint
    edm_qm9    FED-GRPO                   EDM on QM9's train split                         algo.base_model

:func:`pretrain` runs the method of the config's algorithm with the settings of its typed
``pretrain:`` section (:class:`~flowrl_ray.config.FlowBCPretrainConfig`,
:class:`~flowrl_ray.config.TextSFTPretrainConfig`, :class:`~flowrl_ray.config.EDMPretrainConfig`:
the algorithm's ``pretrain_config_class``; each names its ``method`` and the ``algo`` key it
``writes``); ``flowrl-ray pretrain CONFIG --flag ...`` sets the same keys from the command line.
Returns the method's JSON summary.
"""

from __future__ import annotations

import importlib

from flowrl_ray.config import Config, ConfigError


def pretrain(cfg: Config, progress: bool = True) -> dict:
    """Run the pretraining ``cfg.pretrain`` describes: ``flowrl_ray.pretrain.<method>.run`` with
    the section, where ``<method>`` is the section schema's (see the module docstring)."""
    p = cfg.pretrain
    if p is None:
        raise ConfigError(f"config key 'algorithm': {cfg.algorithm!r} has no pretraining (flowrl-ray "
                          f"pretrain starts fpopp, reinflow, flowsar, flow_grpo and fed_grpo)")
    method = importlib.import_module(f"{__name__}.{p.method}")
    return method.run(cfg, p, seed=cfg.seed if p.seed is None else p.seed, progress=progress)
