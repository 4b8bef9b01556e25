"""benchmarks/robot_stages.py: the summary of staged rewards by hand, and bad input refused
before any env is built."""

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
CAN = str(REPO / "configs/fpopp/can_state_quickstart.yaml")


def test_summary_means_quartiles_and_shares_by_hand():
    import robot_stages
    eps = [{"reach": 0.1, "grasp": 0.35, "lift": 0.5, "hover": 0.7, "success": True, "steps": 120},
           {"reach": 0.08, "grasp": 0.35, "lift": 0.4, "hover": 0.4, "success": False, "steps": 400},
           {"reach": 0.06, "grasp": 0.0, "lift": 0.0, "hover": 0.0, "success": False, "steps": 400},
           {"reach": 0.04, "grasp": 0.35, "lift": 0.36, "hover": 0.36, "success": False, "steps": 400}]
    s = robot_stages.summarise(eps)
    assert s["grasped"] == 0.75 and s["success"] == 0.25 and s["episodes"] == 4
    assert s["stage_max_mean"]["reach"] == pytest.approx(0.07)
    assert s["stage_max_mean"]["hover"] == pytest.approx((0.7 + 0.4 + 0.0 + 0.36) / 4)
    # numpy's linear quartiles of (0, 0.36, 0.4, 0.5): 0.27, 0.38, 0.425
    assert s["stage_max_quartiles"]["lift"] == pytest.approx([0.27, 0.38, 0.425])


def test_lift_and_bad_policies_are_refused_with_the_reason(tmp_path, capsys):
    import robot_stages
    with pytest.raises(SystemExit, match="can and square only"):
        robot_stages.main(["--config", str(REPO / "configs/fpopp/lift_state_quickstart.yaml"), "--policy", "a=x.pt"])
    with pytest.raises(SystemExit, match="expected NAME=PATH"):
        robot_stages.main(["--config", CAN, "--policy", "x.pt"])
    with pytest.raises(SystemExit, match="no such checkpoint"):
        robot_stages.main(["--config", CAN, "--policy", f"a={tmp_path}/x.pt"])
    with pytest.raises(SystemExit, match="not a run directory"):
        robot_stages.main(["--config", CAN, "--policy", f"a={tmp_path}"])


def test_a_per_policy_override_must_name_a_policy_and_a_valid_key(tmp_path):
    import robot_stages
    ckpt = tmp_path / "b.pt"
    ckpt.write_bytes(b"")                                   # only its presence is checked before the overrides
    args = ["--config", str(REPO / "configs/reinflow/can_state_quickstart.yaml"), "--policy", f"a={ckpt}"]
    with pytest.raises(SystemExit, match="expected NAME:KEY=VALUE"):
        robot_stages.main([*args, "--set", "b:algo.noise=sde"])            # no policy b
    with pytest.raises(SystemExit, match="algo.noise"):
        robot_stages.main([*args, "--set", "a:algo.noise=ode"])            # the config's own error


def test_an_episode_keeps_each_stages_maximum_and_the_rule_reaches_the_policy():
    import numpy as np
    import robot_stages

    class Raw:
        def __init__(self):
            self.k = 0

        def staged_rewards(self):
            return [(0.05, 0.0, 0.0, 0.0), (0.1, 0.35, 0.45, 0.6), (0.08, 0.0, 0.0, 0.0)][self.k - 1]

    class Env:
        raw, steps = Raw(), 0

        def reset(self, seed):
            self.raw.k, self.steps = 0, 0
            return np.zeros(3), {}

        def step(self, action):
            self.raw.k += 1
            self.steps += 8
            return np.zeros(3), 0.0, False, self.raw.k == 3, {"success": False}

    class Policy:
        calls = []

        def act(self, obs, deterministic, generator, record):
            self.calls.append((deterministic, record))
            import torch
            return torch.zeros(1, 4, 7), {}

    p = Policy()
    e = robot_stages.episode_stages(Env(), p, 0, "behaviour")
    assert (e["reach"], e["grasp"], e["lift"], e["hover"]) == (0.1, 0.35, 0.45, 0.6)   # maxima, not the last step
    assert e["steps"] == 24 and e["success"] is False
    assert set(p.calls) == {(False, True)}                     # behaviour: the recorded (noisy) chain
    p.calls.clear()
    robot_stages.episode_stages(Env(), p, 0, "zero")
    assert set(p.calls) == {(True, False)}
