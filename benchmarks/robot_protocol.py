"""The robot evaluation protocol: several training seeds per variant, every final policy and the
base evaluated in one process on the same seeded episodes, the gain over the base with a 95 %
paired bootstrap confidence interval, and curves as mean +- std over seeds.

Run from the repository root:

    # launch the runs (sequentially, or N at a time), then evaluate them with the base
    .venv/bin/python benchmarks/robot_protocol.py --config configs/fpopp/lift_state_quickstart.yaml \\
        --seeds 0 1 2 --output protocol_lift_quickstart
    .venv/bin/python benchmarks/robot_protocol.py --config CONFIG --seeds 0 1 2 --parallel 2 algo.n_mc=16
    # evaluate finished `flowrl-ray train` runs, grouped into variants
    .venv/bin/python benchmarks/robot_protocol.py --variant per_sample=runs/a0,runs/a1,runs/a2 \\
        --variant averaged=runs/b0,runs/b1,runs/b2 --output protocol_lift_ratio
    .venv/bin/python benchmarks/robot_protocol.py --runs runs/x-* runs/y-*     # variant = config `name`
    # an ablation: every variant's difference from one of them, paired by episode
    .venv/bin/python benchmarks/robot_protocol.py --variant per_sample=... --variant averaged=... \\
        --reference per_sample --output protocol_lift_ratio

Launched runs are `flowrl-ray train CONFIG --run-dir runs/protocol-<variant>-s<seed>-<time>
seed=<seed> [overrides]`, one private local Ray each; the demos (``env.dataset``) and the base
(``algo.base_policy``) are made first when missing (``--demos``, ``--pretrain-epochs``). On 2
cores, a robosuite rollout worker with 8 envs holds about 3.7 GB: ``--parallel 2`` runs two
trainings side by side, each then slower; their output goes to ``<runs-dir>/logs/<run>.log``,
with each run's last line printed here every minute.

Evaluation: the base (``--base``, default the runs' ``algo.base_policy``) and every run's last
checkpoint, on ``--episodes`` (100) seeded episodes per sampling rule: zero-sampling (eps = 0,
FPO++'s test-time rule) and random sampling (eps ~ N(0, I), what training uses). The episodes
are fixed by the evaluation seed (12345) and env count (8): episode (env i, k-th on env i) has
the same initial state for every policy, which pairs them. Variants whose env sections or flow
steps differ are compared with the base evaluated under their own settings.

Reported (``<results-dir>/<output>.{json,md}``, ``<output>_train.png``, ``<output>_eval.png``):
success per seed, the mean gain over the base with a 95 % bootstrap CI paired by episode
(:func:`flowrl_ray.stats.paired_bootstrap_gain`), training success (last 100 training episodes,
random sampling) and periodic-eval success vs env steps as the mean over seeds with a band of
+- one standard deviation across seeds, chunks, env steps and wall-clock per run, the machine. A
chunk is one policy step, up to ``env.act_steps`` env steps (20 Hz robosuite steps). With
``--reference NAME`` also each other variant's difference from that one: the mean over its seeds
minus the mean over the reference's seeds, with the same episode-paired bootstrap CI (the
reference's per-episode mean success takes the base's place). Variants with another env section
(other episodes; training-only keys such as ``env.start_group`` aside) are listed as not
compared; another base setting (base policy, algorithm, flow steps) is compared and marked,
since the final policies meet the same episodes. Per run also the
learner's and the rollouts' seconds per iteration, and the training curve against wall-clock
(``<output>_train_wallclock.png``) and against env steps on a log axis beside DPPO's published
final success at its release's budget, for the state tasks it reports
(``<output>_train_env_steps.png``, and the periodic evaluation's ``<output>_eval_env_steps.png``; runs that
counted chunks as env steps have no such curves).

Out of distribution (``--ood [NAME ...]``; no names: every set of the suite the task and
observation mode can take, :mod:`flowrl_ray.envs.robot.perturb`): the base and every policy again
on the same seeded episodes in each perturbed scene (wider object placement, a larger object, a
slippery table, action noise; camera pose and lighting for image policies), each policy's gain
over the base in the same scene and, with ``--reference``, the difference from the reference
there. Each set costs as much evaluation time as the in-distribution one.

A variant evaluated earlier (``--earlier NAME=RESULTS.json:VARIANT``, e.g. a committed ablation's
default, whose run directories are gone): its per-episode outcomes are read from that protocol's
results file and stand beside this process's policies, as a reference too, only when the base
evaluated here has the same setting and the same outcomes as the file's base, episode by episode
and rule by rule: the check that both processes met the same episodes (weak where the base
succeeds in every episode), and, where the file records it, the same base weights (a sha256 of
the loaded policy's tensors, ``weights_sha256``). Otherwise it is left out, with the number of episodes that differ
printed and written to the results, and whether the base weights were the same: evaluations by
random sampling in two processes can part in a few envs' streams, so a file's variant is no
substitute for evaluating beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, command_line, git_revision, machine_info, md_table, write_json, write_results  # noqa: E402
from _robot import (EVAL_ENVS, EVAL_SEED, FLOWRL, PUBLISHED_STATE, SAMPLING_RULES, base_policy,  # noqa: E402
                    ensure_demos_and_base, evaluate_episodes, make_eval_runner, run_config, run_summary,
                    weights_digest)

MIN_SEEDS = 3
LEVEL = 0.95


class UsageError(Exception):
    """A bad flag or run directory: one line, exit status 2, before anything runs."""


def log(msg: str) -> None:
    print(f"[protocol] {msg}", flush=True)


# --------------------------------------------------------------------------- arguments

def parse_variant(text: str) -> tuple[str, list[Path]]:
    """``NAME=RUN,RUN,...`` -> (NAME, run dirs)."""
    name, sep, runs = text.partition("=")
    dirs = [Path(r) for r in runs.split(",") if r.strip()]
    if not sep or not name.strip() or not dirs:
        raise UsageError(f"--variant {text!r}: expected NAME=RUN_DIR[,RUN_DIR...]")
    return name.strip(), dirs


def check_launch_args(args) -> None:
    """The checks of the flags every protocol shares (--config, --seeds, --name, overrides,
    --parallel, --n-boot); raises :class:`UsageError` naming the flag."""
    if args.config is None and (args.seeds or args.overrides or args.name):
        raise UsageError("--seeds, --name and config overrides need --config")
    if args.config is not None and not args.seeds:
        raise UsageError("--config needs --seeds (e.g. --seeds 0 1 2)")
    if args.seeds and len(set(args.seeds)) != len(args.seeds):
        raise UsageError(f"--seeds: repeated seed in {args.seeds}")
    for o in args.overrides:
        if o.split("=", 1)[0] in ("seed", "name"):
            raise UsageError(f"override {o!r}: the runs' seed and name come from --seeds and --name")
    if args.parallel < 1:
        raise UsageError(f"--parallel must be >= 1, got {args.parallel}")
    if args.n_boot < 1:
        raise UsageError(f"--n-boot must be >= 1, got {args.n_boot}")


def check_run_dir(flag: str, run_dir: Path) -> None:
    from flowrl_ray.checkpoint import latest_checkpoint
    if not (run_dir / "config.yaml").is_file():
        raise UsageError(f"{flag}: {run_dir} is not a run directory (no config.yaml)")
    if latest_checkpoint(run_dir) is None:
        raise UsageError(f"{flag}: {run_dir} has no checkpoint (its policy cannot be evaluated)")


def load_earlier(text: str, episodes: int, rules: tuple[str, ...]) -> tuple[str, dict]:
    """``NAME=RESULTS.json:VARIANT`` -> (NAME, the variant as that protocol run recorded it: its
    base setting and outcomes, its runs with their per-episode outcomes); raises UsageError."""
    name, sep, rest = text.partition("=")
    path, colon, variant = rest.rpartition(":")
    if not sep or not name.strip() or not colon or not path or not variant:
        raise UsageError(f"--earlier {text!r}: expected NAME=RESULTS.json:VARIANT")
    name, flag = name.strip(), f"--earlier {name.strip()}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{flag}: cannot read {path} as JSON ({e.__class__.__name__})") from None
    if not isinstance(data, dict) or not {"protocol", "bases", "variants"} <= set(data):
        raise UsageError(f"{flag}: {path} is not a robot protocol results file")
    if variant not in data["variants"]:
        raise UsageError(f"{flag}: no variant {variant!r} in {path} (variants: {', '.join(data['variants'])})")
    p = data["protocol"]
    want = {"episodes": episodes, "eval_seed": EVAL_SEED, "eval_envs": EVAL_ENVS}
    got = {k: p.get(k) for k in want}
    if got != want:
        raise UsageError(f"{flag}: {path} was evaluated on other episodes ({got}; here {want})")
    missing = [s for s in rules if s not in p.get("sampling", [])]
    if missing:
        raise UsageError(f"{flag}: {path} has no {'/'.join(missing)} sampling outcomes")
    v = data["variants"][variant]
    runs = [{**{k: x for k, x in r.items() if k not in ("outcomes", "ood")},
             "outcomes": {s: r["outcomes"][s] for s in rules}} for r in v["runs"]]
    return name, {"file": path, "variant": variant, "revision": data.get("revision"),
                  "base_setting": json.loads(v["base"]),
                  "base_weights": data["bases"][v["base"]].get("weights_sha256"),
                  "base_outcomes": {s: data["bases"][v["base"]]["outcomes"][s] for s in rules}, "runs": runs}


def attach_earlier(bases: dict, evaluated: dict, earlier: dict[str, dict]) -> tuple[dict, list[str]]:
    """Each earlier variant whose base setting matches a base evaluated here with the same
    outcomes, episode by episode under every rule, and (where both record them) the same base
    weights joins the variants (first, in the given order); -> (the variants, a line for each one
    left out and why)."""
    joined, left_out = {}, []
    for name, e in earlier.items():
        bid = next((b for b in bases if json.loads(b) == e["base_setting"]), None)
        if bid is None:
            left_out.append(f"{name} ({e['file']}:{e['variant']}): its base setting is not one evaluated here")
            continue
        differ = {s: sum(a != b for a, b in zip(bases[bid]["outcomes"][s]["successes"], o["successes"]))
                  for s, o in e["base_outcomes"].items()}
        here, there = bases[bid].get("weights_sha256"), e.get("base_weights")
        weights = ("the file records no base weights" if not (here and there) else
                   "the base weights are the same" if here == there else
                   f"the base weights differ ({here} here, {there} in the file)")
        if any(differ.values()) or (here and there and here != there):
            n = len(next(iter(e["base_outcomes"].values()))["successes"])
            outcomes = ("the base's outcomes here differ from the file's in "
                        + ", ".join(f"{d} of {n} episodes ({s})" for s, d in differ.items() if d)
                        if any(differ.values()) else "the base's outcomes are the same")
            left_out.append(f"{name} ({e['file']}:{e['variant']}): {outcomes}; {weights}")
            continue
        joined[name] = {"base": bid, "runs": e["runs"],
                        "earlier": {"file": e["file"], "variant": e["variant"], "revision": e["revision"]}}
    return {**joined, **evaluated}, left_out


# env keys the evaluation does not read: its envs are never grouped (make_eval_runner), so runs
# trained with start groups meet the same seeded episodes as runs trained without
TRAINING_ONLY_ENV_KEYS = ("start_group",)


def sampler_settings(cfg) -> dict:
    """The algo keys, beyond the algorithm and its flow steps, that change how the evaluation
    samples from a base's weights: under πRL's Flow-SDE (`noise: sde`) ReinFlow's chain follows
    the SDE's mean drift at level `sde_level`, without the clip of the intermediate means. Empty
    for every other setting, so their base ids are those written before this key existed."""
    if getattr(cfg.algo, "noise", None) == "sde":
        return {"noise": "sde", "sde_level": cfg.algo.sde_level}
    return {}


def base_id(cfg, base_path: str) -> str:
    """What makes two base evaluations the same: the weights, the env section as the evaluation
    reads it (task, chunking, observations; not :data:`TRAINING_ONLY_ENV_KEYS`), the algorithm
    (its policy's sampler: FPO++'s Euler steps, ReinFlow's mean chain), the sampler's flow
    steps and :func:`sampler_settings`."""
    env = {k: v for k, v in dataclasses.asdict(cfg.env).items() if k not in TRAINING_ONLY_ENV_KEYS}
    return json.dumps({"base": str(base_path), "env": env, "algorithm": cfg.algorithm,
                       "flow_steps": cfg.algo.flow_steps, **sampler_settings(cfg)}, sort_keys=True, default=str)


def collect_variants(args) -> dict[str, list[Path]]:
    """Variant name -> finished run dirs, from --variant and --runs (checked, not yet loaded)."""
    variants: dict[str, list[Path]] = {}
    for text in args.variant or []:
        name, dirs = parse_variant(text)
        if name in variants:
            raise UsageError(f"--variant {name}: given twice")
        for d in dirs:
            check_run_dir(f"--variant {name}", d)
        variants[name] = dirs
    for d in map(Path, getattr(args, "runs", None) or []):
        check_run_dir("--runs", d)
        variants.setdefault(run_config(d).name, []).append(d)
    return variants


def add_shared_arguments(p: argparse.ArgumentParser, output: str) -> None:
    """The flags of the protocols that evaluate one base against its fine-tuned runs (forms,
    molecules): finished runs (--variant) or runs to launch (--config --seeds [--name])."""
    p.add_argument("--variant", action="append", metavar="NAME=RUN,RUN,...",
                   help="finished run directories of one variant (repeatable)")
    p.add_argument("--config", help="launch one run of CONFIG per --seeds value, then evaluate them")
    p.add_argument("--seeds", nargs="+", type=int, help="with --config: the seeds (>= 3 for a result)")
    p.add_argument("--name", help="with --config: the variant's name (default: the config's name)")
    p.add_argument("--parallel", type=int, default=1, help="with --config: runs trained at a time")
    p.add_argument("--runs-dir", default="runs", help="with --config: where the run directories go")
    p.add_argument("--n-boot", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument("--output", default=output, help="results name: <results-dir>/<output>.{json,md,...}")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--note", help="a line printed with the results (e.g. 'smoke run: 2 iterations')")
    p.add_argument("overrides", nargs="*", help="with --config: config overrides (key.sub=value) for every run")


def collect_one_base(args, algorithm: str, protocol: str, base_key: str, base_exists) -> tuple[dict, object, str]:
    """(variant name -> finished run dirs, the config to launch or None, its variant name) for a
    protocol of one ``algorithm`` whose runs share one base (the config key ``base_key``, which
    ``base_exists(path)`` checks) and one env section. Raises UsageError / ConfigError."""
    from flowrl_ray.config import load_config
    if not (args.config or args.variant):
        raise UsageError("nothing to evaluate: give --config CONFIG --seeds ... or --variant NAME=RUN,...")
    variants = collect_variants(args)
    cfg = name = None
    if args.config is not None:
        cfg = load_config(args.config, [*args.overrides, f"seed={args.seeds[0]}"])   # bad keys stop here
        name = args.name or cfg.name
        if name in variants:
            raise UsageError(f"--name {name}: also the name of a --variant")
    checked = [run_config(d) for dirs in variants.values() for d in dirs] + ([cfg] if cfg else [])
    section, key = base_key.split(".")
    for c in checked:
        if c.algorithm != algorithm:
            raise UsageError(f"a {c.algorithm} run or config: the {protocol} protocol is for {algorithm}")
        path = getattr(getattr(c, section), key)
        if not path or not base_exists(Path(path)):
            raise UsageError(f"{base_key} {path!r} does not exist: the base is made by `flowrl-ray pretrain CONFIG`")
    if len({(getattr(getattr(c, section), key), str(c.env.kwargs)) for c in checked}) > 1:
        raise UsageError(f"the runs differ in {base_key} or env settings: one base per protocol")
    return variants, cfg, name


# --------------------------------------------------------------------------- launching

def launch(args, cfg, name: str, stamp: str) -> list[dict]:
    """Train one run per seed (``--parallel`` at a time); returns [{"run_dir", "seed", "wall_s"}]."""
    runs_dir = Path(args.runs_dir)
    todo = [{"seed": s, "run_dir": runs_dir / f"protocol-{name}-s{s}-{stamp}",
             "log": runs_dir / "logs" / f"protocol-{name}-s{s}-{stamp}.log"} for s in args.seeds]
    log(f"training {len(todo)} runs of {args.config} ({cfg.train.iterations} iterations each), "
        f"{args.parallel} at a time")
    running: list[tuple[dict, subprocess.Popen, float, object]] = []
    pending, finished, last_report = list(todo), [], time.monotonic()
    while pending or running:
        while pending and len(running) < args.parallel:
            run = pending.pop(0)
            # the variant's name is the runs' config name, so that --runs groups them again; the
            # protocol evaluates every policy itself, so a config's own start-vs-final is off
            cmd = [*FLOWRL, "train", args.config, "--run-dir", str(run["run_dir"]), "eval.compare_episodes=0",
                   *args.overrides,
                   f"seed={run['seed']}", f"name={name}"]
            if args.parallel > 1:            # interleaved output is unreadable: one log per run
                logfile = run["log"]
                logfile.parent.mkdir(parents=True, exist_ok=True)
                out = logfile.open("w")
                log(f"seed {run['seed']}: {run['run_dir']} (output in {logfile})")
            else:
                out = None
                log(f"seed {run['seed']}: {run['run_dir']}")
            running.append((run, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None),
                            time.monotonic(), out))
        time.sleep(1.0)
        for item in list(running):
            run, proc, t0, out = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if out is not None:
                out.close()
            run["wall_s"] = round(time.monotonic() - t0, 1)
            if proc.returncode != 0:
                raise RuntimeError(f"training seed {run['seed']} failed (exit {proc.returncode}); "
                                   f"see {run['log'] if out is not None else 'its output above'}")
            finished.append(run)
            log(f"seed {run['seed']} finished in {run['wall_s'] / 60:.1f} min "
                f"({len(finished)}/{len(todo)} runs done)")
        if args.parallel > 1 and running and time.monotonic() - last_report > 60:
            last_report = time.monotonic()
            for run, _, t0, _ in running:
                tail = _last_line(run["log"])
                log(f"seed {run['seed']} ({(time.monotonic() - t0) / 60:.1f} min): {tail}")
    for run in finished:
        run.pop("log")
    return sorted(finished, key=lambda r: args.seeds.index(r["seed"]))


def launch_variants(args, cfg, name: str, variants: dict[str, list[Path]]) -> dict[str, float]:
    """With a config given: launch its seeds as the variant ``name``; then warn of any variant with
    fewer seeds than a protocol result needs. -> each launched run's wall seconds, by run dir."""
    launch_wall = {}
    if cfg is not None:
        launched = launch(args, cfg, name, time.strftime("%Y%m%d-%H%M%S"))
        variants[name] = [r["run_dir"] for r in launched]
        launch_wall = {str(r["run_dir"]): r["wall_s"] for r in launched}
    for variant, dirs in variants.items():
        if len(dirs) < MIN_SEEDS:
            log(f"variant {variant} has {len(dirs)} seed(s); a protocol result needs >= {MIN_SEEDS}")
    return launch_wall


def results_record(args, cfg, protocol: dict, launched_extra: dict | None = None, **parts) -> dict:
    """What every protocol's JSON starts with: the revision, the command, the machine, the note,
    the protocol's settings (with the bootstrap's size and level) and what was launched; then
    ``parts`` (the base, the variants, ...)."""
    return {"revision": git_revision(), "command": command_line(), "machine": machine_info(), "note": args.note,
            "protocol": {**protocol, "n_boot": args.n_boot, "level": LEVEL},
            "launched": {"config": args.config, "overrides": args.overrides, "seeds": args.seeds,
                         **(launched_extra or {})} if cfg is not None else None,
            **parts}


def write_outputs(results: dict, args, plot, report) -> int:
    """The protocol's plots, its JSON and its Markdown report under --results-dir; exit status 0."""
    results_dir = Path(args.results_dir)
    results["plots"] = plot(results["variants"], results_dir, args.output)
    write_json(results_dir / f"{args.output}.json", results)
    report(results, results_dir, args.output)
    return 0


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "-"
    return lines[-1][-160:] if lines else "-"


# --------------------------------------------------------------------------- evaluation

def perturbed(cfg, name: str):
    """``cfg`` with the OOD suite's set ``name`` as its env.perturb."""
    from flowrl_ray.envs.robot.perturb import preset
    return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, perturb=preset(name)))


