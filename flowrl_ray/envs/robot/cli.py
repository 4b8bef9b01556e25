"""The robot family's command-line verb: ``flowrl-ray demos`` (scripted-expert demonstrations in
robomimic's hdf5 layout). :func:`add_verbs` is what ``flowrl_ray.cli`` calls."""

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


def add_verbs(sub) -> None:
    """Adds ``demos`` to the ``flowrl-ray`` subparsers ``sub``."""
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
