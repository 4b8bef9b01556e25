"""`train --resume` / `--resume-if-exists` end to end through the CLI: the flags' mistakes, a
finished run extended from its last lr, a relaunch that starts, resumes or refuses another config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flowrl_ray.metrics import read_metrics

from conftest import PENDULUM, REPO, TINY

# ---------------------------------------------------------------------- the CLI, end to end

CLI = [sys.executable, "-m", "flowrl_ray.cli"]
ENV = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
# checkpoints every iteration; short episodes so that returns appear
RUN = [*TINY, "runtime.checkpoint_interval=1", "env.max_episode_steps=50", "--no-tensorboard"]


def _cli(*args, timeout=300):
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=ENV)


def _one_line_error(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("args, needle", [
    (["train", str(PENDULUM), "--run-dir", "/tmp/x", "--resume-if-exists", "--resume", "/tmp/x"], "not both"),
    (["train", str(PENDULUM), "--resume-if-exists"], "--resume-if-exists needs a CONFIG and --run-dir"),
    (["train", "--run-dir", "/tmp/x", "--resume-if-exists"], "--resume-if-exists needs a CONFIG and --run-dir"),
])
def test_resume_flag_mistakes_are_one_line(args, needle):
    assert needle in _one_line_error(_cli(*args, timeout=120))


@pytest.mark.slow
def test_extending_a_finished_ppo_run_goes_on_from_its_last_lr(tmp_path):
    run = tmp_path / "run"
    proc = _cli("train", str(PENDULUM), *RUN, "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "it 3/3" in proc.stdout and "ETA" in proc.stdout and "done:" in proc.stdout     # progress
    # the habit: the same command, with --resume and a longer run
    proc = _cli("train", str(PENDULUM), *RUN, "train.iterations=6", "--resume", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming " + str(run) + " with train.iterations 3 -> 6" in proc.stdout
    assert "resumed from iteration 3" in proc.stdout and "it 6/6" in proc.stdout
    assert json.loads((run / "summary.json").read_text())["iterations"] == 6
    assert ("train.iterations 3 -> 6: ppo lr schedule (iterations 3 -> 6) re-anchored after iteration 3 "
            "(lr 0.000333): lr 0.00025 at iteration 4 (was 0)") in proc.stdout
    rows = read_metrics(run)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # lr 1e-3 linear over 3: 1, 2/3, 1/3; then from 1/3 (iteration 3) down by 1/12 per iteration
    assert [r["ppo/lr"] / 1e-3 for r in rows] == pytest.approx([1, 2 / 3, 1 / 3, 1 / 4, 1 / 6, 1 / 12])
    # a change that a resume cannot make: one line naming the keys, before Ray starts
    line = _one_line_error(_cli("train", "--resume", str(run), "algo.lr=0.1", "runtime.num_workers=1"))
    assert "algo.lr (0.001 in the run, 0.1 now)" in line and "runtime.num_workers (2 in the run, 1 now)" in line
    line = _one_line_error(_cli("train", "--resume", str(run), "train.iterations=5"))
    assert "'train.iterations': 5 is below the 6 iterations" in line


@pytest.mark.slow
def test_resume_if_exists_starts_resumes_and_refuses_another_config(tmp_path):
    run = tmp_path / "run"
    # enough iterations that the interrupt below lands before the run ends on its own (a tiny
    # iteration takes a fraction of a second; 8 were once all done before SIGINT was handled)
    total = 30
    launch = ["train", str(PENDULUM), *RUN, f"train.iterations={total}", "--run-dir", str(run),
              "--resume-if-exists"]
    # an earlier launch that died before its first checkpoint left its config and a metrics row
    run.mkdir()
    (run / "config.yaml").write_text((PENDULUM).read_text())
    (run / "metrics.jsonl").write_text('{"iteration": 1, "env_steps": 1}\n')
    # launch, then "preempt" (SIGINT) once the iteration-3 checkpoint is there
    # started with SIGINT ignored (a shell's background job; a parent that ignores it): it must
    # still stop on SIGINT
    proc = subprocess.Popen([*CLI, *launch], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=ENV, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "iter_000003.pt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no iteration-3 checkpoint"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert "has no checkpoint yet: starting the run afresh" in out
    done = max(r["iteration"] for r in read_metrics(run))
    assert 3 <= done < total
    # re-launch: the same command resumes from the latest checkpoint and finishes
    proc = _cli(*launch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = int(proc.stdout.split("resumed from iteration ")[1].split()[0])
    assert 3 <= resumed <= done
    assert [r["iteration"] for r in read_metrics(run)] == list(range(1, total + 1))
    # re-launch with another CONFIG: one line naming the differing keys, exit status 2
    other = REPO / "configs" / "cma_ppo" / "pendulum.yaml"
    line = _one_line_error(_cli("train", str(other), *[a for a in RUN if not a.startswith("algo.")],
                                "--run-dir", str(run), "--resume-if-exists"))
    assert "algorithm ('ppo' in the run, 'cma_ppo' now)" in line and "name (" in line
