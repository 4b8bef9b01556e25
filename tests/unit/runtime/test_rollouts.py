"""The two algorithm kinds and their rollout strategies, without Ray: every built-in algorithm is
exactly one kind, the Trainer's strategy follows the kind, a group algorithm holds no rollout
policy, and a class of neither kind is a config error naming the key."""

import inspect

import pytest
import torch

from flowrl_ray.algorithms import BUILTIN_ALGORITHMS, get_algorithm
from flowrl_ray.algorithms.base import EnvStepAlgorithm, GroupAlgorithm
from flowrl_ray.runtime.policy import load_policy
from flowrl_ray.config import ConfigError, config_from_dict, save_config
from flowrl_ray.runtime.actors import RolloutWorker, ScoringWorker
from flowrl_ray.runtime.rollouts import EnvStepRollouts, GroupRollouts, Rollouts, rollout_strategy
from flowrl_ray.runtime.trainer import Trainer

KINDS = {"ppo": EnvStepAlgorithm, "cma_ppo": EnvStepAlgorithm, "fpopp": EnvStepAlgorithm,
         "reinflow": EnvStepAlgorithm, "flowsar": EnvStepAlgorithm,
         "flow_grpo": GroupAlgorithm, "fed_grpo": GroupAlgorithm}


@pytest.mark.parametrize("name", sorted(BUILTIN_ALGORITHMS))
def test_each_builtin_algorithm_is_one_kind_with_its_strategy(name):
    cls = get_algorithm(name)
    kind = KINDS[name]
    other = GroupAlgorithm if kind is EnvStepAlgorithm else EnvStepAlgorithm
    assert issubclass(cls, kind) and not issubclass(cls, other)
    assert not inspect.isabstract(cls), f"{name} leaves a method of its kind undeclared"
    strategy = rollout_strategy(cls)
    assert strategy is (EnvStepRollouts if kind is EnvStepAlgorithm else GroupRollouts)
    assert strategy.worker_class is (RolloutWorker if kind is EnvStepAlgorithm else ScoringWorker)
    if kind is GroupAlgorithm:            # no fake rollout policy: scorers hold no model
        for attr in ("make_policy", "policy", "policy_state_dict"):
            assert not hasattr(cls, attr), f"{name}.{attr}"


def test_the_strategy_contract_is_abstract():
    with pytest.raises(TypeError):
        Rollouts(None, None, None, None, None)


class NotAnAlgorithm:
    config_class = dict


class MissingGenerate(GroupAlgorithm):
    config_class = dict


def test_a_plugin_of_neither_kind_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"config key 'algorithm'.*EnvStepAlgorithm.*GroupAlgorithm"):
        get_algorithm(f"{__name__}:NotAnAlgorithm")
    # a kind whose methods are not all written cannot be built
    with pytest.raises(TypeError, match="generate"):
        MissingGenerate(None, None, torch.device("cpu"))


def test_a_group_run_has_no_env_step_policy_to_load(tmp_path):
    cfg = config_from_dict({
        "name": "token-grpo", "algorithm": "flowrl_test_plugins.token_bandit:TokenGRPO",
        "env": {"family": "flowrl_test_plugins.token_bandit", "id": "tokens"}})
    save_config(cfg, tmp_path / "config.yaml")
    (tmp_path / "checkpoints").mkdir()
    torch.save({"trainer": {}}, tmp_path / "checkpoints" / "iter_000001.pt")
    (tmp_path / "checkpoints" / "latest").write_text("iter_000001.pt")
    with pytest.raises(ConfigError, match="group algorithm.*flowrl-ray eval"):
        load_policy(tmp_path)


def test_videos_are_refused_for_a_group_run_before_ray(tmp_path):
    cfg = config_from_dict({
        "name": "token-grpo", "algorithm": "flowrl_test_plugins.token_bandit:TokenGRPO",
        "env": {"family": "flowrl_test_plugins.token_bandit", "id": "tokens"},
        "eval": {"video": {"episodes": 1}}})
    with pytest.raises(ConfigError, match="eval.video"):
        Trainer(cfg, tmp_path / "run", quiet=True)