def ood_sets(cfg, names: list[str] | None) -> list[str]:
    """The suite's sets to evaluate for a base setting: ``names`` (all must apply) or, when
    empty, every set the task and observation mode can take."""
    from flowrl_ray.envs.robot import get_task
    from flowrl_ray.envs.robot.perturb import suite_for
    applicable = suite_for(get_task(cfg.env.id).name, cfg.env.obs_mode)
    if not names:
        return applicable
    bad = [n for n in names if n not in applicable]
    if bad:
        raise UsageError(f"--ood {' '.join(bad)}: not for {cfg.env.id} ({cfg.env.obs_mode}); "
                         f"its sets are {', '.join(applicable)}")
    return list(names)


def evaluate_all(variants: dict[str, list[Path]], base_override: str | None, episodes: int,
                 launch_wall: dict[str, float], ood: list[str] | None = None,
                 rules=SAMPLING_RULES) -> tuple[dict, dict]:
    """Every base and every run's last checkpoint on the same seeded episodes, in this process;
    with ``ood`` (a list, maybe empty: see :func:`ood_sets`) again in each perturbed scene; by the
    sampling rules ``rules``.
    Returns (bases: id -> outcomes [+ "ood": set -> outcomes], variants: name -> runs with
    outcomes [+ "ood"])."""
    from flowrl_ray.runtime.policy import load_policy

    plan, bases = {}, {}
    for name, dirs in variants.items():
        runs = []
        for d in dirs:
            cfg = run_config(d)
            if cfg.env.family != "robot":
                raise UsageError(f"variant {name}: {d} is a {cfg.env.family} run; the protocol is for robot tasks")
            path = base_override or cfg.algo.base_policy
            if not path:
                raise UsageError(f"variant {name}: {d} has no algo.base_policy; pass --base")
            runs.append((d, cfg, base_id(cfg, path)))
        ids = {b for _, _, b in runs}
        if len(ids) > 1:
            raise UsageError(f"variant {name}: its runs differ in base policy, env section or flow steps "
                             f"({', '.join(str(d) for d, _, _ in runs)}); group runs of one setting per variant")
        bid = ids.pop()
        bases.setdefault(bid, {"path": base_override or runs[0][1].algo.base_policy, "cfg": runs[0][1]})
        plan[name] = (bid, runs)
    if ood is not None:
        for b in bases.values():
            b["ood_sets"] = ood_sets(b["cfg"], ood)

    total = sum((1 + len(b.get("ood_sets", []))) * (1 + sum(len(r) for bid2, r in plan.values() if bid2 == bid))
                for bid, b in bases.items())
    done, t0 = 0, time.perf_counter()

    def progress(label: str) -> None:
        el = time.perf_counter() - t0
        eta = el / done * (total - done) if done else float("nan")
        log(f"evaluated {label} ({done}/{total} policies, {el / 60:.1f} min, ETA {eta / 60:.1f} min)")

    runners = {}            # one set of eval envs per base setting, reused by every policy under it
    log(f"evaluating {total} policies on {episodes} seeded episodes x {'/'.join(rules)} sampling")
    try:
        for bid, b in bases.items():
            policy = base_policy(b["cfg"], b["path"])
            b["weights_sha256"] = weights_digest(policy)
            runners[bid] = make_eval_runner(b["cfg"], policy)
            b["outcomes"] = evaluate_episodes(policy, b["cfg"], episodes, runners[bid], label="eval base",
                                              rules=rules)
            done += 1
            progress(f"base {b['path']}")
        out = {}
        for name, (bid, runs) in plan.items():
            rows = []
            for d, cfg, _ in runs:
                _, _, policy = load_policy(d)
                outcomes = evaluate_episodes(policy, cfg, episodes, runners[bid], label=f"eval {name} s{cfg.seed}",
                                              rules=rules)
                rows.append({"run_dir": str(d), "seed": cfg.seed, **run_summary(d),
                             "launch_wall_s": launch_wall.get(str(d)), "outcomes": outcomes})
                done += 1
                progress(f"{name} seed {cfg.seed} ({d})")
            out[name] = {"base": bid, "runs": rows}
    finally:
        for r in runners.values():
            r.close()
    # Out of distribution: one perturbed set of eval envs at a time per base setting.
    for bid, b in bases.items():
        for pname in b.get("ood_sets", []):
            policy = base_policy(b["cfg"], b["path"])
            runner = make_eval_runner(perturbed(b["cfg"], pname), policy)
            try:
                b.setdefault("ood", {})[pname] = evaluate_episodes(policy, b["cfg"], episodes, runner,
                                                                   label=f"eval base [{pname}]", rules=rules)
                done += 1
                progress(f"base {b['path']} [{pname}]")
                for name, (bid2, _) in plan.items():
                    if bid2 != bid:
                        continue
                    for r in out[name]["runs"]:
                        _, _, policy = load_policy(r["run_dir"])
                        r.setdefault("ood", {})[pname] = evaluate_episodes(
                            policy, b["cfg"], episodes, runner, label=f"eval {name} s{r['seed']} [{pname}]",
                            rules=rules)
                        done += 1
                        progress(f"{name} seed {r['seed']} [{pname}]")
            finally:
                runner.close()
    return bases, out


