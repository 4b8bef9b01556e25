"""Every config mistake stops with one message that names the key, before Ray starts."""

import dataclasses

import pytest

from flowrl_ray.config import (ConfigError, apply_overrides, config_from_dict, load_config, parse_override,
                               read_yaml, save_config)

from conftest import PENDULUM, REPO


def _error(*overrides):
    with pytest.raises(ConfigError) as e:
        load_config(PENDULUM, list(overrides))
    return str(e.value)


def test_every_config_file_loads():
    files = sorted((REPO / "configs").glob("*/*.yaml"))
    assert files
    for f in files:
        cfg = load_config(f)
        assert cfg.algorithm == f.parent.name
        for key in ("seed",):
            assert hasattr(cfg, key)
        assert cfg.train.iterations > 0 and cfg.runtime.num_workers > 0 and cfg.runtime.envs_per_worker > 0
        assert cfg.runtime.checkpoint_interval >= 0 and cfg.eval.interval >= 0 and cfg.eval.episodes > 0


def test_unknown_key_names_it_and_the_closest_valid_one():
    msg = _error("runtime.num_worker=3")
    assert "runtime.num_worker" in msg and "runtime.num_workers" in msg
    msg = _error("algo.learning_rate=0.1")
    assert "algo.learning_rate" in msg
    assert "trian" in _error("trian.iterations=3") and "'train'" in _error("trian.iterations=3")


@pytest.mark.parametrize("override, key", [
    ("algo.lr=-0.001", "algo.lr"),
    ("runtime.num_workers=0", "runtime.num_workers"),
    ("runtime.envs_per_worker=-1", "runtime.envs_per_worker"),
    ("train.iterations=0", "train.iterations"),
    ("algo.gamma=1.5", "algo.gamma"),
    ("eval.episodes=0", "eval.episodes"),
    ("runtime.checkpoint_interval=-2", "runtime.checkpoint_interval"),
    ("algo.clip=0", "algo.clip"),
    ("runtime.worker_niceness=20", "runtime.worker_niceness"),
])
def test_impossible_values(override, key):
    msg = _error(override)
    assert f"'{key}'" in msg and "must be" in msg


@pytest.mark.parametrize("override, key", [
    ("train.iterations=ten", "train.iterations"),
    ("train.iterations=2.5", "train.iterations"),
    ("algo.lr=fast", "algo.lr"),
    ("algo.normalize_advantages=maybe", "algo.normalize_advantages"),
    ("runtime.mode=turbo", "runtime.mode"),
    ("seed=[1,2]", "seed"),
    ("env.kwargs=3", "env.kwargs"),
])
def test_wrong_types(override, key):
    msg = _error(override)
    assert f"'{key}'" in msg


def test_unknown_algorithm_and_minibatch_cross_check():
    assert "'algorithm'" in _error("algorithm=ppoo") and "ppo" in _error("algorithm=ppoo")
    msg = _error("algo.minibatch_size=100000")
    assert "algo.minibatch_size" in msg


def test_section_given_a_scalar():
    assert "'runtime'" in _error("runtime=3")


def test_overrides_parse_like_yaml():
    assert parse_override("algo.lr=3e-4") == (["algo", "lr"], 3e-4)
    assert parse_override("algo.hidden_sizes=[32, 32]") == (["algo", "hidden_sizes"], [32, 32])
    assert parse_override("env.id=HalfCheetah-v5") == (["env", "id"], "HalfCheetah-v5")
    assert parse_override("algo.target_kl=null") == (["algo", "target_kl"], None)
    with pytest.raises(ConfigError):
        parse_override("no_equals_sign")
    with pytest.raises(ConfigError):
        apply_overrides({"seed": 1}, ["seed.sub=2"])


