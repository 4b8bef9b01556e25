"""The GPU check (benchmarks/gpu_check.sh) on a machine without a GPU, in a Python where the
packages a bare GPU machine lacks fail to import: it must pass with its CUDA halves skipped, so a
GPU's minutes go to running it. Also: every test guarded by a CUDA skip is marked `cuda` (the
check runs the marked ones), and the files the check needs fit what such a machine takes in."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO

#: what a machine with torch, numpy, PyYAML, transformers and peft lacks, less what the check
#: carries to it (gymnasium, bitsandbytes: `bash benchmarks/gpu_check.sh site`)
NOT_THERE = ("ray", "rdkit", "qm9pack", "pandas", "scipy", "matplotlib", "robosuite", "mujoco", "h5py",
             "playwright", "tblite", "xtb", "PIL", "imageio", "tensorboard")

#: what such a machine takes in: the tracked tree plus the folders a command carries
MACHINE_INPUT_BYTES = 64 * 2**20
#: the largest folder a prepared GPU command carries beside the tree: the QM9 pack of
#: benchmarks/edm_continue_gpu.sh (10.3 MB; the GPU check's build/gpu-site is 10.7 MB)
LARGEST_CARRIED_BYTES = 10_800_000


def _cuda_guarded_tests() -> list[tuple[str, str, bool]]:
    """(file, test, marked cuda) for every test whose decorators skip it without CUDA."""
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"def (test_\w+)", line)
            if not m:
                continue
            j, decorators = i - 1, []
            while j >= 0 and lines[j].startswith("@"):
                decorators.append(lines[j])
                j -= 1
            if any("not torch.cuda.is_available()" in d for d in decorators):
                found.append((str(path.relative_to(REPO)), m.group(1),
                              any("pytest.mark.cuda" in d for d in decorators)))
    return found


def test_every_test_skipped_without_cuda_is_marked_cuda():
    guarded = _cuda_guarded_tests()
    assert len(guarded) >= 3                      # PPO and FPO++, FED-GRPO, the 4-bit QLoRA SFT
    assert [g for g in guarded if not g[2]] == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU half; the GPU machine runs the whole")
def test_the_gpu_check_passes_without_a_gpu_and_without_rays_or_simulators(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(      # imported at start-up: `import name` raises ImportError
        f"import sys\nfor name in {NOT_THERE!r}:\n    sys.modules[name] = None\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_SITE": str(tmp_path / "no-site"),
           "PYTHONPATH": str(block)}
    run = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--quick", "--reps", "1"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    marked = {g[0] for g in _cuda_guarded_tests()}
    assert f"CUDA tests: exit 0 ({len(marked)} files)" in log
    summary = (out / "cuda_tests.txt").read_text().strip().splitlines()[-1]     # pytest's last line
    skipped = re.search(r"(\d+) skipped", summary)
    assert skipped and int(skipped.group(1)) >= len(_cuda_guarded_tests())   # (parametrised ones count more)
    assert "passed" not in summary and "failed" not in summary and "error" not in summary
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["passed"] and res["machine"]["cuda_available"] is False
    for name in ("ppo", "fpopp", "fed_grpo"):
        r = res["checks"][name]
        assert r["passed"] and r["cuda"] == "skipped: no CUDA device" and len(r["cpu"]["update_s"]) == 1
        assert all(v == v for v in r["cpu_metrics"].values())           # finite numbers came back
    nf4 = res["checks"]["flow_grpo_nf4"]
    assert nf4["passed"] and nf4["device"] == "cpu" and nf4["linear4bit_layers"] > 0
    assert nf4["all_trainable_are_lora"] and nf4["adapters_moved"] > 0 and nf4["frozen_moved"] == []
    assert nf4["ratio_start_max_abs_logp_gap"] < 1e-2
    assert "| ppo |" in (out / "gpu_check.md").read_text()


def test_a_failing_check_fails_the_command_and_keeps_the_others(tmp_path, monkeypatch):
    """A check that raises is reported with its error and makes the exit status 1; the other
    checks still run and are written."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    def broken(name, reps, tolerance, cuda):
        if name == "fpopp":
            raise RuntimeError("device-side assert")
        return {"cpu": {"update_s": [0.1]}, "cuda": "skipped: no CUDA device", "passed": True, "cpu_metrics": {}}

    monkeypatch.setattr(gpu_check, "check_update", broken)
    assert gpu_check.main(["--out", str(tmp_path), "--checks", "ppo", "fpopp", "--reps", "1"]) == 1
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["passed"] is False and res["checks"]["ppo"]["passed"]
    assert "device-side assert" in res["checks"]["fpopp"]["error"]
    assert "error: RuntimeError: device-side assert" in (tmp_path / "gpu_check.md").read_text()