def summarise(bases: dict, variants: dict, n_boot: int, reference: str | None = None) -> None:
    """Adds per variant and sampling rule: base success, success per seed, mean and the gain;
    with ``reference``, to every other variant also ``vs_reference``: its mean success minus the
    reference's, per sampling rule, with the CI of :func:`paired_bootstrap_gain` (the reference's
    per-episode success, averaged over its seeds, in the base's place)."""
    import numpy as np
    from flowrl_ray.stats import paired_bootstrap_gain
    for v in variants.values():
        base = bases[v["base"]]["outcomes"]          # sampling rule -> outcomes (the rules evaluated)
        v["success"], v["gain"] = {}, {}
        for s in base:
            per_seed = [r["outcomes"][s]["successes"] for r in v["runs"]]
            v["success"][s] = {"base": _mean(base[s]["successes"]),
                               "per_seed": [_mean(x) for x in per_seed],
                               "mean": sum(_mean(x) for x in per_seed) / len(per_seed)}
            v["gain"][s] = paired_bootstrap_gain(per_seed, base[s]["successes"], n_boot=n_boot, level=LEVEL)
    for v in variants.values():
        base_ood = bases[v["base"]].get("ood", {})
        v["ood"] = {}
        for pname, base_out in base_ood.items():
            v["ood"][pname] = {"success": {}, "gain": {}}
            for s in base_out:
                per_seed = [r["ood"][pname][s]["successes"] for r in v["runs"]]
                v["ood"][pname]["success"][s] = {"base": _mean(base_out[s]["successes"]),
                                                 "per_seed": [_mean(x) for x in per_seed],
                                                 "mean": sum(_mean(x) for x in per_seed) / len(per_seed)}
                v["ood"][pname]["gain"][s] = paired_bootstrap_gain(per_seed, base_out[s]["successes"],
                                                                   n_boot=n_boot, level=LEVEL)
    if reference is None:
        return
    ref = variants[reference]
    for name, v in variants.items():
        if name == reference:
            continue
        if json.loads(v["base"])["env"] != json.loads(ref["base"])["env"]:
            # Another env section: other episodes, nothing to pair.
            v["vs_reference"] = {"reference": reference, "compared": False}
            continue
        # Same env section, so the same seeded episodes: the final policies pair by episode even
        # where the base settings differ (another algorithm or flow steps: FPO++ vs ReinFlow).
        v["vs_reference"] = {"reference": reference, "compared": True, "same_base": v["base"] == ref["base"]}
        for s in v["gain"]:
            ref_mean = np.mean([r["outcomes"][s]["successes"] for r in ref["runs"]], axis=0)   # [E]
            v["vs_reference"][s] = paired_bootstrap_gain([r["outcomes"][s]["successes"] for r in v["runs"]],
                                                         ref_mean, n_boot=n_boot, level=LEVEL)
        for pname in set(v["ood"]) & set(ref["ood"]):
            v["vs_reference"].setdefault("ood", {})[pname] = {}
            for s in v["ood"][pname]["gain"]:
                ref_mean = np.mean([r["ood"][pname][s]["successes"] for r in ref["runs"]], axis=0)
                v["vs_reference"]["ood"][pname][s] = paired_bootstrap_gain(
                    [r["ood"][pname][s]["successes"] for r in v["runs"]], ref_mean, n_boot=n_boot, level=LEVEL)


