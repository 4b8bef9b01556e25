"""The CLI's user errors as a subprocess: one line, no traceback, exit status 2, before Ray starts."""

import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.parametrize("args, needle", [
    (["train", "configs/ppo/pendulum.yaml", "runtime.num_workers=0"], "runtime.num_workers"),
    (["train", "configs/ppo/pendulum.yaml", "algo.lrr=1"], "algo.lr"),
    (["train", "configs/ppo/missing.yaml"], "not found"),
    (["train", "configs/ppo/pendulum.yaml", "env.id=NoSuchEnv-v0"], "env.id"),
    (["eval", "/nonexistent/run"], "not a run directory"),
    (["train", "--resume", "/nonexistent/run"], "not a run directory"),
])
def test_cli_user_errors_are_one_line_without_traceback_and_before_ray(args, needle):
    proc = subprocess.run([sys.executable, "-m", "flowrl_ray.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and "Traceback" not in proc.stderr
    assert "Started a local Ray" not in proc.stdout + proc.stderr
