"""`flowrl-ray train` against a real `ray start --head` cluster that the test starts and stops by
pid (the address rule and the fit check alone: tests/unit/runtime/test_cluster.py).

The cluster test gives `ray start` and the runs their own Ray temp dir (RAY_TMPDIR), so "auto"
finds this test's cluster through the record Ray keeps there, whatever else runs on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import PENDULUM, REPO
from e2e.test_job_submit import _descendants, _free_ports, _stop_cluster

VENV_BIN = Path(sys.executable).parent
TINY = ["train.iterations=2", "runtime.num_workers=1", "runtime.envs_per_worker=2",
        "runtime.rollout_length=64", "algo.minibatch_size=64", "algo.epochs=2", "eval.interval=0"]

# --------------------------------------------------------------------------- a real cluster

def _env(tmp: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_TMPDIR"] = tmp              # Ray's temp dir and its ray_current_cluster record: ours
    # Token authentication, as `ray start --head` runs by default in Ray 2.60, with a token of our
    # own: HOME is the temp dir, so ~/.ray/auth_token is <tmp>/.ray/auth_token.
    env["HOME"] = tmp
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_AUTH_TOKEN", None)
    env["PYTHONPATH"] = str(REPO)
    return env


def _train(tmp: str, run_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowrl_ray.cli", "train", str(PENDULUM), *TINY,
                           "--run-dir", str(run_dir), "--no-tensorboard", *args],
                          env=_env(tmp), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _our_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("flowrl-ray")]


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `ray start --block` and everything below it: an unclean stop, record left behind."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


@pytest.mark.slow
def test_train_against_a_ray_start_cluster(tmp_path):
    tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")          # short: Ray's socket paths live under it
    gcs_port, client_port, agent_port, metrics_port = _free_ports(4)
    log = open(tmp_path / "ray_start.log", "w")
    subprocess.run([str(VENV_BIN / "ray"), "get-auth-token", "--generate"], env=_env(tmp), check=True,
                   capture_output=True, timeout=120)
    assert (Path(tmp) / ".ray" / "auth_token").is_file()
    proc = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", "--port", str(gcs_port), "--num-cpus", "2",
         "--include-dashboard", "false", "--ray-client-server-port", str(client_port),
         "--dashboard-agent-listen-port", str(agent_port), "--metrics-export-port", str(metrics_port),
         "--disable-usage-stats", "--block"],
        env=_env(tmp), stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    record = Path(tmp) / "ray" / "ray_current_cluster"
    try:
        deadline = time.monotonic() + 120
        while not (record.is_file() and record.read_text().strip().endswith(f":{gcs_port}")):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "ray_start.log").read_text()[-3000:]
            time.sleep(1)

        # --address auto: this cluster (2 CPUs: the learner and one worker)
        r = _train(tmp, tmp_path / "auto", "--address", "auto")
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-4000:]
        line = next(x for x in r.stdout.splitlines() if "Ray:" in x)
        assert line.startswith("[flowrl_ray] Ray: connected to ") and f":{gcs_port} (runtime.ray_address; 2 CPUs, 0 GPUs" in line, line
        assert [row["iteration"] for row in _rows(tmp_path / "auto")] == [1, 2]
        # an explicit address: as in ray.init, the token is sent only with RAY_AUTH_MODE=token
        r = _train(tmp, tmp_path / "no_token", "--address", f"127.0.0.1:{gcs_port}")
        err = _our_lines(r.stderr)
        assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
        assert "it uses token authentication: run with RAY_AUTH_MODE=token" in err[0]

        # no address while the cluster runs: a private Ray of its own (3 CPUs on this 2-core machine)
        r = _train(tmp, tmp_path / "private")
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        assert "[flowrl_ray] Ray: started a private local Ray (" in r.stdout
        assert "Connecting to existing Ray cluster" not in r.stdout + r.stderr
        assert [row["iteration"] for row in _rows(tmp_path / "private")] == [1, 2]

        # never fits: 4 workers x 1 CPU + the learner on a 2-CPU cluster without autoscaler
        t0 = time.monotonic()
        r = _train(tmp, tmp_path / "too_big", "--address", "auto", "runtime.num_workers=4")
        err = _our_lines(r.stderr)        # Ray's own log lines (connecting, ...) come before it
        assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
        assert "flowrl-ray train: error: runtime: the run cannot fit" in err[0] and "5 CPUs" in err[0]
        assert "at most 2" in err[0] and time.monotonic() - t0 < 120
        assert not (tmp_path / "too_big" / "config.yaml").exists()        # no actor ever started
        # ... and a GPU learner on a cluster with no GPU
        r = _train(tmp, tmp_path / "gpu", "--address", "auto", "runtime.learner_num_gpus=1")
        assert r.returncode == 2 and "no node has room for one learner (1 CPU + 1 GPU)" in r.stderr, r.stderr

        # an unclean stop leaves the record pointing at a dead cluster ("private" above: no address
        # starts a private Ray whatever the record says)
        _kill_tree(proc)
        assert record.read_text().strip().endswith(f":{gcs_port}")
        r = _train(tmp, tmp_path / "auto_dead", "--address", "auto", timeout=120)
        err = _our_lines(r.stderr)
        assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
        assert "auto -> " in err[0] and f":{gcs_port}" in err[0] and "no Ray cluster answers there" in err[0]
        assert "points at a stopped cluster" in err[0]
    finally:
        _stop_cluster(proc)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