def _mean(xs) -> float:
    return sum(xs) / len(xs)


# --------------------------------------------------------------------------- output

def plot_run_curves(variants: dict, key: str, path: Path, xlabel: str, ylabel: str, title: str,
                    **style) -> str | None:
    """One line per variant, mean +- std over its runs, of the ``[(x, y), ...]`` each run holds
    under ``key`` (``variants[name]["runs"][i][key]``); None (and a log line) when no run has one.
    ``style``: :func:`flowrl_ray.plotting.plot_curves`'s ``xscale`` and ``markers``."""
    import numpy as np

    from flowrl_ray.plotting import plot_curves
    data = {name: [(np.array([x for x, _ in r[key]], float), np.array([y for _, y in r[key]], float))
                   for r in v["runs"] if r.get(key)]
            for name, v in variants.items()}
    data = {k: runs for k, runs in data.items() if runs}
    if not data:
        log(f"no {key.replace('_', ' ')} in the runs' metrics: {path.name} skipped")
        return None
    plot_curves(data, path, xlabel, ylabel, f"{title}: mean +- std over seeds", **style)
    return str(path)


def published_points(variants: dict) -> list[tuple[str, float, float]]:
    """The anchors' published points (:data:`_robot.PUBLISHED_STATE`) for the task the variants
    share, from low-dim state only (the figures are state results); none for mixed tasks."""
    tasks = {(env["id"], env["obs_mode"]) for env in (json.loads(v["base"])["env"] for v in variants.values())}
    if len(tasks) != 1:
        return []
    task, obs_mode = tasks.pop()
    return list(PUBLISHED_STATE.get(task, [])) if obs_mode == "low_dim" else []


