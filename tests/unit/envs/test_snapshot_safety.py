"""A rollout worker's saved state (RNGs, episode statistics, the env family's snapshot) loads as
plain data: a planted pickle payload in the worker state or in the env snapshot is refused naming
what it calls, and never runs; the gym snapshot holds no class at all and still resumes exactly
(across episode ends); the robot snapshot admits its own config dataclasses only; older states
(the generator as a tensor, the vector env pickled whole) load as stated."""

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl_ray.envs import load_snapshot, snapshot_classes
from flowrl_ray.envs.gym import EnvConfig
from flowrl_ray.envs.robot.robomimic_data import NormStats
from flowrl_ray.envs.robot.config import PerturbConfig, RobotEnvConfig
from flowrl_ray.utils import TRUST_FILES_ENV, restricted_loads

from unit.envs.test_rollout import _runner


class Planted:
    """Unpickling this touches a file: the stand-in for code a malicious state would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_the_gym_snapshot_is_plain_data_and_resumes_exactly_across_episode_ends():
    r1, _ = _runner("env.max_episode_steps=25", seed=3)
    r1.sample(30)                                           # one truncation behind, mid-episode now
    blob = r1.get_state()
    outer = restricted_loads(blob, "test")                  # no class admitted: loads all the same
    assert isinstance(outer["generator"], np.ndarray) and isinstance(outer["envs"], bytes)
    saved = load_snapshot(outer["envs"], EnvConfig)
    assert saved["env_cfg"]["id"] == "Pendulum-v1" and len(saved["envs"]) == 3
    r2, _ = _runner("env.max_episode_steps=25", seed=99)   # every RNG and counter from the state
    r2.set_weights(r1.policy.state_dict(), 0)
    assert r2.set_state(blob)
    b1, b2 = r1.sample(60), r2.sample(60)                  # two more episode ends in each env
    assert b1["truncated"].sum() == 3 * 2
    for k in b1.data:
        assert np.array_equal(b1[k], b2[k]), k


def test_a_payload_in_the_worker_state_or_the_env_snapshot_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    r1, _ = _runner(seed=3)
    state = restricted_loads(r1.get_state(), "test")
    planted_outer = pickle.dumps({**state, "episode_return": Planted(marker)})
    planted_env = pickle.dumps({**state, "envs": pickle.dumps({"env_cfg": Planted(marker)})})
    for blob, what in [(planted_outer, "the rollout worker's state"), (planted_env, "the env snapshot")]:
        with pytest.raises(pickle.UnpicklingError, match=rf"{what} was refused: it names pathlib.Path.touch"):
            _runner(seed=5)[0].set_state(blob)
    assert not marker.exists()


def test_the_robot_snapshot_admits_its_config_dataclasses_and_nothing_else(tmp_path):
    norm = NormStats(("a",), np.zeros(1), np.ones(1), -np.ones(2), np.ones(2))
    cfg = RobotEnvConfig(perturb=PerturbConfig())
    env_state = {"sim": np.arange(4.0), "rng": np.random.default_rng(0).bit_generator.state, "steps": 3}
    allowed = snapshot_classes(PerturbConfig, NormStats)
    saved = load_snapshot(pickle.dumps({"env_cfg": cfg, "norm": norm, "envs": [env_state]}), RobotEnvConfig, allowed)
    assert saved["env_cfg"] == cfg and saved["norm"].obs_keys == ("a",)
    assert saved["envs"][0]["rng"] == env_state["rng"] and saved["envs"][0]["sim"].tolist() == [0, 1, 2, 3]
    marker = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match="pathlib.Path.touch"):
        load_snapshot(pickle.dumps({"env_cfg": cfg, "norm": Planted(marker), "envs": []}), RobotEnvConfig, allowed)
    # a class of this package that is not one of the snapshot's: refused as well
    with pytest.raises(pickle.UnpicklingError, match="flowrl_ray.envs.gym.NormalizedActions"):
        from flowrl_ray.envs.gym import NormalizedActions
        load_snapshot(pickle.dumps(NormalizedActions.__new__(NormalizedActions)), RobotEnvConfig, allowed)
    assert not marker.exists()


def test_older_states_load_a_tensor_generator_and_whole_vector_envs_under_the_opt_in(monkeypatch):
    # the generator state was a uint8 tensor: rebuilt through the weights-only loader
    gen = torch.Generator().manual_seed(4)
    old = pickle.dumps({"generator": gen.get_state()})
    assert torch.equal(restricted_loads(old, "test")["generator"], gen.get_state())
    # the gym snapshot pickled the vector env whole: its classes are refused, the opt-in loads it
    r1, _ = _runner(seed=3)
    legacy = pickle.dumps({"envs": r1.envs, "mujoco": [None] * 3})
    with pytest.raises(pickle.UnpicklingError, match=rf"gymnasium\.\S+ which loading would run.*{TRUST_FILES_ENV}=1"):
        load_snapshot(legacy, EnvConfig)
    monkeypatch.setenv(TRUST_FILES_ENV, "1")
    assert load_snapshot(legacy, EnvConfig)["envs"].num_envs == 3
