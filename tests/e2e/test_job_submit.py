"""`ray job submit` of a tiny training run against a real `ray start --head` cluster.

Does what jobs/README.md tells a user to do on Ray 2.60:
  - a token in ~/.ray/auth_token (`ray get-auth-token --generate` makes one if there is none),
    so `ray start --head` runs with token authentication;
  - `RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:<dashboard port>
     --working-dir <repo> -- flowrl-ray train ...` (without RAY_AUTH_MODE the Jobs API refuses).

The cluster is stopped by ending the `ray start --block` process and the processes it started,
by pid. Not `ray stop`: in Ray 2.60 it takes no address and ends every Ray process on the
machine, including other clusters that may be running beside this test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from conftest import REPO

VENV_BIN = Path(sys.executable).parent
RAY = str(VENV_BIN / "ray")
TINY = ["train.iterations=2", "runtime.num_workers=1", "runtime.envs_per_worker=2",
        "runtime.rollout_length=64", "algo.minibatch_size=64", "algo.epochs=2", "eval.interval=0"]


def _free_ports(n: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _env(token_mode: bool) -> dict:
    """The user's environment: the venv's bin first on PATH, the real HOME (the token is in
    ~/.ray/auth_token), and RAY_AUTH_MODE=token only where the README says so."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_API_SERVER_ADDRESS"):
        env.pop(key, None)          # ray.init() earlier in this process may have set RAY_AUTH_MODE
    if token_mode:
        env["RAY_AUTH_MODE"] = "token"
    return env


def _run(args: list[str], token_mode: bool, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=_env(token_mode), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def _descendants(pid: int) -> list[int]:
    """All processes below `pid` (Linux /proc), found before the tree is taken down."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue                      # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stop_cluster(proc: subprocess.Popen) -> None:
    """End `ray start --block` and everything it started, by pid."""
    tree = _descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)     # --block: its Node shuts the cluster down
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in tree:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_ray_job_submit_trains(tmp_path):
    # A token, as a user creates it once (no-op when ~/.ray/auth_token exists already).
    r = _run([RAY, "get-auth-token", "--generate"], token_mode=False, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (Path.home() / ".ray" / "auth_token").is_file()

    gcs_port, dash_port, client_port, agent_port = _free_ports(4)
    address = f"http://127.0.0.1:{dash_port}"
    # A short temp dir: Ray's unix socket paths under it must stay below ~107 characters.
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")
    log = open(tmp_path / "ray_start.log", "w")
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--port", str(gcs_port), "--dashboard-port", str(dash_port),
         "--dashboard-host", "127.0.0.1", "--num-cpus", "4", "--temp-dir", temp_dir,
         "--ray-client-server-port", str(client_port), "--dashboard-agent-listen-port", str(agent_port),
         "--disable-usage-stats", "--block"],
        env=_env(token_mode=False), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        start_new_session=True)
    try:
        # Wait until the Jobs API answers (with the token).
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "ray_start.log").read_text()[-3000:]
            r = _run([RAY, "job", "list", "--address", address], token_mode=True, timeout=60)
            if r.returncode == 0:
                break
            assert time.monotonic() < deadline, r.stdout[-2000:] + r.stderr[-2000:]
            time.sleep(2)
        assert "Token authentication is enabled" in (tmp_path / "ray_start.log").read_text()

        # Without RAY_AUTH_MODE=token the client sends no token and the cluster refuses.
        r = _run([RAY, "job", "list", "--address", address], token_mode=False, timeout=60)
        assert r.returncode != 0
        assert "Missing authentication token" in r.stdout + r.stderr

        run_dir = tmp_path / "run"
        r = _run([RAY, "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
                  "flowrl-ray", "train", "configs/ppo/pendulum.yaml", *TINY,
                  "--run-dir", str(run_dir), "--no-tensorboard"], token_mode=True, timeout=400)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-4000:]
        assert "succeeded" in out, out[-4000:]
        assert "Connecting to existing Ray cluster" in out   # the job's driver used this cluster

        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        assert [row["iteration"] for row in rows] == [1, 2]
        assert rows[-1]["env_steps"] == 2 * 1 * 2 * 64
        assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints" / "latest").is_file()

        # What was uploaded: the package and configs, not the virtualenv (.gitignore: .venv/, runs/;
        # .rayignore: benchmarks/results/)
        pkgs = [p for p in Path(temp_dir).glob("session_latest/runtime_resources/working_dir_files/_ray_pkg_*")
                if p.is_dir()]
        assert len(pkgs) == 1, pkgs
        uploaded = {p.name for p in pkgs[0].iterdir()}
        assert {"flowrl_ray", "configs", "pyproject.toml"} <= uploaded
        assert ".venv" not in uploaded and "runs" not in uploaded and ".git" not in uploaded
        # .rayignore: the measured results stay home
        assert (pkgs[0] / "benchmarks").is_dir() and not (pkgs[0] / "benchmarks" / "results").exists()
        # the committed bases travel with the code (the GPU base, 21.8 MB, is the qm9_mid job's start)
        assert (pkgs[0] / "pretrained" / "qm9_mid_edm.pt").is_file()
        assert (pkgs[0] / "pretrained" / "edm_qm9_small.pt").is_file()
        size = sum(f.stat().st_size for f in pkgs[0].rglob("*") if f.is_file())
        assert size < 40 * 2**20, f"working dir upload is {size / 2**20:.1f} MiB"
    finally:
        _stop_cluster(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