def metric_curve(rows: list[dict], key: str, x: str = "env_steps", scale: float = 1.0) -> list[tuple[float, float]]:
    """``[(row[x], scale * row[key]), ...]`` over the metrics rows that have ``key``."""
    return [(r[x], scale * r[key]) for r in rows if r.get(key) is not None]


def plot(variants: dict, results_dir: Path, output: str) -> list[str]:
    written = [plot_run_curves(variants, key, results_dir / f"{output}_{fname}.png", "action chunks",
                               "success rate", title)
               for key, fname, title in (("train_curve", "train", "training success (last 100 episodes, random sampling)"),
                                         ("eval_curve", "eval", "periodic eval success (config's eval.sampling)"))]
    written.append(plot_run_curves(variants, "train_curve_time", results_dir / f"{output}_train_wallclock.png",
                                   "wall-clock (min)", "success rate",
                                   "training success (last 100 episodes) vs wall-clock"))
    # against simulator steps, on a log axis, beside the anchors' published final success at their budget
    written.append(plot_run_curves(variants, "train_curve_env_steps", results_dir / f"{output}_train_env_steps.png",
                                   "env steps (robosuite steps, log scale)", "success rate",
                                   "training success (last 100 episodes, random sampling)",
                                   xscale="log", markers=published_points(variants)))
    written.append(plot_run_curves(variants, "eval_curve_env_steps", results_dir / f"{output}_eval_env_steps.png",
                                   "env steps (robosuite steps, log scale)", "success rate",
                                   "periodic eval success (config's eval.sampling)",
                                   xscale="log", markers=published_points(variants)))
    return [w for w in written if w]


