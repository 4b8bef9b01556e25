"""Pretraining: the supervised start of a policy, one method per family of algorithms, one entry
point. No Ray.

    method     algorithms                 what it trains                                   writes
    flow_bc    FPO++, ReinFlow, FlowSAR   flow-matching behaviour cloning on robot demos   algo.base_policy
    text_sft   Flow-GRPO                  masked-diffusion SFT on the forms train split    algo.sft_checkpoint
    edm_qm9    FED-GRPO                   EDM on QM9's train split                         algo.base_model

:func:`pretrain` runs the method of the config's algorithm with the settings of its typed
``pretrain:`` section (:class:`~flowrl_ray.config.FlowBCPretrainConfig`,
:class:`~flowrl_ray.config.TextSFTPretrainConfig`, :class:`~flowrl_ray.config.EDMPretrainConfig`:
the algorithm's ``pretrain_config_class``); ``flowrl-ray pretrain CONFIG --flag ...`` sets the same
keys from the command line. Returns the method's JSON summary.
"""

from __future__ import annotations

from flowrl_ray.config import (Config, ConfigError, EDMPretrainConfig, FlowBCPretrainConfig,
                               TextSFTPretrainConfig)

#: the method of each `pretrain:` schema, and the `algo` key naming the file it writes
METHODS = {FlowBCPretrainConfig: ("flow_bc", "base_policy"),
           TextSFTPretrainConfig: ("text_sft", "sft_checkpoint"),
           EDMPretrainConfig: ("edm_qm9", "base_model")}


def pretrain(cfg: Config, progress: bool = True) -> dict:
    """Run the pretraining ``cfg.pretrain`` describes (see the module docstring)."""
    p = cfg.pretrain
    if p is None:
        raise ConfigError(f"config key 'algorithm': {cfg.algorithm!r} has no pretraining (flowrl-ray "
                          f"pretrain starts fpopp, reinflow, flowsar, flow_grpo and fed_grpo)")
    seed = cfg.seed if p.seed is None else p.seed
    if isinstance(p, FlowBCPretrainConfig):
        from flowrl_ray.pretrain.flow_bc import pretrain_flow_policy
        return pretrain_flow_policy(cfg, dataset=p.dataset, out=p.out, epochs=p.epochs,
                                    batch_size=p.batch_size, lr=p.lr, seed=seed,
                                    eval_episodes=p.eval_episodes, progress=progress)
    if isinstance(p, TextSFTPretrainConfig):
        from flowrl_ray.pretrain.text_sft import pretrain_text
        if p.steps is not None and p.epochs is not None:
            raise ConfigError(f"config keys 'pretrain.steps' and 'pretrain.epochs': give one SFT budget, "
                              f"not both (got {p.steps} steps and {p.epochs} epochs)")
        steps = 2000 if p.steps is None and p.epochs is None else p.steps
        return pretrain_text(cfg, out=p.out, epochs=p.epochs, steps=steps, batch_size=p.batch_size,
                             lr=p.lr, tasks_per_form=p.tasks_per_form, seed=seed, copy_aux=p.copy_aux,
                             progress=progress)
    if isinstance(p, EDMPretrainConfig):
        from flowrl_ray.pretrain.edm_qm9 import pretrain_edm
        return pretrain_edm(cfg, out=p.out, steps=p.steps, batch_size=p.batch_size, lr=p.lr, seed=seed,
                            eval_samples=p.eval_samples, curve_every=p.curve_every,
                            curve_samples=p.curve_samples, checkpoint_every=p.checkpoint_every,
                            max_minutes=p.max_minutes, resume=p.resume, device=p.device,
                            progress=progress)
    raise ConfigError(f"config key 'pretrain': no pretraining method for {type(p).__name__}")
