"""The robot family's command-line verbs: ``flowrl-ray demos`` (scripted-expert demonstrations in
robomimic's hdf5 layout) and ``flowrl-ray import-reinflow`` (a ReinFlow / ReFlow pretrained flow
policy -> a base policy). :func:`add_verbs` is what ``flowrl_ray.cli`` calls."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flowrl_ray.errors import UserError


def cmd_demos(args: argparse.Namespace) -> int:
    from flowrl_ray.envs.robot import CAMERAS, TASKS
    task = args.task.lower()
    names = {t.name: t.name for t in TASKS.values()} | {t.env_name.lower(): t.name for t in TASKS.values()}
    if task not in names:
        raise UserError(f"unknown task {args.task!r}; choose one of {', '.join(TASKS)}")
    bad = [c for c in args.cameras if c not in CAMERAS]
    if bad:
        raise UserError(f"--cameras: unknown camera(s) {bad}; choose from {', '.join(CAMERAS)}")
    for name, value in (("episodes", args.episodes), ("image-size", args.image_size)):
        if value <= 0:
            raise UserError(f"--{name}: must be > 0, got {value}")
    from flowrl_ray.envs.robot.experts import collect_demos
    out = Path(args.out) if args.out else Path("demos") / f"{names[task]}.hdf5"
    stats = collect_demos(names[task], args.episodes, out, seed=args.seed, noise=args.noise,
                          cameras=tuple(args.cameras), image_size=args.image_size,
                          max_attempts=args.max_attempts, progress=True)
    print(json.dumps({"task": stats.task, "demos": stats.successes, "attempts": stats.attempts,
                      "success_rate": round(stats.success_rate, 4), "steps": stats.steps,
                      "seconds": round(stats.seconds, 1), "out": str(out)}), flush=True)
    if stats.successes == 0:
        print(f"flowrl-ray demos: failed: the {stats.task} expert solved none of {stats.attempts} "
              f"attempts", file=sys.stderr)
        return 1
    return 0


def cmd_import_reinflow(args: argparse.Namespace) -> int:
    """A ReinFlow / ReFlow pretraining checkpoint -> a flowrl-ray base policy (and, with --task,
    the statistics file the robot env normalises with)."""
    import io

    import torch

    from flowrl_ray.envs.robot.import_reinflow import (config_overrides, import_reinflow_checkpoint,
                                                       write_norm_dataset)
    from flowrl_ray.utils import atomic_write_bytes
    if args.flow_steps <= 0:
        raise UserError(f"--flow-steps: must be > 0, got {args.flow_steps}")
    if args.norm_out is not None and args.task is None:
        raise UserError("--norm-out: the statistics file names its task; give --task too")
    ckpt = import_reinflow_checkpoint(args.checkpoint, args.normalization, use_ema=args.ema,
                                      activation=args.activation, flow_steps=args.flow_steps)
    out = Path(args.out)
    norm_out = None
    if args.task is not None:
        norm_out = Path(args.norm_out) if args.norm_out else out.with_name(f"{out.stem}.norm.hdf5")
        write_norm_dataset(ckpt, args.task, norm_out)
        ckpt["dataset"] = str(norm_out)
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    atomic_write_bytes(out, buf.getvalue())
    summary = {"out": str(out), "weights": ckpt["source"]["weights"], "epoch": ckpt["source"]["epoch"],
               "arch": ckpt["arch"], "sampler": ckpt["sampler"],
               "parameters": sum(v.numel() for v in ckpt["policy"].values()),
               "norm_dataset": None if norm_out is None else str(norm_out),
               "overrides": config_overrides(ckpt, out, norm_out)}
    print(json.dumps(summary), flush=True)
    return 0


def add_verbs(sub) -> None:
    """Adds ``demos`` and ``import-reinflow`` to the ``flowrl-ray`` subparsers ``sub``."""
    d = sub.add_parser("demos", help="collect scripted-expert demonstrations (robomimic hdf5)",
                       description="Run the scripted expert of a robot task until N successful episodes "
                                   "(failed attempts are dropped) and write them in robomimic's hdf5 layout "
                                   "with normalisation statistics. Prints one JSON line: task, demos, attempts, "
                                   "success_rate, steps, seconds, out.")
    d.add_argument("task", help="lift | can | square")
    d.add_argument("--episodes", type=int, required=True, help="successful demos to collect")
    d.add_argument("--out", help="hdf5 path (default demos/<task>.hdf5)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--noise", type=float, default=0.1, help="Gaussian noise on the arm actions")
    d.add_argument("--cameras", nargs="+", default=[], metavar="CAM",
                   help="also record <CAM>_image, e.g. agentview robot0_eye_in_hand")
    d.add_argument("--image-size", type=int, default=84)
    d.add_argument("--max-attempts", type=int, help="give up after this many episodes (default 4 x N)")
    d.set_defaults(func=cmd_demos)

    ir = sub.add_parser("import-reinflow", help="turn a ReinFlow / ReFlow pretrained flow policy into a base policy",
                        description="Convert a checkpoint written by the ReinFlow release's ReFlow pretraining "
                                    "(state_N.pt / best.pt / last.pt: {'model', 'ema', ...}, a FlowMLP under "
                                    "'network.') and its normalization.npz into the checkpoint algo.base_policy "
                                    "loads: the velocity network's weights mapped to this package's names, the "
                                    "architecture (hidden sizes, time dim, chunk, residual or plain MLP, the "
                                    "release's time embedding and activation) and the statistics. With --task, "
                                    "also write a statistics-only robomimic hdf5 for env.dataset, so the robot "
                                    "env normalises as the release did. Prints a JSON summary with the config "
                                    "overrides that fine-tune the base with the release's network and sampler. "
                                    "See docs/import_reinflow.md.")
    ir.add_argument("checkpoint", help="the release's pretraining checkpoint (.pt)")
    ir.add_argument("--normalization", required=True, metavar="NPZ",
                    help="the release's normalization.npz (obs_min, obs_max, action_min, action_max)")
    ir.add_argument("--out", required=True, help="the flowrl-ray checkpoint to write, e.g. pretrained/can_reflow.pt")
    ir.add_argument("--ema", action="store_true",
                    help="take the EMA weights (what the release evaluates and fine-tunes from) instead of "
                         "the raw ones")
    ir.add_argument("--activation", help="the FlowMLP's activation_type, e.g. ReLU or Mish (default: read from "
                    "<run>/.hydra/config.yaml beside the checkpoint's folder)")
    ir.add_argument("--task", help="lift | can | square: also write the statistics file for env.dataset")
    ir.add_argument("--norm-out", help="the statistics file's path (default <out stem>.norm.hdf5)")
    ir.add_argument("--flow-steps", type=int, default=4,
                    help="the Euler steps the overrides suggest (default 4, the release's state-policy fine-tuning)")
    ir.set_defaults(func=cmd_import_reinflow)
