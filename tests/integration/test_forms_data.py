"""The committed SFT base (pretrained/forms_small_sft) loads into configs/flow_grpo/forms_small.yaml
and copies held-out values: greedy decoding of 16 evaluation tasks with the real model."""

from flowrl_ray.envs.forms.tasks import load_tasks

from conftest import REPO
from unit.envs.test_forms_data import _bench, catalog  # noqa: F401 (a fixture)


def test_the_committed_sft_base_loads_into_forms_small_and_copies_held_out_values(catalog):
    """pretrained/forms_small_sft (made by the command in docs/results.md) is the start and KL
    reference of configs/flow_grpo/forms_small.yaml. Greedy decoding of 8 evaluation tasks (values
    neither SFT nor RL saw): it writes well-formed gold action lines, free-text values copied among
    them. Measured on these 8 tasks: 0.38 of the gold lines, 11 of 26 free-text values (0.372 on
    96 tasks in docs/results.md); the 2,000-step CPU base scores 0.02 and copies none, so the bound
    fails for a base that does not copy."""
    from dataclasses import asdict

    import numpy as np

    from flowrl_ray.config import load_config
    from flowrl_ray.envs.forms import FormsSettings
    from flowrl_ray.models.masked_diffusion import load_sft_checkpoint
    from flowrl_ray.envs.forms import prompt_text
    bench = _bench()
    root = REPO
    cfg = load_config(root / "configs" / "flow_grpo" / "forms_small.yaml")
    c = cfg.algo
    lm = load_sft_checkpoint(root / c.sft_checkpoint, asdict(c.model), device="cpu")
    tasks = load_tasks("eval", seed=FormsSettings.from_env_cfg(cfg.env).task_seed, catalog=catalog, per_form=1)
    tasks = [tasks[i] for i in np.linspace(0, len(tasks) - 1, 8).round().astype(int)]
    outs = lm.generate_text([prompt_text(t, catalog) for t in tasks], c.gen_length, steps=c.num_generation_steps,
                            temperature=0.0, max_prompt_len=c.max_prompt_len, sampler=c.sampler)
    scored = [row for t, o in zip(tasks, outs) for row in bench.score_task(t, catalog[t.form_id], o, catalog)]
    accuracy = sum(r for _, r, _ in scored) / len(scored)
    copied = sum(r for _, r, free in scored if free)
    assert accuracy >= 0.15 and copied >= 3, (accuracy, copied, outs[:2])


def test_the_committed_sft_continuation_loads_and_has_run_its_whole_schedule():
    """pretrained/forms_small_sft_cont: the base trained further on CPU in resumed invocations (the
    command in docs/results.md) until its schedule ended: it loads into forms_small's model with
    the base's tokenizer, its settings are the documented ones, it holds a loss for each of their
    steps, and ``--resume`` refuses it by name (a finished run; a resume test of an unfinished one:
    test_text_sft_resume.py)."""
    import json
    from dataclasses import asdict

    from flowrl_ray.config import ConfigError, load_config
    from flowrl_ray.models.masked_diffusion import load_sft_checkpoint
    from flowrl_ray.pretrain.text_sft import SETTINGS_FILE, STATE_FILE, _start_model
    import pytest
    cfg = load_config(REPO / "configs" / "flow_grpo" / "forms_small.yaml")
    out = REPO / "pretrained" / "forms_small_sft_cont"
    lm = load_sft_checkpoint(out, asdict(cfg.algo.model), device="cpu")
    base = load_sft_checkpoint(REPO / "pretrained" / "forms_small_sft", asdict(cfg.algo.model), device="cpu")
    assert lm.tokenizer.get_vocab() == base.tokenizer.get_vocab()         # the base's tokenizer, trained further
    settings = json.loads((out / SETTINGS_FILE).read_text())
    assert {k: settings[k] for k in ("steps", "batch_size", "lr", "tasks_per_form", "init_from")} == {
        "steps": 6000, "batch_size": 32, "lr": 3e-4, "tasks_per_form": 4000, "init_from": "pretrained/forms_small_sft"}
    assert settings["finished"] and settings["train_s"] > 0
    assert len((out / "sft_metrics.jsonl").read_text().splitlines()) == settings["steps"]
    assert not (out / STATE_FILE).exists()                                 # finished: no optimiser state kept
    with pytest.raises(ConfigError, match="pretrain.resume.*6000 steps done"):
        _start_model(cfg, out, [], settings, True, None, 0, "cpu", False)
