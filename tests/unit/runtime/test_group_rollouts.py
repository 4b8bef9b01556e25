"""Group rollouts without Ray: the config refuses the async mode. The runs on a real local Ray:
tests/integration/test_group_rollouts.py."""

import pytest

from flowrl_ray.config import ConfigError, config_from_dict


def _config(**runtime):
    return config_from_dict({
        "name": "token-grpo", "algorithm": "flowrl_test_plugins.token_bandit:TokenGRPO",
        "env": {"family": "flowrl_test_plugins.token_bandit", "id": "tokens"},
        "train": {"iterations": 12}, "eval": {"interval": 12, "episodes": 1},
        "runtime": {"num_workers": 2, "checkpoint_interval": 0, **runtime}})


def test_group_rollouts_refuse_async_mode():
    with pytest.raises(ConfigError, match="runtime.mode"):
        _config(mode="async")
