"""`flowrl-ray`: train, eval, tune, compare, serve, plot, demos, pretrain, import-reinflow, forms, import-edm.

User errors (missing file, bad config, bad run directory) print one line and exit with status 2,
without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import typing
from dataclasses import fields
from pathlib import Path
from typing import Literal

from flowrl_ray.config import (PRETRAIN_SECTIONS, ConfigError, apply_overrides, config_from_dict, load_config,
                               read_yaml)
from flowrl_ray.errors import TrainingError, UserError

EXIT_USER_ERROR = 2
#: env families whose ``<family>.cli`` module adds verbs (``add_verbs(subparsers)``): module -> (its
#: verbs, the extra that installs its packages)
FAMILY_VERBS = {"flowrl_ray.envs.robot": (("demos", "import-reinflow"), "robot"),
                "flowrl_ray.envs.forms": (("forms",), "forms"),
                "flowrl_ray.envs.molecules": (("import-edm", "qm9-pack"), "mol")}


ADDRESS_HELP = ("Ray cluster to use: host:port, ray://host:port, 'auto' (the cluster `ray start` last started "
                "on this machine) or 'local' (a private local Ray). Sets runtime.ray_address, which comes "
                "before $RAY_ADDRESS. Default: runtime.ray_address, else $RAY_ADDRESS, else a private local Ray")


def _default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


# --------------------------------------------------------------------------- verbs

def cmd_train(args: argparse.Namespace) -> int:
    """A new run, or a resumed one: ``--resume RUN`` (RUN's config, or CONFIG, plus overrides),
    or ``--run-dir RUN --resume-if-exists`` (resume RUN when it exists, else start it). A resumed
    run's config may differ from RUN's own only in the keys ``flowrl_ray.resume`` allows."""
    from flowrl_ray.resume import check_resume, checkpoint_iteration
    config_file, overrides = args.config, list(args.overrides)
    if config_file and "=" in config_file:            # `train --resume RUN key=value`: no CONFIG
        config_file, overrides = None, [config_file] + overrides
    if args.resume and args.resume_if_exists:
        raise UserError("give --resume RUN or --run-dir RUN --resume-if-exists, not both")
    if args.resume:
        run_dir = Path(args.resume)
        if args.run_dir and Path(args.run_dir) != run_dir:
            raise UserError(f"--resume {run_dir} continues that run; --run-dir {args.run_dir} names another")
        if not (run_dir / "config.yaml").is_file():
            raise UserError(f"--resume {run_dir}: not a run directory (no config.yaml)")
        resume = True
    elif args.resume_if_exists:
        if not args.run_dir or not config_file:
            raise UserError("--resume-if-exists needs a CONFIG and --run-dir RUN (the run a re-launch resumes)")
        run_dir = Path(args.run_dir)
        resume = (run_dir / "config.yaml").is_file()
        if not resume:
            print(f"[flowrl_ray] {run_dir} holds no run yet: starting it", flush=True)
    else:
        if not config_file:
            raise UserError("train needs a CONFIG file (or --resume RUN_DIR)")
        run_dir = Path(args.run_dir) if args.run_dir else None
        resume = False
    if resume:
        cfg = load_config(config_file or run_dir / "config.yaml", overrides)
        if checkpoint_iteration(run_dir) is None:
            print(f"[flowrl_ray] {run_dir} has no checkpoint yet: starting the run afresh", flush=True)
        else:
            changes = check_resume(load_config(run_dir / "config.yaml"), cfg, run_dir)
            if changes:
                print(f"[flowrl_ray] resuming {run_dir} with " + ", ".join(
                    f"{k} {a} -> {b}" for k, (a, b) in changes.items()), flush=True)
    else:
        cfg = load_config(config_file, overrides)
        run_dir = run_dir or _default_run_dir(cfg.name)
    from flowrl_ray.runtime.trainer import Trainer
    trainer = Trainer(cfg, run_dir, resume=resume, tensorboard=not args.no_tensorboard)
    if args.dry_run:                 # every check has run (config, env spec, preflight): no Ray
        print(_dry_run_summary(cfg, trainer, run_dir, resume), flush=True)
        return 0
    # Ctrl-C / SIGINT stops the run, also when the process was started with SIGINT ignored (a
    # shell's background job, or a parent that ignores it: Python then installs no handler of its
    # own). No checkpoint is written at the interrupt (the learner may be mid-update); a re-launch
    # continues from the last periodic one (runtime.checkpoint_interval)
    import signal
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        trainer.setup()                  # its first line says which Ray the run uses
        print(f"[flowrl_ray] run directory: {run_dir}", flush=True)
        summary = trainer.train()
    finally:
        trainer.close()
    print(f"[flowrl_ray] done: {json.dumps(summary)}", flush=True)
    print(f"[flowrl_ray] learning result on {cfg.env.id}: {_learning_result(summary)}", flush=True)
    print(f"[flowrl_ray] learning curve: {run_dir / 'plots' / 'learning_curve.png'}", flush=True)
    return 0


#: config keys that name a file, a directory or a hub id the run will read
_INPUT_KEYS = ("dataset", "forms_dir", "task_file", "base_policy", "base_model", "sft_checkpoint", "path",
               "tokenizer_path")


def _dry_run_summary(cfg, trainer, run_dir: Path, resume: bool) -> str:
    """What `train` would run: the algorithm, the env and its spec, the batch, the run directory
    and every input the config names (there, missing, or a hub id to download)."""
    import dataclasses

    from flowrl_ray.models.masked_diffusion import looks_like_hub_id
    rt, spec = cfg.runtime, trainer.spec
    lines = ["dry run: nothing started; the config and what it points at are valid",
             f"  algorithm     {cfg.algorithm} ({cfg.name}, seed {cfg.seed})",
             f"  env           {cfg.env.family}/{cfg.env.id}: observations {tuple(spec.obs_shape)}, "
             f"actions {spec.action_dim}",
             f"  iterations    {cfg.train.iterations}, each {rt.num_workers} workers x {rt.envs_per_worker} envs "
             f"x {rt.rollout_length} steps = {rt.num_workers * rt.envs_per_worker * rt.rollout_length}",
             f"  evaluation    every {cfg.eval.interval} iterations, {cfg.eval.episodes} episodes",
             f"  run directory {run_dir} ({'resumed' if resume else 'new'}), checkpoints every "
             f"{rt.checkpoint_interval} iterations"]

    def walk(prefix: str, node) -> None:
        for key, value in (dataclasses.asdict(node) if dataclasses.is_dataclass(node) else node).items():
            name = f"{prefix}.{key}"
            if isinstance(value, dict):
                walk(name, value)
            elif key in _INPUT_KEYS and isinstance(value, str) and value:
                where = ("there" if Path(value).exists() else
                         "a Hugging Face hub id" if key == "path" and looks_like_hub_id(value) else "missing")
                lines.append(f"  input         {name} = {value} ({where})")

    walk("env", cfg.env)
    walk("algo", cfg.algo)
    return "\n".join(lines)


def _learning_result(summary: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    return (f"training episode return {fmt(summary['first_episode_return_mean'])} (first iteration) -> "
            f"{fmt(summary['final_episode_return_mean'])} (last 100 episodes) over {summary['env_steps']:,} env steps "
            f"in {summary['time_s']:.0f}s; deterministic eval {fmt(summary['final_eval_return_mean'])}"
            + (f"; eval success rate {summary['first_eval_success_rate']:.0%} (first eval) -> "
               f"{summary['final_eval_success_rate']:.0%} (last)" if "final_eval_success_rate" in summary else ""))


def cmd_eval(args: argparse.Namespace) -> int:
    import numpy as np

    from flowrl_ray.checkpoint import latest_checkpoint
    from flowrl_ray.runtime.policy import load_policy
    from flowrl_ray.envs import env_family
    from flowrl_ray.envs.rollout import EnvRunner
    from flowrl_ray.progress import CountProgress

    if args.episodes <= 0:
        raise UserError(f"--episodes: must be > 0, got {args.episodes}")
    if not 0 <= args.video <= args.episodes:
        raise UserError(f"--video: must be between 0 and --episodes ({args.episodes}), got {args.video}")
    if _is_group_run(args.run_dir):
        if args.video:
            raise UserError("--video: videos are rendered for robot tasks only")
        return _eval_group(args)
    if args.snapshots:
        raise UserError("--snapshots pictures forms and molecules runs (Flow-GRPO, FED-GRPO); "
                        f"{args.run_dir} is an env-step run")
    cfg, spec, policy = load_policy(args.run_dir)
    family = env_family(cfg.env.family)
    perturbation = None
    if args.perturb:
        from flowrl_ray.envs.robot.perturb import perturbed_config
        try:
            cfg, perturbation = perturbed_config(args.run_dir, cfg, args.perturb)
        except ConfigError as e:
            raise UserError(f"--perturb: {e}") from None
    if args.video:
        if not hasattr(family, "check_video"):
            raise UserError(f"--video: videos are rendered for robot tasks only, not env.family "
                            f"{cfg.env.family!r}")
        family.check_video(cfg.eval.video)
    sampling = "random" if args.stochastic else args.sampling
    # Progress on stderr: stdout carries only the JSON result.
    progress = CountProgress(args.episodes, f"eval {cfg.env.id}", "episodes", stream=sys.stderr)
    runner = EnvRunner(family, cfg.env, 1, cfg.seed, policy, start_group=1)   # evaluate() makes its own envs
    try:
        result = runner.evaluate(args.episodes, deterministic=sampling == "zero",
                                 video_episodes=args.video,
                                 video=(cfg.eval.video.camera, cfg.eval.video.size),
                                 on_episodes=lambda done, total: progress.update(done))
    finally:
        runner.close()
    r = np.array(result["episode_returns"])
    out = {"run_dir": str(args.run_dir), "env": cfg.env.id, "episodes": len(r), "sampling": sampling,
           **({"perturb": perturbation} if perturbation else {}),
           "return_mean": float(r.mean()), "return_std": float(r.std()),
           "length_mean": float(np.mean(result["episode_lengths"]))}
    if "episode_successes" in result:
        out["success_rate"] = float(np.mean(result["episode_successes"]))
    if args.video:
        iteration = int(latest_checkpoint(args.run_dir).stem.split("_")[1])     # iter_000020.pt
        out["videos"] = [str(p) for p in _write_eval_videos(cfg, args.run_dir, iteration,
                                                            result["videos"])]
    print(json.dumps(out))
    return 0


def _write_eval_videos(cfg, run_dir: str, iteration: int, videos: list[dict]) -> list[Path]:
    """RUN/videos/eval/iter_<i>_<k>_<success|failure>.mp4 (beside the training's videos, not over
    them), each also to the run's media sinks at the checkpoint's env step: TensorBoard, and the
    run's own W&B / MLflow runs (tracking.json) when its config has a `logging` section."""
    from flowrl_ray.metrics import read_metrics
    from flowrl_ray.runtime.metrics import MetricsLogger
    from flowrl_ray.runtime.tracking import open_trackers
    from flowrl_ray.video import save_videos, video_caption
    paths = save_videos(videos, Path(run_dir) / "videos" / "eval", iteration)
    step = next((r["env_steps"] for r in read_metrics(run_dir)
                 if r.get("iteration") == iteration and "env_steps" in r), iteration)
    try:
        logger = MetricsLogger(Path(run_dir), cfg.name, tensorboard=True,
                               trackers=open_trackers(cfg, Path(run_dir), resume=True))
        try:
            for path, v in zip(paths, videos):
                logger.log_media(path, step, video_caption(iteration, v))
        finally:
            logger.close()
    except Exception as e:  # noqa: BLE001 - the files are written; a sink must not fail the eval
        print(f"flowrl-ray eval: could not log the videos to the run's media sinks: {e}", file=sys.stderr)
    return paths


def _is_group_run(run_dir: str) -> bool:
    from flowrl_ray.algorithms import get_algorithm
    config = Path(run_dir) / "config.yaml"
    if not config.is_file():
        return False
    return get_algorithm(load_config(config).algorithm).rollout_kind == "group"


def _eval_group(args: argparse.Namespace) -> int:
    """Group algorithms (Flow-GRPO, FED-GRPO): the learner's model generates for the evaluation
    tasks in this process, one local scorer (browser, force field) scores them; prints the
    algorithm's eval metrics. --snapshots N: pictures of the first N samples in RUN_DIR/media/."""
    import torch

    from flowrl_ray.algorithms import get_algorithm
    from flowrl_ray.checkpoint import load_latest
    from flowrl_ray.envs import env_family

    run_dir = Path(args.run_dir)
    found = load_latest(run_dir)                 # the newest whole one (a damaged newer one: named, skipped)
    if found is None:
        raise UserError(f"{run_dir} has no checkpoint yet")
    if not 0 <= args.snapshots <= args.episodes:
        raise UserError(f"--snapshots {args.snapshots}: must be between 0 and --episodes ({args.episodes})")
    cfg = load_config(run_dir / "config.yaml", [f"eval.episodes={args.episodes}",
                                                 f"eval.snapshots.episodes={args.snapshots}"])
    family = env_family(cfg.env.family)
    spec = family.spec(cfg.env)
    algo = get_algorithm(cfg.algorithm)(cfg, spec, torch.device("cpu"))
    path, payload = found
    algo.load_state_dict(payload["learner"]["algorithm"])
    scorer = family.make_scorer(cfg.env, cfg.seed, 0)
    n = args.snapshots
    try:
        batches = [scorer.score(chunk, snapshots=n) if n else scorer.score(chunk) for chunk in algo.generate(1, "eval")]
    finally:
        scorer.close()
    metrics = algo.eval_metrics(batches)
    pictures = []
    if n:
        items = [item for b in batches for item in b.meta.extra.get("snapshots", [])]
        pictures = [str(p) for p, _ in family.save_snapshots(items, run_dir / "media", f"eval_{path.stem}")]
    print(json.dumps({"run_dir": str(run_dir), "checkpoint": path.name, **metrics,
                      **({"snapshots": pictures} if n else {})}))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from flowrl_ray.runtime.tune import parse_search_space, run_sweep
    cfg = load_config(args.config, args.overrides)       # validates before Ray starts
    space = parse_search_space(args.grid, args.choice, args.uniform, args.loguniform, base=cfg)
    out_dir = Path(args.out_dir) if args.out_dir else _default_run_dir(f"tune-{cfg.name}")
    result = run_sweep(args.config, args.overrides, space, seeds=args.seeds, num_samples=args.num_samples,
                       out_dir=out_dir, metric=args.metric, mode=args.mode,
                       max_concurrent=args.max_concurrent)
    print(json.dumps(result, indent=2))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from flowrl_ray.runtime.compare import run_comparison
    items = list(args.items) + list(getattr(args, "overrides", []))
    configs = [x for x in items if "=" not in x]
    overrides = [x for x in items if "=" in x]
    if not configs:
        raise UserError("compare needs at least one CONFIG file")
    out_dir = Path(args.out_dir) if args.out_dir else _default_run_dir("compare")
    run_comparison(configs, overrides, args.seeds, out_dir)
    print(f"[flowrl_ray] comparison: {out_dir / 'comparison.md'} and {out_dir / 'comparison.png'}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from flowrl_ray.runtime.serve import serve_policy
    serve_policy(args.run_dir, host=args.host, port=args.port, block=True, address=args.address)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from flowrl_ray.plotting import plot_runs
    for d in args.run_dirs:
        if not (Path(d) / "metrics.jsonl").is_file():
            raise UserError(f"{d}: no metrics.jsonl (not a run directory?)")
    out = args.out or str(Path(args.run_dirs[0]) / "plots" / f"{args.y.replace('/', '_')}.png")
    try:
        path = plot_runs(args.run_dirs, out, x=args.x, y=args.y, title=args.title)
    except ValueError as e:
        raise UserError(str(e)) from None
    print(path)
    return 0


#: `flowrl-ray pretrain` flags: each sets the key of the same name in the config's typed
#: `pretrain:` section (flowrl_ray.config), whose schema the algorithm chooses
#: who reads a pretraining section, as the flags' help names them
PRETRAIN_LABELS = {"flow_bc": "robot", "text_sft": "language model", "edm_qm9": "EDM"}


def pretrain_flags() -> dict[str, list]:
    """Every key of the built-in pretraining sections -> [(section class, its field, its type)],
    in the order the sections declare them: `flowrl-ray pretrain` takes each as --key-name."""
    flags: dict[str, list] = {}
    for section in PRETRAIN_SECTIONS:
        hints = typing.get_type_hints(section)
        for f in fields(section):
            flags.setdefault(f.name, []).append((section, f, hints[f.name]))
    return flags


def add_pretrain_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per pretraining key, its type, choices and help from the sections' fields."""
    for name, owners in pretrain_flags().items():
        hint = owners[0][2]                                   # Optional[X] -> X
        tp = hint if typing.get_origin(hint) is Literal else \
            next(a for a in (typing.get_args(hint) or (hint,)) if a is not type(None))
        if tp is bool:
            kwargs = {"action": "store_true", "default": None}
        elif typing.get_origin(tp) is Literal:
            kwargs = {"choices": list(typing.get_args(tp))}
        else:
            kwargs = {"type": tp}
        texts = [f.metadata.get("help", "") + ("" if f.default is None or tp is bool else f"; default {f.default}")
                 for _, f, _ in owners]
        labels = [PRETRAIN_LABELS.get(section.method, section.method) for section, _, _ in owners]
        text = texts[0] if len(set(texts)) == 1 and len(owners) == len(PRETRAIN_SECTIONS) else \
            " | ".join(f"{label}: {t}" for label, t in zip(labels, texts))      # what each section means by it
        parser.add_argument("--" + name.replace("_", "-"), help=text, **kwargs)


def cmd_pretrain(args: argparse.Namespace) -> int:
    """The config's `pretrain:` section, with the flags given on top, run by flowrl_ray.pretrain."""
    from flowrl_ray.algorithms import get_algorithm
    from flowrl_ray.pretrain import pretrain
    data = apply_overrides(read_yaml(args.config), args.overrides)
    name = data.get("algorithm", "ppo")
    schema = get_algorithm(name).pretrain_config_class
    if schema is None:
        raise UserError(f"{args.config}: algorithm {name!r} has no pretraining (flowrl-ray pretrain starts "
                        f"fpopp, reinflow, flowsar, flow_grpo and fed_grpo)")
    keys = [f.name for f in fields(schema)]
    section = dict(data.get("pretrain") or {})
    for flag in pretrain_flags():
        value = getattr(args, flag)
        if value is None:
            continue
        if flag not in keys:
            raise UserError(f"--{flag.replace('_', '-')}: {name}'s pretraining ({schema.method}) has no "
                            f"such setting; it takes " + ", ".join(f"--{k.replace('_', '-')}" for k in keys))
        section[flag] = value
    data["pretrain"] = section
    cfg = config_from_dict(data)
    print(json.dumps(pretrain(cfg, progress=True)), flush=True)
    return 0


# --------------------------------------------------------------------------- parser

def _add_train(sub) -> None:

    t = sub.add_parser("train", help="train a policy on a local or existing Ray cluster",
                       description="Train with the algorithm and env a config names. Starts a private local "
                                   "Ray unless --address, runtime.ray_address or RAY_ADDRESS names a "
                                   "cluster. Writes runs/<name>-<time>/: "
                                   "config.yaml, metrics.jsonl, tensorboard/, checkpoints/, plots/, summary.json.")
    t.add_argument("config", nargs="?", help="YAML config (configs/<algorithm>/<task>.yaml)")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.iterations=20")
    t.add_argument("--run-dir", help="run directory (default runs/<name>-<timestamp>)")
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its latest checkpoint, with its own config (or CONFIG, which must "
                        "resolve to it) and overrides; a resume may change train.iterations (schedules go on "
                        "from where they stand), eval.*, logging.* and runtime resources, nothing else")
    t.add_argument("--resume-if-exists", action="store_true",
                   help="with --run-dir RUN: resume RUN when it exists (same config rule as --resume), else "
                        "start it; the same command starts a run and re-launches it after a preemption")
    t.add_argument("--no-tensorboard", action="store_true", help="skip TensorBoard event files")
    t.add_argument("--dry-run", action="store_true",
                   help="check the config and everything it points at, print what would run, start nothing")
    t.add_argument("--address", help=ADDRESS_HELP)
    t.set_defaults(func=cmd_train)


def _add_eval(sub) -> None:
    e = sub.add_parser("eval", help="evaluate a run's latest checkpoint",
                       description="Run episodes with the latest checkpoint's policy (deterministic by "
                                   "default) and print return statistics (and success rate, for robot "
                                   "tasks) as JSON on stdout; progress lines go to stderr.")
    e.add_argument("run_dir")
    e.add_argument("--episodes", type=int, default=10)
    e.add_argument("--sampling", choices=["zero", "random"], default="zero",
                   help="zero: deterministic (a Gaussian's mean; a flow integrated from eps = 0); "
                        "random: sample as in training")
    e.add_argument("--stochastic", action="store_true", help="same as --sampling random")
    e.add_argument("--snapshots", type=int, default=0, metavar="N",
                   help="forms and molecules runs: pictures of the first N evaluation samples in RUN_DIR/media/ "
                        "(page screenshots with the reward; a grid of molecules)")
    e.add_argument("--perturb", action="append", metavar="SET|KEY=VALUE",
                   help="robot tasks: evaluate in a perturbed scene, one set of the OOD suite (placement, "
                        "object_size, friction, action_noise, camera, lighting) or env.perturb keys "
                        "(placement_scale=2, action_noise_std=0.05, ...; repeatable)")
    e.add_argument("--video", type=int, default=0, metavar="N",
                   help="robot tasks: render the first N episodes (camera and size from the run's "
                        "eval.video) to RUN_DIR/videos/eval/iter_<checkpoint iteration>_<k>_"
                        "<success|failure>.mp4")
    e.set_defaults(func=cmd_eval)


def _add_tune(sub) -> None:
    tu = sub.add_parser("tune", help="hyperparameter sweep with Ray Tune",
                        description="Sweep config keys (grid or random) over several seeds. Each trial is a "
                                    "full Trainer inside its own placement group. Writes results.csv and "
                                    "best_config.yaml to the output directory.")
    tu.add_argument("config")
    tu.add_argument("overrides", nargs="*", help="fixed key.sub=value overrides for every trial")
    tu.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                    help="grid over values, e.g. --grid algo.lr=1e-3,3e-4")
    tu.add_argument("--choice", action="append", default=[], metavar="KEY=V1,V2", help="random choice")
    tu.add_argument("--uniform", action="append", default=[], metavar="KEY=LO,HI", help="uniform sample")
    tu.add_argument("--loguniform", action="append", default=[], metavar="KEY=LO,HI", help="log-uniform sample")
    tu.add_argument("--seeds", type=int, default=1, help="seeds per configuration (seed, seed+1, ...)")
    tu.add_argument("--num-samples", type=int, default=1, help="random samples (repeats of the grid)")
    tu.add_argument("--metric", default="episode_return_mean")
    tu.add_argument("--mode", choices=["max", "min"], default="max")
    tu.add_argument("--max-concurrent", type=int, default=0, help="0: as many as resources allow")
    tu.add_argument("--out-dir", help="where results go (default runs/tune-<name>-<timestamp>)")
    tu.add_argument("--address", help=ADDRESS_HELP)
    tu.set_defaults(func=cmd_tune)


def _add_compare(sub) -> None:
    c = sub.add_parser("compare", help="run several configs with the same seeds; table + plot",
                       description="Run every CONFIG with the same N seeds (seed, seed+1, ...) on one Ray, then "
                                   "write comparison.md/.csv (final return mean ± std, area under the learning "
                                   "curve, env steps, wall-clock) and comparison.png (mean ± std bands). "
                                   "key=value overrides apply to every config.")
    c.add_argument("items", nargs="+", metavar="CONFIG_OR_OVERRIDE", help="CONFIG files and key=value overrides")
    c.add_argument("--seeds", type=int, default=3)
    c.add_argument("--out-dir", help="default runs/compare-<timestamp>")
    c.add_argument("--address", help=ADDRESS_HELP)
    c.set_defaults(func=cmd_compare)


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="serve a trained policy over HTTP with Ray Serve",
                       description="Deploy the run's latest checkpoint with Ray Serve. POST /act with "
                                   '{"observation": [...]} returns {"action": [...]}; GET /healthz answers.')
    s.add_argument("run_dir")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--address", help=ADDRESS_HELP)
    s.set_defaults(func=cmd_serve)


