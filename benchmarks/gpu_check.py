"""The learner's updates on the CPU and on the GPU from one prepared batch, and the 4-bit Flow-GRPO update.

Part of the GPU check, which ``benchmarks/gpu_check.sh`` runs whole (the CUDA tests, then this
script) on a machine with torch, transformers and peft but no Ray; on its own:

    python benchmarks/gpu_check.py --out FOLDER [--reps 5] [--quick]

- ``ppo``, ``fpopp``, ``fed_grpo``: the batches of ``benchmarks/learner_group.py`` (PPO with
  ``configs/ppo/halfcheetah.yaml``'s networks on 2,048 samples; FPO++ with ``lift_state.yaml``'s
  512 x 3 networks, N_mc 8, on 1,000 samples; FED-GRPO with ``qm9_small.yaml``'s EDM on one
  iteration's 2 x 8 molecules). The algorithm is built on the CPU from a fixed seed and its batch
  prepared there; a second instance on the GPU gets the same state (FED-GRPO: the CPU's sampled
  trajectory, copied). One update on each from that start; reported: how far the GPU's step lies
  from the CPU's, ``|step_gpu - step_cpu| / |step_cpu|`` over every network weight (the check
  passes below ``--tolerance``), and the largest weight difference. Then ``--reps`` timed updates
  on each device (the CPU with one torch thread, as a learner actor has; CUDA between
  ``torch.cuda.synchronize`` calls).
- ``flow_grpo_nf4``: ``configs/flow_grpo/forms_small.yaml`` from its SFT base quantised to 4-bit
  NF4 by bitsandbytes, LoRA adapters (r 16) on every linear layer, one iteration's batch generated
  on the learner's device with rewards drawn at random (an update's cost does not depend on them;
  line credit is scored offline from the texts). Checks: the behaviour log-probs recorded while
  sampling equal the ones recomputed before the update (the ratio is 1 at the start), only the
  adapters move, the 4-bit weights do not, the update's numbers are finite. Times generation and
  update. Without CUDA it runs on bitsandbytes' CPU path, so the command is checked anywhere.

Without a GPU the CUDA halves are reported as skipped and the CPU halves still run. ``--quick``
shrinks the Flow-GRPO batch (a check of the command, not a figure). Writes FOLDER/gpu_check.json
and FOLDER/gpu_check.md; the exit status is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TITLE = "GPU check: learner updates on the CPU and the GPU, the 4-bit Flow-GRPO update"

#: state_dict entries that are not network weights (optimisers, schedules, random state)
NOT_WEIGHTS = ("opt", "optimizer", "actor_opt", "critic_opt", "scheduler", "generator", "iteration",
               "skipped_updates", "node_histogram")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--checks", nargs="+", default=["ppo", "fpopp", "fed_grpo", "flow_grpo_nf4"],
                   choices=["ppo", "fpopp", "fed_grpo", "flow_grpo_nf4"])
    p.add_argument("--reps", type=int, default=5, help="timed updates per device")
    p.add_argument("--tolerance", type=float, default=1e-2,
                   help="largest |step_gpu - step_cpu| / |step_cpu| that passes")
    p.add_argument("--quick", action="store_true", help="a small Flow-GRPO batch: checks the command")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- helpers

def _weights(algo) -> dict:
    """Every floating-point network tensor of the algorithm's state (weights and running
    statistics, not sample counts), on the CPU, by its path."""
    import torch
    out = {}

    def walk(prefix: str, v) -> None:
        if torch.is_tensor(v):
            if v.is_floating_point() and not prefix.endswith(".count"):     # (a normaliser's sample count)
                out[prefix] = v.detach().float().cpu().clone()
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)

    for k, v in algo.state_dict().items():
        if k not in NOT_WEIGHTS:
            walk(k, v)
    return out


def step_difference(start: dict, cpu: dict, gpu: dict) -> dict:
    """|gpu - cpu| / |cpu - start| over every tensor together (the steps' relative distance),
    the largest elementwise |gpu - cpu| and the CPU step's norm."""
    import torch
    num = sum(float((gpu[k] - cpu[k]).pow(2).sum()) for k in start)
    den = sum(float((cpu[k] - start[k]).pow(2).sum()) for k in start)
    largest = max(float((gpu[k] - cpu[k]).abs().max()) for k in start)
    return {"relative_step_difference": math.sqrt(num) / max(math.sqrt(den), 1e-30),
            "max_abs_weight_difference": largest, "cpu_step_norm": math.sqrt(den),
            "tensors": len(start), "parameters": int(sum(t.numel() for t in start.values())),
            "finite": all(bool(torch.isfinite(gpu[k]).all()) for k in start)}


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_updates(algo, prepared, reps: int, device) -> list[float]:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        algo.update(prepared)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _to(x, device):
    import torch
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, list):
        return [_to(v, device) for v in x]
    return x