def reference_table(variants: dict, pct, pts) -> str:
    """The --reference comparison as a markdown section ("" without one)."""
    rows, skipped = [], []
    for name, v in variants.items():
        d = v.get("vs_reference")
        if d is None:
            continue
        if not d["compared"]:
            skipped.append(name)
            continue
        ref = variants[d["reference"]]
        for s in v["gain"]:
            g = d[s]
            rows.append([name, d["reference"], s, "yes" if d.get("same_base", True) else "no",
                         pct(ref["success"][s]["mean"]), pct(v["success"][s]["mean"]),
                         f"{pts(g['gain'])} [{pts(g['ci_low'])}, {pts(g['ci_high'])}]"])
    note = (f"\n\nNot compared with the reference (another env section, so other episodes): "
            f"{', '.join(skipped)}." if skipped else "")
    if not rows:
        return note
    return ("\n\nAgainst the reference (mean over its seeds minus the reference's, in points; CI: bootstrap over "
            "episodes, paired; it does not resample the training seeds, whose spread is in the table above):\n\n"
            + md_table(["variant", "reference", "sampling", "same base setting", "reference mean", "variant mean",
                        "difference [95 % CI], points"], rows)) + note


def earlier_note(results: dict) -> str:
    """The --earlier variants as a markdown paragraph ("" without any)."""
    lines = [f"{name}: variant `{v['earlier']['variant']}` of `{v['earlier']['file']}` (revision "
             f"{v['earlier']['revision']})" for name, v in results["variants"].items() if "earlier" in v]
    text = ""
    if lines:
        text += ("\n\nEvaluated earlier, not in this process (their policies' per-episode outcomes read from the "
                 "file; paired here because the base evaluated here had that file's outcomes, episode by episode): "
                 + "; ".join(lines) + ".")
    if results.get("earlier_left_out"):
        text += "\n\nEarlier variants left out: " + "; ".join(results["earlier_left_out"]) + "."
    return text


