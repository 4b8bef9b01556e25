"""PPO over several updates (seconds on a busy 2-core machine, more than the unit folder's 2 s):
exact resume from the state dict and the linear lr schedule. The math:
tests/unit/algorithms/test_ppo_math.py."""

import io

import pytest
import torch

from flowrl_ray.algorithms.ppo import PPO
from flowrl_ray.envs import EnvSpec

from conftest import tiny_config
from unit.algorithms.test_ppo_math import _synthetic_batch


def test_state_dict_round_trip_resumes_bit_for_bit():
    cfg = tiny_config("algo.epochs=2", "algo.minibatch_size=16")
    spec = EnvSpec((3,), 1)
    a = PPO(cfg, spec, torch.device("cpu"))
    a.update(a.prepare([_synthetic_batch(a, seed=1)]))
    b = PPO(cfg, spec, torch.device("cpu"))
    buf = io.BytesIO()                      # through serialisation, as a checkpoint does
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=False))
    batch = _synthetic_batch(a, seed=2)
    ma, mb = a.update(a.prepare([batch])), b.update(b.prepare([batch]))
    assert ma == mb
    for (k, x), (_, y) in zip(a.policy.state_dict().items(), b.policy.state_dict().items()):
        assert torch.equal(x, y), k

def test_linear_lr_schedule_anneals_to_zero():
    cfg = tiny_config("train.iterations=4", "algo.lr=0.01", "algo.epochs=1", "algo.minibatch_size=64")
    algo = PPO(cfg, EnvSpec((3,), 1), torch.device("cpu"))
    lrs = [algo.update(algo.prepare([_synthetic_batch(algo, seed=i)]))["ppo/lr"] for i in range(4)]
    assert lrs == pytest.approx([0.01, 0.0075, 0.005, 0.0025])
