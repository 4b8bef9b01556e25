"""The typed `pretrain:` section and its one entry point, without training: each algorithm's schema
and defaults, config mistakes naming the key, flags mapped onto the section's keys, and a flag the
algorithm's method does not take refused before anything runs."""

import json

import pytest
import yaml

import flowrl_ray.pretrain as pretraining
from flowrl_ray.cli import main
from flowrl_ray.config import (ConfigError, EDMPretrainConfig, FlowBCPretrainConfig, TextSFTPretrainConfig,
                               config_from_dict, load_config, read_yaml, save_config)

from conftest import REPO

CONFIGS = {"fpopp": ("fpopp/lift_state_quickstart.yaml", FlowBCPretrainConfig),
           "reinflow": ("reinflow/lift_state_quickstart.yaml", FlowBCPretrainConfig),
           "flowsar": ("flowsar/lift_state_quickstart.yaml", FlowBCPretrainConfig),
           "flow_grpo": ("flow_grpo/forms_small.yaml", TextSFTPretrainConfig),
           "fed_grpo": ("fed_grpo/qm9_small.yaml", EDMPretrainConfig)}


@pytest.mark.parametrize("algorithm", sorted(CONFIGS))
def test_each_pretraining_algorithm_gets_its_methods_schema_with_defaults(algorithm, tmp_path):
    path, schema = CONFIGS[algorithm]
    cfg = load_config(REPO / "configs" / path)
    assert type(cfg.pretrain) is schema and cfg.pretrain == schema()
    assert schema.writes in vars(cfg.algo)                 # the algo key naming the file it writes
    save_config(cfg, tmp_path / "config.yaml")             # the resolved section is saved and reloads
    assert load_config(tmp_path / "config.yaml").pretrain == cfg.pretrain


def test_defaults_are_the_methods_and_live_in_the_schema():
    assert (FlowBCPretrainConfig().epochs, FlowBCPretrainConfig().batch_size, FlowBCPretrainConfig().lr) == (50, 256, 1e-3)
    assert (TextSFTPretrainConfig().batch_size, TextSFTPretrainConfig().tasks_per_form) == (32, 200)
    assert (EDMPretrainConfig().steps, EDMPretrainConfig().eval_samples, EDMPretrainConfig().device) == (2000, 1000, "auto")


def test_config_mistakes_in_the_section_name_the_key():
    base = {"algorithm": "fed_grpo", "env": {"family": "molecules", "id": "qm9"}}
    with pytest.raises(ConfigError, match=r"pretrain\.stepz.*pretrain\.steps"):
        config_from_dict({**base, "pretrain": {"stepz": 3}})
    with pytest.raises(ConfigError, match=r"pretrain\.max_minutes.*>= 0"):
        config_from_dict({**base, "pretrain": {"max_minutes": -1}})
    with pytest.raises(ConfigError, match=r"pretrain\.device"):
        config_from_dict({**base, "pretrain": {"device": "tpu"}})
    with pytest.raises(ConfigError, match=r"config key 'pretrain': algorithm 'ppo' has no pretraining"):
        config_from_dict({"algorithm": "ppo", "pretrain": {"epochs": 3}})
    assert config_from_dict({"algorithm": "ppo"}).pretrain is None


def test_two_sft_budgets_stop_at_the_config_and_the_entry_point_refuses_an_algorithm_without_pretraining():
    with pytest.raises(ConfigError, match=r"'pretrain\.steps' and 'pretrain\.epochs'"):
        load_config(REPO / "configs/flow_grpo/forms_small.yaml", ["pretrain.steps=3", "pretrain.epochs=1"])
    with pytest.raises(ConfigError, match="has no pretraining"):
        pretraining.pretrain(config_from_dict({"algorithm": "ppo"}), progress=False)