def ood_table(variants: dict, pct, pts) -> str:
    """The out-of-distribution evaluation as a markdown section ("" without one)."""
    rows = []
    for name, v in variants.items():
        for pname, o in v.get("ood", {}).items():
            for s in o["gain"]:
                g, succ = o["gain"][s], o["success"][s]
                d = v.get("vs_reference", {}).get("ood", {}).get(pname, {}).get(s)
                rows.append([name, pname, s, pct(succ["base"]), ", ".join(pct(x) for x in succ["per_seed"]),
                             pct(succ["mean"]), f"{pts(g['gain'])} [{pts(g['ci_low'])}, {pts(g['ci_high'])}]",
                             "-" if d is None else f"{pts(d['gain'])} [{pts(d['ci_low'])}, {pts(d['ci_high'])}]"])
    if not rows:
        return ""
    return ("\n\nOut of distribution (`flowrl_ray/envs/robot/perturb.py`: the same seeded episodes in a perturbed "
            "scene; gain over the base in the same scene; difference from the reference there):\n\n"
            + md_table(["variant", "perturbation", "sampling", "base", "success per seed", "mean",
                        "gain [95 % CI], points", "vs reference [95 % CI], points"], rows))


def report(results: dict, results_dir: Path, output: str) -> None:
    pct = lambda v: "-" if v is None else f"{100 * v:.0f} %"                 # noqa: E731
    pts = lambda v: f"{100 * v:+.1f}"                                          # noqa: E731
    rows, runs = [], []
    for name, v in results["variants"].items():
        for s in v["gain"]:
            g, succ = v["gain"][s], v["success"][s]
            rows.append([name, s, len(v["runs"]), pct(succ["base"]), ", ".join(pct(x) for x in succ["per_seed"]),
                         pct(succ["mean"]), f"{pts(g['gain'])} [{pts(g['ci_low'])}, {pts(g['ci_high'])}]"])
        for r in v["runs"]:
            wall = "-" if r["launch_wall_s"] is None else f"{r['launch_wall_s'] / 60:.1f} min"
            per_it = lambda k: "-" if r.get(k) is None else f"{r[k]:.1f} s"            # noqa: E731
            runs.append([name, r["seed"], r["run_dir"], r["iterations"], r.get("schedule", "-"), f"{r['chunks']:,}",
                         "-" if r.get("env_steps") is None else f"{r['env_steps']:,}",
                         f"{r['time_s'] / 60:.1f} min", wall, per_it("update_time_s"), per_it("sample_time_s")])
    p = results["protocol"]
    body = (f"Protocol: every policy and its base evaluated in one process on the same {p['episodes']} seeded "
            f"episodes per sampling rule (evaluation seed {p['eval_seed']}, {p['eval_envs']} envs); gain = mean "
            f"over seeds of (policy success - base success), in points, with a {100 * LEVEL:.0f} % percentile "
            f"bootstrap CI over episodes ({p['n_boot']:,} resamples, paired by episode). Curves: mean +- one std "
            f"across seeds (`{output}_train.png`, `{output}_eval.png`). Base weights (sha256 of the loaded "
            f"policy's tensors): " + ", ".join(f"`{b['path']}` {b.get('weights_sha256') or '(not recorded)'}"
                                               for b in results["bases"].values()) + "."
            + (f"\n\n{results['note']}" if results.get("note") else "") + "\n\n"
            + md_table(["variant", "sampling", "seeds", "base", "success per seed", "mean", "gain [95 % CI], points"],
                       rows)
            + "\n\nRuns (chunks: action chunks, each up to `env.act_steps` env steps; env steps: robosuite steps, "
              "- for a run that counted chunks as env steps; training = the "
              "iterations' time; launch = the whole `flowrl-ray train` process, Ray's start included):\n\n"
            + md_table(["variant", "seed", "run", "iterations", "schedule", "chunks", "env steps", "training", "launch",
                        "learner s/iteration", "rollout s/iteration"], runs)
            + earlier_note(results)
            + reference_table(results["variants"], pct, pts)
            + ood_table(results["variants"], pct, pts)
            + f"\n\nEvaluation time: {results['eval_time_s'] / 60:.1f} min.\n")
    write_results(output, "Robot evaluation protocol", body, results_dir=results_dir)