def test_the_step_difference_by_hand():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from gpu_check import step_difference
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    start = {"a": torch.zeros(2), "b": torch.zeros(1)}
    cpu = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}        # |step| = 5
    gpu = {"a": torch.tensor([3.0, 0.3]), "b": torch.tensor([4.4])}        # |gpu - cpu| = 0.5
    d = step_difference(start, cpu, gpu)
    assert d["relative_step_difference"] == pytest.approx(0.1) and d["cpu_step_norm"] == pytest.approx(5.0)
    assert d["max_abs_weight_difference"] == pytest.approx(0.4) and d["parameters"] == 3 and d["finite"]


def test_what_a_gpu_command_takes_in_fits_the_machine():
    """The tracked tree plus the largest folder a prepared GPU command carries stays within what
    a GPU machine takes in (results and bases grow the tree; this fails before a GPU's minutes
    are spent finding out)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tracked = sum((REPO / f).stat().st_size for f in files.decode().split("\0") if f and (REPO / f).is_file())
    site = REPO / "build" / "gpu-site"
    carried = max(LARGEST_CARRIED_BYTES, sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
                  if site.is_dir() else 0)
    assert tracked + carried <= MACHINE_INPUT_BYTES, (
        f"the tracked tree ({tracked / 2**20:.1f} MiB) plus {carried / 2**20:.1f} MiB carried exceeds "
        f"{MACHINE_INPUT_BYTES / 2**20:.0f} MiB")


def test_the_forms_sft_gpu_command_trains_and_scores_copying_without_ray_playwright_or_matplotlib(tmp_path):
    """benchmarks/forms_sft_gpu.sh, 2 steps of 4 pairs and 4 scored tasks: it continues the
    committed continuation's weights, writes a checkpoint the RL config can load (its losses,
    no PNG without matplotlib) and the copy report, in a Python where the browser, Ray and
    matplotlib fail to import."""
    from flowrl_ray.models.masked_diffusion import load_sft_checkpoint
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        f"import sys\nfor name in {NOT_THERE + ('gymnasium',)!r}:\n    sys.modules[name] = None\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PYTHONPATH": str(block),
           "COPY_FLAGS": "--tasks 4 --steps 4 --n-boot 100"}
    run = subprocess.run(["bash", "benchmarks/forms_sft_gpu.sh", "1", "--steps", "2", "--batch-size", "4",
                          "--tasks-per-form", "5"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    ckpt = out / "forms_sft_gpu"
    assert "no sft_loss.png" in log and not (ckpt / "sft_loss.png").exists()
    assert len((ckpt / "sft_metrics.jsonl").read_text().splitlines()) == 2
    run_info = json.loads((ckpt / "sft_run.json").read_text())
    assert str(run_info.get("init_from", "")).endswith("pretrained/forms_small_sft_cont")
    from flowrl_ray.config import load_config
    cfg = load_config(REPO / "configs/flow_grpo/forms_small.yaml")
    from dataclasses import asdict
    lm = load_sft_checkpoint(ckpt, asdict(cfg.algo.model))
    assert sum(p.numel() for p in lm.model.parameters()) == 1_311_872       # forms_small's architecture
    report = json.loads((out / "forms_sft_gpu_copy.json").read_text())
    assert report and (out / "forms_sft_gpu_copy.md").is_file()


def test_the_compared_weights_leave_out_optimisers_random_state_and_sample_counts():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from gpu_check import _weights
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    class Algo:
        def state_dict(self):
            return {"policy": {"w": torch.ones(2, 2), "obs_norm.mean": torch.zeros(3),
                               "obs_norm.count": torch.tensor(2048.0), "steps": torch.tensor(3)},
                    "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}, "generator": torch.zeros(8, dtype=torch.uint8),
                    "skipped_updates": 0}
    assert sorted(_weights(Algo())) == ["policy.obs_norm.mean", "policy.w"]
