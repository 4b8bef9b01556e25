"""`flowrl-ray` end to end: compare (training on a local Ray it starts itself), eval, plot, help."""

import json
import os
import subprocess
import sys

import pytest

from flowrl_ray.metrics import read_metrics

from conftest import REPO, TINY_RUNTIME

CLI = [sys.executable, "-m", "flowrl_ray.cli"]


def _cli(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("verb", ["train", "eval", "tune", "compare", "serve", "plot"])
def test_every_verb_explains_itself(verb):
    proc = _cli(verb, "--help")
    assert proc.returncode == 0 and "usage: flowrl-ray " + verb in proc.stdout
    assert len(proc.stdout.split()) > 20


@pytest.mark.slow
def test_compare_runs_every_config_with_the_same_seeds_then_eval_and_plot_them(tmp_path):
    """`compare` trains PPO and CMA-PPO (2 seeds each, on one local Ray); `eval` and `plot` then
    read its run directories. (`train`'s progress lines and `train --resume`: tests/e2e/test_resume.py.)"""
    out = tmp_path / "cmp"
    proc = _cli("compare", "configs/ppo/pendulum.yaml", "configs/cma_ppo/pendulum.yaml", *TINY_RUNTIME,
                "train.iterations=2", "env.max_episode_steps=50", "--seeds", "2", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[compare] run 4/4" in proc.stdout
    table = json.loads((out / "comparison.json").read_text())
    assert [r["config"] for r in table] == ["ppo-pendulum", "cma-ppo-pendulum"]
    for row in table:
        assert row["seeds"] == 2 and row["env_steps"] == 2 * 2 * 2 * 64 and row["final_return_mean"] < 0
    assert sorted(p.name for p in (out / "ppo-pendulum").iterdir()) == ["seed0", "seed1"]
    assert (out / "comparison.png").stat().st_size > 1000 and "± " in (out / "comparison.md").read_text()
    ppo, cma = out / "ppo-pendulum" / "seed0", out / "cma-ppo-pendulum" / "seed0"
    assert [r["iteration"] for r in read_metrics(ppo)] == [1, 2]
    assert json.loads((ppo / "summary.json").read_text())["iterations"] == 2
    rows = read_metrics(cma)
    assert [r["iteration"] for r in rows] == [1, 2]
    assert rows[-1]["cma_ppo/history_len"] == 2

    proc = _cli("eval", str(ppo), "--episodes", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["episodes"] == 2 and result["length_mean"] == 50.0 and result["return_mean"] < 0
    proc = _cli("eval", str(cma), "--episodes", "2")
    assert proc.returncode == 0 and json.loads(proc.stdout.strip().splitlines()[-1])["episodes"] == 2

    png = tmp_path / "curves.png"
    proc = _cli("plot", str(ppo), str(cma), "--out", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    proc = _cli("plot", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "metrics.jsonl" in proc.stderr