def _add_plot(sub) -> None:
    pl = sub.add_parser("plot", help="draw learning curves (PNG) of one or more runs",
                        description="Overlay runs; runs of the same config name (seeds) become mean +- std bands.")
    pl.add_argument("run_dirs", nargs="+")
    pl.add_argument("--x", default="env_steps")
    pl.add_argument("--y", default="episode_return_mean")
    pl.add_argument("--title")
    pl.add_argument("--out", help="PNG path (default RUN_DIR/plots/<y>.png)")
    pl.set_defaults(func=cmd_plot)


def _add_pretrain(sub) -> None:
    pr = sub.add_parser("pretrain", help="supervised start of a policy: flow-matching BC from robot demos, "
                                         "masked-diffusion SFT of a Flow-GRPO language model, or EDM on QM9",
                        description="Runs the pretraining of the config's algorithm with the settings of its "
                                    "`pretrain:` section (defaults in flowrl_ray/config/schema.py); each flag sets "
                                    "the key of the same name. Robot configs (fpopp, reinflow, flowsar): "
                                    "flow-matching behaviour cloning of the config's flow policy on a "
                                    "robomimic dataset (env.dataset or --dataset); writes the checkpoint that "
                                    "algo.base_policy loads (--out or algo.base_policy), <stem>.metrics.jsonl "
                                    "and <stem>.loss.png. Flow-GRPO configs: masked-diffusion SFT on the forms "
                                    "train split (prompt -> gold action script), written to "
                                    "algo.sft_checkpoint (or --out). FED-GRPO configs: EDM training on QM9 "
                                    "(the train split), written to algo.base_model (or --out). Prints a JSON "
                                    "summary.")
    pr.add_argument("config")
    pr.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. algo.hidden_sizes=[256,256] "
                    "or pretrain.epochs=20")
    add_pretrain_flags(pr)
    pr.set_defaults(func=cmd_pretrain)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowrl-ray", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    _add_train(sub)
    _add_eval(sub)
    _add_tune(sub)
    _add_compare(sub)
    _add_serve(sub)
    _add_plot(sub)
    _add_pretrain(sub)
    for family, (verbs, extra) in FAMILY_VERBS.items():   # each env family's own verbs
        try:
            importlib.import_module(f"{family}.cli").add_verbs(sub)
        except ImportError as e:          # its packages are not installed: the other verbs still work
            for verb in verbs:
                m = sub.add_parser(verb, add_help=False, help=f"(unavailable: {e})",
                                   prefix_chars="\0")    # every argument, options included, is `rest`
                m.add_argument("rest", nargs=argparse.REMAINDER)
                m.set_defaults(func=_missing_family(family, extra, e))
    return p


def _missing_family(family: str, extra: str, error: ImportError):
    """A verb of an env family whose packages are missing: one line naming the import that failed."""
    def run(args: argparse.Namespace) -> int:
        raise UserError(f"{family} cannot be imported ({error}); install its packages: "
                        f"pip install -e '.[{extra}]'")
    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come after options (`train CFG --run-dir D a.b=1`): collect stray key=value.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    if getattr(args, "address", None) and args.verb != "serve":   # the last override wins
        args.overrides = list(getattr(args, "overrides", [])) + [f"runtime.ray_address={args.address}"]
    try:
        return args.func(args)
    except (ConfigError, UserError, FileNotFoundError) as e:
        print(f"flowrl-ray {args.verb}: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except TrainingError as e:
        print(f"flowrl-ray {args.verb}: failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"flowrl-ray {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