# --------------------------------------------------------------------------- CPU vs GPU

def check_update(name: str, reps: int, tolerance: float, cuda: bool) -> dict:
    """One algorithm: the same start and batch on the CPU and the GPU, one update each, compared;
    then the timed updates."""
    import torch

    import learner_group
    build = {"ppo": learner_group._ppo, "fpopp": learner_group._fpopp, "fed_grpo": learner_group._fed_grpo}[name]
    cpu_device = torch.device("cpu")
    algo, batches = build(cpu_device)                      # weights from a fixed seed, batch on the CPU
    start_state = copy.deepcopy(algo.state_dict())
    pending = copy.deepcopy(getattr(algo, "pending", None))   # a group algorithm's sampled trajectory
    start = _weights(algo)
    prepared = algo.prepare(batches)
    metrics = algo.update(prepared)
    after_cpu = _weights(algo)
    out = {"cpu": {"update_s": time_updates(algo, prepared, reps, cpu_device)},
           "cpu_metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}}
    if not cuda:
        out["cuda"] = "skipped: no CUDA device"
        out["passed"] = True
        return out
    gpu_device = torch.device("cuda")
    gpu = type(algo)(algo.cfg, algo.spec, gpu_device)
    gpu.load_state_dict(start_state)
    if pending:                                             # the CPU's trajectory, its tensors on the GPU
        gpu.pending = {**pending, "trajectory": _to(pending["trajectory"], gpu_device)}
    if set(_weights(gpu)) != set(start):
        raise AssertionError("the GPU instance holds other weights than the CPU one")
    gprepared = gpu.prepare(batches)
    gmetrics = gpu.update(gprepared)
    diff = step_difference(start, after_cpu, _weights(gpu))
    out["cuda"] = {"update_s": time_updates(gpu, gprepared, reps, gpu_device), **diff,
                   "metrics": {k: float(v) for k, v in gmetrics.items() if isinstance(v, (int, float))}}
    out["passed"] = diff["finite"] and diff["relative_step_difference"] <= tolerance
    return out


# --------------------------------------------------------------------------- the 4-bit Flow-GRPO update

LORA = "{r: 16, alpha: 32, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"


def flow_grpo_nf4(reps: int, quick: bool) -> dict:
    import numpy as np
    import torch

    from flowrl_ray.algorithms.flow_grpo import FlowGRPO
    from flowrl_ray.batch import Batch, BatchMeta
    from flowrl_ray.config import load_config
    from flowrl_ray.envs import EnvSpec
    from flowrl_ray.models.masked_diffusion import trajectory_log_probs
    overrides = ["algo.model.load_in_4bit=true", f"algo.model.lora={LORA}",
                 f"algo.sft_checkpoint={REPO / 'pretrained/forms_small_sft'}"]
    if quick:
        overrides += ["algo.group_size=2", "algo.num_generation_steps=8", "algo.gen_length=64",
                      "algo.timestep_fraction=0.5"]
    cfg = load_config(REPO / "configs/flow_grpo/forms_small.yaml", overrides)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    learner = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # the learner's device
    algo = FlowGRPO(cfg, EnvSpec(obs_shape=(1,), action_dim=1), learner)
    build_s = time.perf_counter() - t0
    model = algo.lm.model
    device = next(p for p in model.parameters()).device
    quantised = [n for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"]
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    _sync(device)
    t0 = time.perf_counter()
    chunks = algo.generate(cfg.algo.prompts_per_iteration, "train")
    _sync(device)
    generate_s = time.perf_counter() - t0
    traj = algo.pending["trajectory"]
    model.train()                                        # the update's mode (dropout 0)
    with torch.no_grad():
        recomputed = trajectory_log_probs(model, traj, cfg.algo.generation_temperature)
    model.eval()
    ratio_gap = float((recomputed.float() - traj["logp"].float()).abs().max())
    ids = np.concatenate([c["ids"] for c in chunks])
    rewards = np.random.default_rng(0).uniform(size=len(ids)).astype(np.float32)
    zeros = np.zeros_like(rewards)
    data = {"ids": ids, "rewards": rewards, "task_completion": zeros, "field_accuracy": rewards,
            "execution_completeness": zeros, "unparseable_lines": zeros}
    prepared = algo.prepare([Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=len(ids)))])
    _sync(device)
    t0 = time.perf_counter()
    metrics = algo.update(prepared)
    _sync(device)
    first_update_s = time.perf_counter() - t0
    moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(trainable[n], p)]
    frozen_moved = [n for n, p in model.named_parameters() if n in frozen and not torch.equal(frozen[n], p)]
    numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    finite = all(math.isfinite(v) for v in numbers.values())
    out = {"device": str(device), "linear4bit_layers": len(quantised),
           "trainable_tensors": len(trainable), "trainable_parameters": int(sum(p.numel() for p in trainable.values())),
           "all_trainable_are_lora": all("lora_" in n for n in trainable),
           "episodes": int(len(ids)), "generation_steps": int(cfg.algo.num_generation_steps),
           "gen_length": int(cfg.algo.gen_length), "build_s": build_s, "generate_s": generate_s,
           "first_update_s": first_update_s, "update_s": time_updates(algo, prepared, reps, device),
           "ratio_start_max_abs_logp_gap": ratio_gap, "adapters_moved": len(moved),
           "frozen_moved": frozen_moved, "metrics": numbers, "finite": finite}
    out["passed"] = (bool(quantised) and out["all_trainable_are_lora"] and bool(moved) and not frozen_moved
                     and finite and ratio_gap < 1e-2)
    return out


