"""Shared fixtures: tiny configs and one local Ray per test module that needs it.

The tests are in three packages: unit/ (mirroring flowrl_ray), integration/ and e2e/ (see their
__init__.py). pytest puts this folder on sys.path, so any test module imports `conftest`, the
plugins in flowrl_test_plugins/ and another test module by its package path
(`from unit.algorithms.test_fpopp import tiny_cfg`)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

#: tests/ (on sys.path: conftest, the test plugins) and the repository root
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
PENDULUM = REPO / "configs" / "ppo" / "pendulum.yaml"

#: a run small enough for a few seconds on 2 cores (any algorithm) ...
TINY_RUNTIME = ["train.iterations=3", "runtime.num_workers=2", "runtime.envs_per_worker=2",
                "runtime.rollout_length=64", "eval.interval=0", "runtime.checkpoint_interval=0"]
#: ... and a PPO one
TINY = TINY_RUNTIME + ["algo.minibatch_size=64", "algo.epochs=2"]


def tiny_config(*overrides: str):
    from flowrl_ray.config import load_config
    return load_config(PENDULUM, TINY + list(overrides))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny networks (more only add contention: up to 10x
    slower on a busy machine); the previous number is restored after the module.
    Use: ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def local_ray():
    import ray
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


#: pytest's exit status, kept for the exit below
_SESSION = {}


def pytest_sessionfinish(session, exitstatus):
    _SESSION["exitstatus"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process once pytest is done: Python's exit handlers (``ray.shutdown`` among
    them) run, then ``os._exit`` with pytest's status, skipping the interpreter's native teardown.

    The whole suite's process loads torch, MuJoCo, Ray, Playwright, transformers and bitsandbytes
    at once; now and then, after every test had passed, a native thread jumped into freed memory
    while the interpreter tore down, after the fault handler had stopped: the process died with
    SIGSEGV and no stack, and ``make test`` failed with nothing failing.
    Under pytest-xdist (`make test`) each worker process ends the same way, after its results have
    gone to the controller (xdist sends them at the end of ``pytest_sessionfinish``).
    ``FLOWRL_TEST_NATIVE_TEARDOWN=1`` keeps the full teardown (to chase it); tested by
    tests/unit/test_conftest_exit.py."""
    if "exitstatus" not in _SESSION or os.environ.get("FLOWRL_TEST_NATIVE_TEARDOWN") == "1":
        return
    import atexit
    import sys
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_SESSION["exitstatus"])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a Serve or server test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_trainer(cfg, run_dir, quiet: bool = True, **kwargs) -> dict:
    """setup, train, close: one whole run with the Trainer (on the Ray already started)."""
    from flowrl_ray.runtime.trainer import Trainer
    trainer = Trainer(cfg, run_dir, quiet=quiet, **kwargs)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()


def train_killing(trainer, pid, after: int = 2) -> dict:
    """``trainer.train()`` while a thread SIGKILLs process ``pid`` once ``after`` iterations are
    done (a learner rank, say; ``pid`` may be a callable that names the process then); -> the
    run's summary."""
    import signal
    import threading
    import time

    def kill():
        while trainer.counters.iteration < after:
            time.sleep(0.01)
        os.kill(pid() if callable(pid) else pid, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    summary = trainer.train()
    killer.join(timeout=5)
    return summary