def test_yaml_scientific_notation_without_dot_is_a_float(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algorithm: ppo\nalgo:\n  lr: 3e-4\n")
    assert load_config(p).algo.lr == pytest.approx(3e-4)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_yaml(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        read_yaml(lst)


def test_resolved_config_round_trips(tmp_path):
    from flowrl_ray.config import save_config
    cfg = load_config(PENDULUM, ["algo.lr=0.002"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg and again.algo.lr == 0.002


def test_bad_env_id_is_a_config_error():
    from flowrl_ray.envs import env_family
    cfg = load_config(PENDULUM, ["env.id=NoSuchEnv-v0"])
    with pytest.raises(ConfigError, match="env.id"):
        env_family(cfg.env.family).spec(cfg.env)
    with pytest.raises(ConfigError, match="env.id"):
        env_family("gym").spec(load_config(PENDULUM, ["env.id=CartPole-v1"]).env)   # discrete actions
    with pytest.raises(ConfigError, match="env.family"):
        env_family("nope")


@pytest.mark.parametrize("config", ["ppo/pendulum.yaml", "cma_ppo/pendulum.yaml"])
@pytest.mark.parametrize("sizes", ["[]", "[64, 0]", "[64, -3]", "[true]"])
def test_hidden_sizes_must_be_positive_ints(config, sizes):
    with pytest.raises(ConfigError, match="algo.hidden_sizes"):
        load_config(REPO / "configs" / config, [f"algo.hidden_sizes={sizes}"])


def test_one_name_per_concept_with_the_earlier_and_paper_names_as_aliases(tmp_path):
    """Flow-GRPO's and FED-GRPO's paper names, FPO++'s actor_lr and CMA-PPO's lam / n_updates /
    batch_size map to the one name; a config written with them (an old run directory) still loads
    and is saved with the one name; both names at once is an error naming both keys."""
    forms = REPO / "configs" / "flow_grpo" / "forms_small.yaml"
    cfg = load_config(forms, ["algo.learning_rate=3e-5", "algo.clip_range=0.1", "algo.grad_clip=0.5"])
    assert (cfg.algo.lr, cfg.algo.clip, cfg.algo.max_grad_norm) == (3e-5, 0.1, 0.5)
    fed = load_config(REPO / "configs" / "fed_grpo" / "qm9_small.yaml",
                      ["algo.kl_penalty_weight=0.1", "algo.gradient_accumulation_steps=2"])
    assert fed.algo.kl_coeff == 0.1 and not hasattr(fed.algo, "kl_penalty_weight")
    assert fed.algo.grad_accumulation == 2      # ELIGN's DeepSpeed name for FPO++'s accumulation
    fpopp = load_config(REPO / "configs" / "fpopp" / "lift_state_quickstart.yaml",
                        ["algo.actor_lr=2e-5", "algo.actor_lr_warmup_iters=3"])
    assert (fpopp.algo.lr, fpopp.algo.lr_warmup_iters) == (2e-5, 3)
    cma = load_config(REPO / "configs" / "cma_ppo" / "pendulum.yaml",
                      ["algo.lam=0.9", "algo.n_updates=3", "algo.batch_size=64"])
    assert (cma.algo.gae_lambda, cma.algo.epochs, cma.algo.minibatch_size) == (0.9, 3, 64)
    save_config(cma, tmp_path / "config.yaml")
    saved = (tmp_path / "config.yaml").read_text()
    assert "gae_lambda: 0.9" in saved and "lam:" not in saved and "n_updates" not in saved
    # an override by either name replaces the file's setting; the last one given wins
    assert load_config(forms, ["algo.learning_rate=3e-5", "algo.lr=1e-5"]).algo.lr == 1e-5
    assert load_config(forms, ["algo.lr=1e-5", "algo.learning_rate=3e-5"]).algo.lr == 3e-5
    data = read_yaml(forms)
    data["algo"]["learning_rate"] = 3e-5                      # the file names it twice
    with pytest.raises(ConfigError, match=r"'algo\.learning_rate' and 'algo\.lr'"):
        config_from_dict(data)


# --------------------------------------------------------------------------- defaults: composition

def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_compose_in_order_sections_merge_and_the_file_wins(tmp_path):
    """Blocks merge in the order listed (a block may compose another), sections key by key, a
    list replaces; the file's own keys override; the result has no `defaults` and saves resolved."""
    _write(tmp_path / "shared" / "env.yaml", "env: {family: gym, id: Pendulum-v1, max_episode_steps: 50}\n")
    _write(tmp_path / "shared" / "eval.yaml", "defaults: [env.yaml]\neval: {interval: 3, episodes: 7}\n"
                                               "env: {max_episode_steps: 60}\n")
    _write(tmp_path / "shared" / "runtime.yaml", "runtime: {num_workers: 3, envs_per_worker: 2}\n")
    cfg_file = _write(tmp_path / "ppo" / "run.yaml",
                      "name: composed\nalgorithm: ppo\n"
                      "defaults: [../shared/eval.yaml, ../shared/runtime.yaml]\n"
                      "runtime: {num_workers: 1}\neval: {episodes: 9}\nalgo: {hidden_sizes: [8]}\n")
    data = read_yaml(cfg_file)
    assert data == {"env": {"family": "gym", "id": "Pendulum-v1", "max_episode_steps": 60},   # eval.yaml's 60 over 50
                    "eval": {"interval": 3, "episodes": 9},                                  # the file's 9 over 7
                    "runtime": {"num_workers": 1, "envs_per_worker": 2},
                    "name": "composed", "algorithm": "ppo", "algo": {"hidden_sizes": [8]}}
    cfg = load_config(cfg_file, ["eval.interval=4"])                    # overrides come last
    assert (cfg.eval.interval, cfg.eval.episodes, cfg.runtime.num_workers, cfg.env.max_episode_steps) == (4, 9, 1, 60)
    save_config(cfg, tmp_path / "saved.yaml")
    saved = read_yaml(tmp_path / "saved.yaml")
    assert "defaults" not in saved and config_from_dict(saved).to_dict() == cfg.to_dict()
    # a list replaces a list (no concatenation); one path may be given as a string
    _write(tmp_path / "shared" / "sizes.yaml", "algo: {hidden_sizes: [4, 4, 4]}\n")
    one = _write(tmp_path / "ppo" / "one.yaml", "defaults: ../shared/sizes.yaml\nalgo: {hidden_sizes: [16]}\n")
    assert read_yaml(one)["algo"]["hidden_sizes"] == [16]


def test_an_algo_key_in_a_block_is_replaced_by_either_of_its_names(tmp_path):
    _write(tmp_path / "b.yaml", "algorithm: fpopp\nalgo: {actor_lr: 0.001, epochs: 3}\n")
    f = _write(tmp_path / "f.yaml", "defaults: [b.yaml]\nalgo: {lr: 0.0002}\n")
    assert read_yaml(f)["algo"] == {"epochs": 3, "lr": 0.0002}          # not both names (an error)
    g = _write(tmp_path / "g.yaml", "defaults: [f.yaml]\nalgo: {actor_lr: 0.0003}\n")
    assert read_yaml(g)["algo"] == {"epochs": 3, "lr": 0.0003}            # merged by the one name
    assert apply_overrides(read_yaml(g), ["algo.actor_lr=0.0004"])["algo"] == {"epochs": 3, "lr": 0.0004}


def test_defaults_mistakes_name_the_key_and_the_file(tmp_path):
    missing = _write(tmp_path / "m.yaml", "defaults: [nope.yaml]\n")
    with pytest.raises(ConfigError, match=r"config key 'defaults' in .*m\.yaml: no such file 'nope\.yaml'"):
        read_yaml(missing)
    a = _write(tmp_path / "a.yaml", "defaults: [b.yaml]\n")
    _write(tmp_path / "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match=r"'a\.yaml' includes itself \(.*a\.yaml -> .*b\.yaml -> .*a\.yaml\)"):
        read_yaml(a)
    for bad in ("defaults: {env: x}\n", "defaults: [3]\n", "defaults: ['']\n"):
        with pytest.raises(ConfigError, match=r"config key 'defaults' in .*: expected a list of config files"):
            read_yaml(_write(tmp_path / "bad.yaml", bad))


def test_every_shared_block_is_used_and_holds_only_config_sections():
    import dataclasses

    import yaml

    from flowrl_ray.config import Config
    sections = {f.name for f in dataclasses.fields(Config)}
    blocks = sorted((REPO / "configs" / "shared").rglob("*.yaml"))
    assert blocks
    used = set()
    for f in [*(REPO / "configs").glob("*/*.yaml"), *blocks]:
        listed = yaml.safe_load(f.read_text()).get("defaults") or []
        used |= {(f.parent / d).resolve() for d in ([listed] if isinstance(listed, str) else listed)}
    assert {b.resolve() for b in blocks} <= used, "a shared block no config lists"
    for b in blocks:
        assert set(read_yaml(b)) <= sections, b


def test_flowsars_earlier_nested_section_is_the_same_setting(tmp_path):
    """algo.flowsar.X (the earlier nested name) is algo.X: in a file, in an override, in a block;
    given both ways it is an error naming both keys."""
    base = {"algorithm": "flowsar", "env": {"family": "robot", "id": "lift"},
            "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 8},
            "algo": {"minibatch_size": 8}}
    nested = {**base, "algo": {**base["algo"], "flowsar": {"lr": 3e-5, "temperature": 1.0}}}
    flat = {**base, "algo": {**base["algo"], "lr": 3e-5, "temperature": 1.0}}
    assert config_from_dict(nested).to_dict() == config_from_dict(flat).to_dict()
    assert "flowsar" not in config_from_dict(nested).to_dict()["algo"]          # saved flat
    cfg = config_from_dict(apply_overrides(nested, ["algo.lr=1e-4", "algo.flowsar.temperature=2.0"]))
    assert (cfg.algo.lr, cfg.algo.temperature) == (1e-4, 2.0)
    cfg = config_from_dict(apply_overrides(flat, ["algo.flowsar.lr=2e-4"]))
    assert cfg.algo.lr == 2e-4
    with pytest.raises(ConfigError, match=r"'algo\.flowsar\.lr' and 'algo\.lr': one setting given twice"):
        config_from_dict({**base, "algo": {"lr": 1e-5, "flowsar": {"lr": 1e-4}}})
    (tmp_path / "block.yaml").write_text("algo: {flowsar: {lr: 0.001, beta: 2.0}}\n")
    f = tmp_path / "f.yaml"
    f.write_text("algorithm: flowsar\ndefaults: [block.yaml]\nalgo: {lr: 0.0005}\n")
    assert read_yaml(f)["algo"] == {"lr": 0.0005, "beta": 2.0}


def test_the_config_and_the_registry_import_nothing_above_them():
    """The layers: the config package and registry.py import no algorithm, model, env, runtime or CLI module
    (not even inside a function); the registry imports an algorithm by name when a config names it."""
    import ast
    import subprocess
    import sys
    above = ("flowrl_ray.algorithms", "flowrl_ray.models", "flowrl_ray.envs", "flowrl_ray.runtime",
             "flowrl_ray.pretrain", "flowrl_ray.cli")
    for path in [*(REPO / "flowrl_ray" / "config").glob("*.py"), REPO / "flowrl_ray" / "registry.py"]:
        name = path.name
        tree = ast.parse(path.read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module] + \
            [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m.startswith(above)], (name, imported)
    code = ("import sys, flowrl_ray.registry as r; r.get_algorithm('ppo'); "
            "assert 'flowrl_ray.algorithms.ppo' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_a_learner_group_needs_an_algorithm_that_splits_minibatches_and_a_row_per_rank():
    from conftest import tiny_config
    assert tiny_config("runtime.num_learners=2").runtime.num_learners == 2          # PPO splits them
    # a plugin algorithm that does not say its update splits minibatches
    with pytest.raises(ConfigError, match=r"config key 'runtime.num_learners': 'flowrl_test_plugins.token_bandit:"
                                          r"TokenGRPO' updates on one learner"):
        config_from_dict({"algorithm": "flowrl_test_plugins.token_bandit:TokenGRPO",
                          "env": {"family": "flowrl_test_plugins.token_bandit", "id": "tokens"},
                          "runtime": {"num_learners": 2}})
    with pytest.raises(ConfigError, match=r"'runtime.num_learners': 3 ranks share algo.prompts_per_iteration=2"):
        load_config(REPO / "configs/flow_grpo/forms_small.yaml", ["runtime.num_learners=3", "algo.prompts_per_iteration=2"])
    # 256 rows per iteration in minibatches of 100: the last one has 56 rows
    with pytest.raises(ConfigError, match=r"'runtime.num_learners': 57 learners .* the smallest has 56 rows"):
        tiny_config("algo.minibatch_size=100", "runtime.num_learners=57")
    with pytest.raises(ConfigError, match=r"'runtime.num_learners': 9 ranks share algo.sample_group_size=8 groups"):
        load_config(REPO / "configs/fed_grpo/qm9_small.yaml", ["runtime.num_learners=9", "algo.sample_group_size=8"])
    with pytest.raises(ConfigError, match=r"'runtime.learner_num_gpus': 0.5 GPU per rank"):
        tiny_config("runtime.num_learners=2", "runtime.learner_num_gpus=0.5")
    with pytest.raises(ConfigError, match=r"runtime.learner_placement"):
        tiny_config("runtime.learner_placement=everywhere")


def test_an_env_family_declares_its_section_and_other_families_do_not_take_its_keys():
    from flowrl_ray.config import EnvConfig
    from flowrl_ray.envs.robot.config import RobotEnvConfig
    robot = config_from_dict({"algorithm": "fpopp", "env": {"family": "robot", "id": "lift", "horizon_steps": 4,
                                                            "act_steps": 2, "obs_mode": "image", "image_size": 48}})
    assert type(robot.env) is RobotEnvConfig
    assert (robot.env.obs_mode, robot.env.image_size, robot.env.horizon_steps) == ("image", 48, 4)
    gym = load_config(PENDULUM)
    assert type(gym.env) is EnvConfig and not hasattr(gym.env, "cameras")
    assert "cameras" not in gym.to_dict()["env"] and "cameras" in robot.to_dict()["env"]
    # a robot key on another family: the key and the family named, before anything runs
    for override, key in (("env.cameras=[robot0_eye_in_hand]", "env.cameras"), ("env.reward=shaped", "env.reward"),
                          ("env.perturb.placement_scale=2", "env.perturb"),
                          ("env.cameras=[agentview]", "env.cameras")):      # even at the robot's default
        assert f"'{key}': a robot-family setting; env family 'gym'" in _error(override)
    # a typo in the robot section: the closest robot key
    with pytest.raises(ConfigError, match=r"env\.image_sizes.*did you mean 'env\.image_size'"):
        config_from_dict({"env": {"family": "robot", "id": "lift", "image_sizes": 48}, "algorithm": "fpopp"})
    with pytest.raises(ConfigError, match=r"env\.obs_mode.*'low_dim', 'image'"):
        config_from_dict({"env": {"family": "robot", "id": "lift", "obs_mode": "rgb"}, "algorithm": "fpopp"})


def test_a_saved_config_of_another_family_with_the_robot_keys_at_their_defaults_loads(tmp_path):
    """Run directories saved before the robot family declared its section hold every robot key at
    its default; they load (the keys dropped) and save again without them."""
    from flowrl_ray.config import ROBOT_KEYS_BEFORE_SECTIONS
    from flowrl_ray.envs.robot.config import RobotEnvConfig
    fresh = RobotEnvConfig()
    assert {k: getattr(fresh, k) if k != "perturb" else dataclasses.asdict(fresh.perturb)
            for k in ROBOT_KEYS_BEFORE_SECTIONS} == ROBOT_KEYS_BEFORE_SECTIONS       # today's defaults
    data = load_config(PENDULUM).to_dict()
    old = {**data, "env": {**data["env"], **ROBOT_KEYS_BEFORE_SECTIONS}}
    assert config_from_dict(old) == load_config(PENDULUM)
    for algorithm, family, env_id in (("flow_grpo", "forms", "forms-benchmark"), ("fed_grpo", "molecules", "qm9")):
        assert set(ROBOT_KEYS_BEFORE_SECTIONS).isdisjoint(vars(config_from_dict(
            {"algorithm": algorithm, "env": {"family": family, "id": env_id, **ROBOT_KEYS_BEFORE_SECTIONS}}).env))
    changed = {**old, "env": {**old["env"], "image_size": 96}}
    with pytest.raises(ConfigError, match=r"'env\.image_size': a robot-family setting; env family 'gym'"):
        config_from_dict(changed)


def test_a_plugin_env_family_declares_its_own_section(tmp_path, monkeypatch):
    pkg = tmp_path / "my_families"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "grid.py").write_text(
        "from dataclasses import dataclass\n"
        "from flowrl_ray.config import EnvConfig\n"
        "from flowrl_ray.envs.gym import spec, make_vector_env, snapshot, read_snapshot, restore\n"
        "@dataclass\nclass GridEnvConfig(EnvConfig):\n    size: int = 5\n"
        "config_class = GridEnvConfig\n")
    (pkg / "broken.py").write_text("from flowrl_ray.envs.gym import spec, make_vector_env, snapshot, read_snapshot, restore\n"
                                   "config_class = dict\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config_from_dict({"env": {"family": "my_families.grid", "id": "Grid-v0", "size": 9}})
    assert type(cfg.env).__name__ == "GridEnvConfig" and cfg.env.size == 9
    with pytest.raises(ConfigError, match=r"'env\.size': expected int"):
        config_from_dict({"env": {"family": "my_families.grid", "id": "Grid-v0", "size": "big"}})
    with pytest.raises(ConfigError, match=r"'env\.family'.*does not extend"):
        config_from_dict({"env": {"family": "my_families.broken", "id": "A-v0"}})
    with pytest.raises(ConfigError, match=r"'env\.family'.*unknown env family 'nope'"):
        config_from_dict({"env": {"family": "nope"}})


def test_an_env_family_is_checked_against_its_contract_and_the_algorithms_kind(tmp_path, monkeypatch):
    """A module that is neither kind of family is refused when it is named, naming what it lacks;
    a family of the other kind than the algorithm's rollouts is refused naming the key."""
    (tmp_path / "half_families").mkdir()
    (tmp_path / "half_families" / "__init__.py").write_text("")
    (tmp_path / "half_families" / "spec_only.py").write_text("def spec(env_cfg):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"'env.family': 'half_families.spec_only' is not an env family: as an env-step "
                                          r"family it lacks make_vector_env, snapshot, read_snapshot, restore; "
                                          r"as a scoring family it lacks make_scorer"):
        config_from_dict({"algorithm": "ppo", "env": {"family": "half_families.spec_only", "id": "x"}})
    with pytest.raises(ConfigError, match=r"'env.family': algorithm 'ppo' needs an env-step family .*'forms' lacks "
                                          r"make_vector_env, snapshot, read_snapshot, restore"):
        config_from_dict({"algorithm": "ppo", "env": {"family": "forms", "id": "forms-benchmark"}})
    with pytest.raises(ConfigError, match=r"'env.family': algorithm 'flowrl_test_plugins.token_bandit:TokenGRPO' "
                                          r"needs a scoring family .*'gym' lacks make_scorer"):
        config_from_dict({"algorithm": "flowrl_test_plugins.token_bandit:TokenGRPO",
                          "env": {"family": "gym", "id": "Pendulum-v1"}})