# --------------------------------------------------------------------------- report

def _median(xs) -> float | None:
    return statistics.median(xs) if xs else None


def markdown(res: dict) -> str:
    lines = [f"Python and packages: {res['machine']}", "", "## CPU vs GPU, one prepared batch", "",
             "| algorithm | CPU s / update (1 thread) | GPU s / update | speed-up | GPU step vs CPU step | "
             "largest weight difference | passed |", "|---|---|---|---|---|---|---|"]
    for name in ("ppo", "fpopp", "fed_grpo"):
        r = res["checks"].get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'].splitlines()[-1]} | | | | | no |")
            continue
        cpu = _median(r["cpu"]["update_s"])
        if isinstance(r["cuda"], str):
            lines.append(f"| {name} | {cpu:.3f} | {r['cuda']} | | | | {'yes' if r['passed'] else 'no'} |")
            continue
        gpu = _median(r["cuda"]["update_s"])
        lines.append(f"| {name} | {cpu:.3f} | {gpu:.4f} | {cpu / gpu:.1f}x | "
                     f"{r['cuda']['relative_step_difference']:.2e} | {r['cuda']['max_abs_weight_difference']:.2e} | "
                     f"{'yes' if r['passed'] else 'no'} |")
    r = res["checks"].get("flow_grpo_nf4")
    if r is not None:
        lines += ["", "## Flow-GRPO, 4-bit NF4 base with LoRA adapters", ""]
        if "error" in r:
            lines.append(f"error: {r['error'].splitlines()[-1]}")
        else:
            lines += [f"- device {r['device']}; {r['linear4bit_layers']} 4-bit linear layers; "
                      f"{r['trainable_parameters']:,} trainable parameters, all LoRA: {r['all_trainable_are_lora']}",
                      f"- {r['episodes']} episodes, {r['generation_steps']} unmasking steps, {r['gen_length']} tokens: "
                      f"generation {r['generate_s']:.2f} s, first update {r['first_update_s']:.2f} s, "
                      f"then median {_median(r['update_s']) or float('nan'):.2f} s per update",
                      f"- ratio at the start: largest |recomputed - recorded| log-prob {r['ratio_start_max_abs_logp_gap']:.2e}",
                      f"- adapters moved: {r['adapters_moved']}; frozen tensors moved: {len(r['frozen_moved'])}; "
                      f"finite: {r['finite']}; passed: {'yes' if r['passed'] else 'no'}"]
    return "\n".join(lines) + "\n"


def machine() -> dict:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    for name in ("transformers", "peft", "bitsandbytes"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:                              # noqa: BLE001 (reported, not raised)
            info[name] = f"not importable: {type(e).__name__}"
    return info


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    torch.set_num_threads(1)                               # the CPU learner's default
    cuda = torch.cuda.is_available()
    res = {"machine": machine(), "reps": args.reps, "tolerance": args.tolerance, "quick": args.quick, "checks": {}}
    for name in args.checks:
        t0 = time.perf_counter()
        try:
            r = flow_grpo_nf4(args.reps, args.quick) if name == "flow_grpo_nf4" else \
                check_update(name, args.reps, args.tolerance, cuda)
        except Exception:                                   # noqa: BLE001 (one failure does not hide the rest)
            r = {"error": traceback.format_exc(), "passed": False}
        r["wall_s"] = time.perf_counter() - t0
        res["checks"][name] = r
        print(f"[gpu-check] {name}: {'passed' if r['passed'] else 'FAILED'} ({r['wall_s']:.1f} s)", flush=True)
        if "error" in r:
            print(r["error"], file=sys.stderr, flush=True)
    res["passed"] = all(r["passed"] for r in res["checks"].values())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "gpu_check.json", res, indent=1)
    write_results("gpu_check", TITLE, markdown(res), results_dir=out)     # prints it too
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