def test_cli_flags_and_overrides_set_the_section_the_entry_point_runs(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(pretraining, "pretrain", lambda cfg, progress: seen.append(cfg.pretrain) or {"ok": 1})
    config = tmp_path / "edm.yaml"
    config.write_text(yaml.safe_dump({**read_yaml(REPO / "configs/fed_grpo/qm9_small.yaml"),
                                      "pretrain": {"steps": 10, "eval_samples": 8}}))
    assert main(["pretrain", str(config), "--steps", "20", "--resume", "pretrain.curve_every=5"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"ok": 1}
    p = seen[-1]
    # the file's section, a flag over it, an override, and the schema's defaults for the rest
    assert (p.steps, p.eval_samples, p.resume, p.curve_every, p.device) == (20, 8, True, 5, "auto")


def test_a_flag_the_method_does_not_take_is_refused_naming_what_it_takes(monkeypatch, capsys):
    monkeypatch.setattr(pretraining, "pretrain", lambda cfg, progress: pytest.fail("ran"))
    assert main(["pretrain", str(REPO / "configs/flow_grpo/forms_small.yaml"), "--curve-every", "5"]) == 2
    err = capsys.readouterr().err
    assert "--curve-every: flow_grpo's pretraining (text_sft) has no such setting; it takes --out, --steps" in err
    assert main(["pretrain", str(REPO / "configs/fpopp/lift_state_quickstart.yaml"), "--copy-aux", "1"]) == 2
    assert "--copy-aux: fpopp's pretraining (flow_bc)" in capsys.readouterr().err
    assert main(["pretrain", str(REPO / "configs/ppo/pendulum.yaml")]) == 2
    assert "algorithm 'ppo' has no pretraining" in capsys.readouterr().err


@pytest.mark.parametrize("path, function, section, expected", [
    ("fed_grpo/qm9_small.yaml", "EDMPretraining", {"steps": 7, "max_minutes": 2.5, "seed": 4},
     {"steps": 7, "max_minutes": 2.5, "seed": 4, "resume": False, "device": "auto", "eval_samples": 1000}),
    ("flow_grpo/forms_small.yaml", "pretrain_text", {"copy_aux": 0.5},       # no budget: 2,000 steps
     {"steps": 2000, "epochs": None, "copy_aux": 0.5, "tasks_per_form": 200, "seed": 0}),
    ("flow_grpo/forms_small.yaml", "pretrain_text", {"epochs": 3}, {"steps": None, "epochs": 3}),
    ("flowsar/lift_state_quickstart.yaml", "pretrain_flow_policy", {"epochs": 20, "eval_episodes": 5},
     {"epochs": 20, "eval_episodes": 5, "batch_size": 256, "lr": 1e-3, "seed": 0}),
])
def test_the_entry_point_runs_the_schemas_method_with_the_section(path, function, section, expected, monkeypatch):
    import importlib
    cfg = load_config(REPO / "configs" / path, [f"pretrain.{k}={v}" for k, v in section.items()])
    module = importlib.import_module(f"flowrl_ray.pretrain.{cfg.pretrain.method}")
    calls = []
    if function == "EDMPretraining":              # a class: built with the section, then run
        from types import SimpleNamespace
        monkeypatch.setattr(module, function, lambda c, p, seed, progress: SimpleNamespace(
            run=lambda: calls.append((c, {**vars(p), "seed": seed, "progress": progress})) or {"ran": function}))
    else:
        monkeypatch.setattr(module, function, lambda c, **kw: calls.append((c, kw)) or {"ran": function})
    assert pretraining.pretrain(cfg, progress=False) == {"ran": function}
    (c, kw), = calls
    assert c is cfg and kw["progress"] is False
    assert {k: kw[k] for k in expected} == expected


def test_every_key_of_every_pretraining_section_is_a_flag_with_its_type_and_help():
    """The flags are made from the sections' fields: a key added to a section is a flag at once,
    typed (ints, floats, a switch, choices) and with each section's help."""
    import dataclasses

    from flowrl_ray.cli import build_parser
    parser = build_parser()
    pretrain = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("pretrain"))
    options = {a.dest: a for a in pretrain._actions if a.option_strings}
    keys = {f.name for s in (FlowBCPretrainConfig, TextSFTPretrainConfig, EDMPretrainConfig)
            for f in dataclasses.fields(s)}
    assert keys == set(options) - {"help"}
    assert options["steps"].type is int and options["lr"].type is float and options["copy_aux"].type is float
    assert options["resume"].nargs == 0 and options["device"].choices == ["auto", "cpu", "cuda"]
    assert "language model: optimiser steps" in options["steps"].help and "EDM: optimiser steps in all" in \
        options["steps"].help and options["seed"].help == "None: the config's seed"
    args = parser.parse_args(["pretrain", "c.yaml", "--tasks-per-form", "7", "--resume", "--max-minutes", "1.5"])
    assert (args.tasks_per_form, args.resume, args.max_minutes, args.steps) == (7, True, 1.5, None)
