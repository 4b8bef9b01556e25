"""FlowSAR's ablations on robosuite (low-dim state) on this machine: the credit rules, the
specification's literal formulas, its loss variants and baselines, and its hyperparameter sweeps,
every variant from the same pretrained policy at the same env-step budget, evaluated with the
robot protocol (``robot_protocol.py``: every policy and its base on the same seeded episodes in
one process, gains with episode-paired bootstrap CIs, each variant's difference from the
default FlowSAR).

Run from the repository root:

    .venv/bin/python benchmarks/flowsar_lift.py                                  # the ablation, 3 seeds
    .venv/bin/python benchmarks/flowsar_lift.py --variants flowsar flowsar-uniform fpopp --seeds 0 1 2
    .venv/bin/python benchmarks/flowsar_lift.py --sweep temperature --seeds 0 1  # the spec's ablation 3
    .venv/bin/python benchmarks/flowsar_lift.py --task can --variants flowsar flowsar-uniform fpopp
    .venv/bin/python benchmarks/flowsar_lift.py --runs runs/bench-*              # re-evaluate finished runs
    .venv/bin/python benchmarks/flowsar_lift.py ... --ood                        # also the OOD suite

Every run is one ``flowrl-ray train`` of a quickstart config (2 workers x 8 envs x 40 chunk steps
per iteration for every algorithm) for ``--iterations`` iterations, named after its variant, one
at a time. Results: ``benchmarks/results/<output>.{md,json}`` and the protocol's curves (default
output ``flowsar_ablation_<task>`` or ``flowsar_sweep_<name>_<task>``). The specification predicts
full > uniform > random ~ inverse; the report says what was measured, CIs included.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO_ROOT  # noqa: E402
from _robot import FLOWRL, ensure_demos_and_base  # noqa: E402

os.environ.setdefault("MUJOCO_GL", "egl")
FLOWSAR = "configs/flowsar/lift_state_quickstart.yaml"
FPOPP = "configs/fpopp/lift_state_quickstart.yaml"
REINFLOW = "configs/reinflow/lift_state_quickstart.yaml"
H = "algo."
#: variant -> (config, overrides). "flowsar" is the default: e standardised per episode, 3 noise
#: draws, weights of mean 1 per step.
VARIANTS = {
    "flowsar": (FLOWSAR, []),
    "flowsar-literal": (FLOWSAR, [f"{H}error_scale=literal", f"{H}weight_scale=sum_one",
                                  f"{H}n_annotation_samples=1"]),              # the spec read literally
    "flowsar-uniform": (FLOWSAR, [f"{H}weight_mode=uniform"]),                 # = DiffusionNFT's weights
    "flowsar-random": (FLOWSAR, [f"{H}weight_mode=random"]),
    "flowsar-inverse": (FLOWSAR, [f"{H}weight_mode=inverse"]),
    "flowsar-normalized": (FLOWSAR, [f"{H}weight_mode=normalized"]),
    "flowsar-critic_oracle": (FLOWSAR, [f"{H}weight_mode=critic_oracle"]),
    "flowsar-centred": (FLOWSAR, [f"{H}label_baseline=batch"]),                # beyond the spec
    "flowsar-simple": (FLOWSAR, [f"{H}loss_variant=simple"]),                  # the spec's ablation 5
    "rft": (FLOWSAR, [f"{H}loss_variant=rft", f"{H}weight_mode=uniform", f"{H}kl_coeff=0",
                      f"{H}t_min=0", f"{H}t_max=1"]),
    # the same batch per iteration (rollout_length 40), each algorithm's own update settings
    "reinflow": (REINFLOW, ["runtime.rollout_length=40"]),
    "fpopp": (FPOPP, ["runtime.rollout_length=40"]),
}
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "flowsar-centred"]
#: the specification's ablations 2-4 and the quickstart's learning rate (with a 3-iteration warm-up)
SWEEPS = {"tau_mid": [0.2, 0.3, 0.5, 0.7, 0.8], "temperature": [0.1, 0.3, 0.5, 1.0, 2.0],
          "beta": [0.5, 1.0, 1.5, 2.0], "lr": [1e-5, 3e-5, 1e-4, 3e-4]}


def sweep_variants(name: str) -> dict[str, tuple[str, list[str]]]:
    extra = [f"{H}lr_warmup_iters=3"] if name == "lr" else []
    return {f"flowsar-{name}{v:g}": (FLOWSAR, [f"{H}{name}={v}", *extra]) for v in SWEEPS[name]}


def task_overrides(task: str) -> list[str]:
    """The quickstart configs are Lift's; another task swaps the env, its demos and base policy."""
    if task == "lift":
        return []
    return [f"env.id={task}", f"env.dataset=demos/{task}.hdf5",
            f"algo.base_policy=pretrained/{task}_state_quickstart.pt"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="lift", choices=["lift", "can", "square"])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help=f"default: {' '.join(DEFAULT_VARIANTS)}")
    p.add_argument("--sweep", choices=list(SWEEPS), help="instead of --variants: one hyperparameter's values")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=40, help="per run (640 chunk steps each)")
    p.add_argument("--runs", nargs="*", help="evaluate these finished run directories instead of training")
    p.add_argument("--episodes", type=int, default=100, help="evaluation episodes per sampling rule")
    p.add_argument("--demos", type=int, default=50)
    p.add_argument("--pretrain-epochs", type=int, default=20)
    p.add_argument("--ood", nargs="*", metavar="SET", help="also the OOD suite (robot_protocol --ood)")
    p.add_argument("--output")
    args = p.parse_args()
    if args.sweep and args.variants:
        p.error("--sweep and --variants: one or the other")
    os.chdir(REPO_ROOT)
    from flowrl_ray.config import load_config
    import robot_protocol

    variants = sweep_variants(args.sweep) if args.sweep else {v: VARIANTS[v] for v in args.variants or DEFAULT_VARIANTS}
    extra = task_overrides(args.task)
    cfg = load_config(FLOWSAR, extra)
    ensure_demos_and_base(FLOWSAR, cfg, args.task, args.demos, args.pretrain_epochs, extra)
    groups: dict[str, list[str]] = {}
    if args.runs:
        for d in args.runs:
            groups.setdefault(load_config(Path(d) / "config.yaml").name, []).append(d)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for seed in args.seeds:
            for variant, (config, overrides) in variants.items():
                run_dir = Path("runs") / f"bench-{variant}-{args.task}-s{seed}-{stamp}"
                subprocess.run([*FLOWRL, "train", config, "--run-dir", str(run_dir), *extra, *overrides,
                                f"name={variant}", f"seed={seed}", f"train.iterations={args.iterations}",
                                "runtime.checkpoint_interval=0"], check=True)
                groups.setdefault(variant, []).append(str(run_dir))
    output = args.output or (f"flowsar_sweep_{args.sweep}_{args.task}" if args.sweep else f"flowsar_ablation_{args.task}")
    # the reference: the default FlowSAR, or in a sweep the config's own value
    reference = f"flowsar-{args.sweep}{getattr(cfg.algo, args.sweep):g}" if args.sweep else "flowsar"
    if reference not in groups:
        reference = next(iter(groups))
    argv = [arg for name, dirs in groups.items() for arg in ("--variant", f"{name}={','.join(dirs)}")]
    argv += ["--reference", reference, "--episodes", str(args.episodes), "--output", output,
             "--note", f"FlowSAR ablation on {args.task}: {args.iterations} iterations of 640 chunk steps per run"]
    if args.ood is not None:
        argv += ["--ood", *args.ood]
    return robot_protocol.main(argv)


if __name__ == "__main__":
    sys.exit(main())
