"""Ray Serve deployment: a tiny policy trained with the Trainer and served over real HTTP on a
local Ray."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

from conftest import REPO, free_port
from unit.runtime.test_serve import BAD_BODIES

PENDULUM = REPO / "configs" / "ppo" / "pendulum.yaml"
TINY = ["train.iterations=2", "runtime.num_workers=1", "runtime.envs_per_worker=2",
        "runtime.rollout_length=64", "algo.minibatch_size=64", "algo.epochs=2", "eval.interval=0"]

# --------------------------------------------------------------------------- served over HTTP

@pytest.fixture(scope="module")
def served(tmp_path_factory, local_ray):
    """Train a tiny run with the Trainer, then deploy it; yields (url, run_dir, port)."""
    from flowrl_ray.config import load_config
    from flowrl_ray.runtime.trainer import Trainer
    from flowrl_ray.runtime.serve import deploy, shutdown

    run_dir = tmp_path_factory.mktemp("serve") / "run"
    trainer = Trainer(load_config(PENDULUM, TINY), run_dir, tensorboard=False, quiet=True)
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.close()
    port = free_port()
    url = deploy(run_dir, host="127.0.0.1", port=port)
    try:
        yield url, run_dir, port
    finally:
        shutdown()              # Serve off; local_ray stops Ray at the end of the module


@pytest.mark.slow
def test_healthz(served):
    import requests
    url, run_dir, _ = served
    r = requests.get(url + "/healthz", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["obs_shape"] == [3] and body["action_dim"] == 1
    assert body["action_low"] == [-2.0] and body["action_high"] == [2.0]
    assert body["checkpoint"] == "iter_000002.pt" and body["iteration"] == 2


def _other_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))          # no packet is sent; picks the outgoing interface
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


@pytest.mark.slow
def test_binds_to_localhost_only(served):
    _, _, port = served
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass
    ip = _other_address()
    if ip is None:
        pytest.skip("no non-loopback address to try")
    with pytest.raises(OSError):                   # refused: Serve listens on 127.0.0.1 only
        socket.create_connection((ip, port), timeout=10).close()


@pytest.mark.slow
def test_act_single_and_batch(served):
    import requests
    url, _, _ = served
    r = requests.post(url + "/act", json={"observation": [1.0, 0.0, 0.5]}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["action"]) == 1 and len(body["normalized_action"]) == 1
    assert -2.0 <= body["action"][0] <= 2.0
    assert -1.0 <= body["normalized_action"][0] <= 1.0
    assert body["action"][0] == pytest.approx(2.0 * body["normalized_action"][0])   # [-1,1] -> [-2,2]
    assert body["policy_version"] == 2 and body["checkpoint"] == "iter_000002.pt"

    # deterministic by default: the same observation gives the same action
    again = requests.post(url + "/act", json={"observation": [1.0, 0.0, 0.5]}, timeout=30).json()
    assert again["action"] == body["action"]

    # a batch, including extreme (finite) observations: actions stay within the bounds
    batch = [[1.0, 0.0, 0.5], [0.0, 1.0, -8.0], [1e6, -1e6, 3e30]]
    r = requests.post(url + "/act", json={"observation": batch, "deterministic": False}, timeout=30)
    assert r.status_code == 200, r.text
    actions = np.array(r.json()["action"])
    assert actions.shape == (3, 1)
    assert np.all(actions >= -2.0) and np.all(actions <= 2.0)


@pytest.mark.slow
@pytest.mark.parametrize("name,body", BAD_BODIES, ids=[n for n, _ in BAD_BODIES])
def test_act_bad_payloads_are_4xx(served, name, body):
    import requests
    url, _, _ = served
    r = requests.post(url + "/act", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:200])
    assert isinstance(r.json().get("error"), str) and r.json()["error"]


@pytest.mark.slow
def test_wrong_method_and_path_are_not_500(served):
    import requests
    url, _, _ = served
    assert requests.get(url + "/act", timeout=30).status_code == 405
    assert requests.get(url + "/nope", timeout=30).status_code == 404
    # the server is still fine after all the bad requests
    assert requests.post(url + "/act", data=json.dumps({"observation": [0, 0, 0]}), timeout=30).status_code == 200