# --------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_arguments(p, "robot_protocol")
    p.add_argument("--runs", nargs="+", metavar="RUN", help="finished run directories, grouped by config name")
    p.add_argument("--demos", type=int, default=50, help="with --config: demos made if env.dataset is missing")
    p.add_argument("--pretrain-epochs", type=int, default=20,
                   help="with --config: epochs of the base made if algo.base_policy is missing")
    p.add_argument("--base", help="the base checkpoint (default: the runs' algo.base_policy)")
    p.add_argument("--episodes", type=int, default=100, help="evaluation episodes per sampling rule")
    p.add_argument("--reference", metavar="NAME",
                   help="also report every other variant's difference from this one (an ablation)")
    p.add_argument("--earlier", action="append", metavar="NAME=RESULTS.json:VARIANT",
                   help="a variant evaluated by an earlier protocol run, from its results file; paired only if "
                        "the base's outcomes here equal the file's, episode by episode (repeatable)")
    p.add_argument("--ood", nargs="*", metavar="SET",
                   help="also evaluate in the perturbed scenes of the OOD suite (no SET: every set the task takes; "
                        "sets: placement, object_size, friction, action_noise, camera, lighting)")
    p.add_argument("--sampling", nargs="+", choices=SAMPLING_RULES, default=list(SAMPLING_RULES),
                   help="the sampling rules to evaluate (default: both; one halves the evaluation time)")
    return p


OVERRIDE_RE = re.compile(r"^[A-Za-z_][\w]*(\.[\w]+)*=")


def split_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """(flags, overrides): ``key.sub=value`` tokens anywhere (``--seeds 0 1 2 algo.n_mc=16`` would
    otherwise give the override to --seeds), except as the value of a one-value flag
    (``--variant a=RUN,...``)."""
    one_value = {s for a in parser._actions if a.option_strings and a.nargs is None for s in a.option_strings}
    flags, overrides = [], []
    for i, tok in enumerate(argv):
        if OVERRIDE_RE.match(tok) and not (i > 0 and argv[i - 1] in one_value):
            overrides.append(tok)
        else:
            flags.append(tok)
    return flags, overrides


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """A protocol's flags, with ``key.sub=value`` overrides collected wherever they stand."""
    flags, overrides = split_overrides(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(flags)
    args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    from flowrl_ray.config import ConfigError, load_config
    try:
        check_launch_args(args)
        if args.episodes < 1:
            raise UsageError(f"--episodes must be >= 1, got {args.episodes}")
        if args.base is not None and not Path(args.base).is_file():
            raise UsageError(f"--base: no such file {args.base!r}")
        if not (args.config or args.variant or args.runs):
            raise UsageError("nothing to evaluate: give --config CONFIG --seeds ..., --variant NAME=RUN,... or --runs")
        variants = collect_variants(args)
        cfg = None
        if args.config is not None:
            cfg = load_config(args.config, [*args.overrides, f"seed={args.seeds[0]}"])   # bad keys stop here
            if cfg.env.family != "robot":
                raise UsageError(f"--config {args.config}: a {cfg.env.family} config; the protocol is for robot tasks")
            name = args.name or cfg.name
            if name in variants:
                raise UsageError(f"--name {name}: also the name of a --variant/--runs group")
        known = [*variants, *([name] if cfg is not None else [])]
        earlier = {}
        if args.earlier and args.ood is not None:
            raise UsageError("--earlier with --ood: an earlier variant brings no out-of-distribution outcomes")
        for text in args.earlier or []:
            ename, e = load_earlier(text, args.episodes, tuple(dict.fromkeys(args.sampling)))
            if ename in known or ename in earlier:
                raise UsageError(f"--earlier {ename}: also the name of another variant")
            earlier[ename] = e
        known += list(earlier)
        if args.reference is not None and args.reference not in known:
            raise UsageError(f"--reference {args.reference}: not a variant (variants: {', '.join(known)})")
    except (UsageError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if cfg is not None:
        ensure_demos_and_base(args.config, cfg, cfg.env.id, args.demos, args.pretrain_epochs, args.overrides)
    launch_wall = launch_variants(args, cfg, name if cfg is not None else "", variants)

    t0 = time.perf_counter()
    try:
        bases, evaluated = evaluate_all(variants, args.base, args.episodes, launch_wall, args.ood,
                                        rules=tuple(dict.fromkeys(args.sampling)))
        evaluated, left_out = attach_earlier(bases, evaluated, earlier)
        for line in left_out:
            log(f"earlier variant left out: {line}")
        reference = args.reference if args.reference in evaluated else None
        if args.reference is not None and reference is None:
            log(f"--reference {args.reference} was left out: no differences from it are reported")
        summarise(bases, evaluated, args.n_boot, reference)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = results_record(
        args, cfg, {"episodes": args.episodes, "eval_seed": EVAL_SEED, "eval_envs": EVAL_ENVS,
                    "sampling": list(dict.fromkeys(args.sampling)), "band": "std across seeds",
                    "gain": "mean over seeds of (policy success - base success), CI: percentile bootstrap "
                            "over episodes, paired"},
        launched_extra={"parallel": args.parallel}, reference=reference, earlier_left_out=left_out,
        bases={bid: {"path": str(b["path"]), "weights_sha256": b["weights_sha256"], "setting": json.loads(bid),
                     "outcomes": b["outcomes"],
                     "ood": b.get("ood", {})} for bid, b in bases.items()},
        variants=evaluated, eval_time_s=round(time.perf_counter() - t0, 1))
    return write_outputs(results, args, plot, report)


if __name__ == "__main__":
    sys.exit(main())
