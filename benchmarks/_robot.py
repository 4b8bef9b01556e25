"""Pieces shared by the robot benchmarks (``fpopp_lift_learning.py``, ``flowsar_lift.py``,
``robot_protocol.py``): the CLI as a subprocess, the demos and base policy made once, a run's
summary from its metrics, and the evaluation of a policy on seeded episodes with zero-sampling
(eps = 0, FPO++'s test-time rule) and random sampling (eps ~ N(0, I), what training rollouts use).

Runs are measured in action chunks (one policy step each, up to ``env.act_steps`` 20 Hz robosuite
steps, fewer when the episode ends inside the chunk) and in env steps (robosuite steps); runs made
before env steps meant simulator steps logged chunks as ``env_steps`` and have no env-step count.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
from flowrl_ray.envs.rollout import EVAL_ENVS  # noqa: E402,F401  (8 envs: part of what fixes the episodes)
FLOWRL = [sys.executable, "-m", "flowrl_ray.cli"]
SAMPLING_RULES = ("zero", "random")
EVAL_SEED = 12345        # the evaluation episodes' seed: env i starts from seed + EVAL_SEED_OFFSET + i

#: The anchors' published figures for robomimic tasks from low-dim state, drawn as points beside
#: the curves against env steps: task -> [(label, env steps, success)]. The success is quoted from
#: DPPO's text (arXiv 2409.00588, sec. 5.3: "~100%" on Lift and Can, "> 90%" on Square; its curves
#: are not available as numbers), the env steps are the budget of its release (irom-princeton/dppo
#: v0.6, cfg/robomimic/finetune/<task>/ft_ppo_diffusion_mlp.yaml: n_train_itr x n_envs x n_steps x
#: act_steps). ReinFlow reports robomimic from pixels only, so it has no point here.
PUBLISHED_STATE = {
    "lift": [("DPPO (paper, not run here): ~100 % at its 4.86M env steps", 81 * 50 * 300 * 4, 1.0)],
    "can": [("DPPO (paper, not run here): ~100 % at its 9.06M env steps", 151 * 50 * 300 * 4, 1.0)],
    "square": [("DPPO (paper, not run here): > 90 % at its 16.08M env steps", 201 * 50 * 400 * 4, 0.9)],
}


def make_eval_runner(cfg, policy):
    """An EnvRunner with the evaluation seed; ``runner.policy`` may be swapped between
    evaluations (every ``evaluate`` re-seeds its envs and their action-noise generators). Its
    evaluations run on ``EVAL_ENVS`` (8) envs of their own, the layout of ``flowrl-ray eval`` and
    of a run's periodic evaluation; the one training env is never stepped."""
    from flowrl_ray.envs import env_family
    from flowrl_ray.envs.rollout import EnvRunner
    return EnvRunner(env_family(cfg.env.family), cfg.env, 1, seed=EVAL_SEED, policy=policy.eval(), start_group=1)


def _progress(label: str, episodes: int, every_s: float = 15.0):
    """An ``on_episodes`` callback printing a CountProgress line every ``every_s`` and at the end."""
    import time

    from flowrl_ray.progress import CountProgress
    bar, last = CountProgress(episodes, label), [time.perf_counter()]

    def on_episodes(done: int, total: int) -> None:
        if done >= total or time.perf_counter() - last[0] >= every_s:
            last[0] = time.perf_counter()
            bar.update(done)
    return on_episodes


def evaluate_episodes(policy, cfg, episodes: int, runner=None, label: str | None = None,
                      rules=SAMPLING_RULES, noise_seed: int | None = None) -> dict:
    """Per sampling rule, each episode's outcome, ordered by episode key (env index, episode
    number on that env), so that position e is the same initial state for every policy:
    {"zero": {"successes": [E] 0/1, "lengths": [E] chunk steps, "keys": [E] [env, k]}, "random": ...}.

    runner: a :func:`make_eval_runner` to reuse (its policy is replaced); None builds one per
    sampling rule and closes it. label: print progress lines ``[label zero] 40/100 episodes ...``.
    rules: the sampling rules to run (a subset of :data:`SAMPLING_RULES`). noise_seed: another
    action-noise seed for the same initial states (None: the protocol's noise)."""
    import torch
    torch.set_num_threads(1)
    out = {}
    for sampling in rules:
        own = runner is None
        r = make_eval_runner(cfg, policy) if own else runner
        r.policy = policy.eval()
        torch.manual_seed(EVAL_SEED)         # the same action noise for every policy evaluated
        try:
            res = r.evaluate(episodes, deterministic=sampling == "zero", noise_seed=noise_seed,
                             on_episodes=_progress(f"{label} {sampling}", episodes) if label else None)
        finally:
            if own:
                r.close()
        order = sorted(range(len(res["episode_keys"])), key=lambda j: res["episode_keys"][j])
        out[sampling] = {"successes": [int(res["episode_successes"][j]) for j in order],
                         "lengths": [int(res["episode_lengths"][j]) for j in order],
                         "keys": [list(res["episode_keys"][j]) for j in order]}
    return out


def evaluate(policy, cfg, episodes: int) -> dict:
    """Success rate and mean episode length (chunk steps) with zero and with random sampling over
    the same seeded episodes (initial states and sampling noise)."""
    out = {}
    for sampling, ep in evaluate_episodes(policy, cfg, episodes).items():
        out[sampling] = sum(ep["successes"]) / len(ep["successes"])
        out[f"{sampling}_length"] = sum(ep["lengths"]) / len(ep["lengths"])
    return out


def base_policy(cfg, path: str | None = None):
    """The policy of ``cfg``'s architecture with the pretrained weights at ``path`` (default
    ``algo.base_policy``)."""
    import torch

    from flowrl_ray.algorithms import get_algorithm
    from flowrl_ray.envs import env_family
    spec = env_family(cfg.env.family).spec(cfg.env)
    policy = get_algorithm(cfg.algorithm).make_policy(cfg, spec)
    state = torch.load(path or cfg.algo.base_policy, map_location="cpu", weights_only=False)
    # a policy with parts the base does not have (ReinFlow's noise net) loads it with load_base
    getattr(policy, "load_base", policy.load_state_dict)(state["policy"])
    return policy.eval()


def weights_digest(policy) -> str:
    """A short sha256 of ``policy``'s weights (names, dtypes, shapes and bytes, in name order):
    two base files with the same digest hold the same policy, whatever else the files record."""
    import hashlib

    import torch
    h = hashlib.sha256()
    for name, t in sorted(policy.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def base_key(cfg) -> str:
    """The base policy's path, with the executed chunk length when it is not the config's 8."""
    path = cfg.algo.base_policy
    return path if cfg.env.act_steps == 8 else f"{path}, act_steps {cfg.env.act_steps}"


def ensure_demos_and_base(config: str, cfg, task: str, demos: int, epochs: int, overrides=()) -> None:
    """The scripted demos (``env.dataset``) and the pretrained base policy (``algo.base_policy``)
    of ``cfg``, made once with the CLI; skipped when the files exist. Image configs record their
    cameras at ``env.image_size``."""
    if not Path(cfg.env.dataset).is_file():
        images = ["--cameras", *cfg.env.cameras, "--image-size", str(cfg.env.image_size)] \
            if cfg.env.obs_mode == "image" else []
        subprocess.run([*FLOWRL, "demos", task, "--episodes", str(demos), "--out", cfg.env.dataset, *images],
                       check=True)
    if not Path(cfg.algo.base_policy).is_file():
        subprocess.run([*FLOWRL, "pretrain", config, *overrides, "--epochs", str(epochs)], check=True)


def run_config(run_dir: Path):
    from flowrl_ray.config import load_config
    return load_config(Path(run_dir) / "config.yaml")


def run_schedule(cfg) -> str:
    """A run's update schedule, stated in every table so budgets compare fairly: the learning
    rate, the iterations with a ramped lr or a frozen actor, and the iterations left at full rate
    (e.g. FPO++ 10 iterations with 7 of warm-up is 3 at full rate)."""
    a = cfg.algo
    warm, frozen = getattr(a, "lr_warmup_iters", 0) or 0, getattr(a, "critic_warmup_iters", 0) or 0
    if getattr(a, "advantage", "gae") == "group":               # no critic, nothing frozen
        frozen = 0
    parts = [f"lr {a.lr:g}"]
    if warm:
        parts.append(f"{warm} it lr warm-up")
    if frozen:
        parts.append(f"{frozen} it actor frozen")
    full = max(0, cfg.train.iterations - frozen - warm)
    return ", ".join(parts) + f"; {full} of {cfg.train.iterations} it at full rate"


def run_summary(run_dir: Path) -> dict:
    """Chunks and env steps (robosuite steps; None for a run that counted chunks as env steps),
    training wall-clock (``time_s``: the iterations' time, without Ray's start), iterations, the
    training success (last 100 training episodes, random sampling) first and last, its curve and
    the periodic-eval curve ([chunks, success] pairs), the training and periodic-eval curves
    against env steps ([robosuite steps, success]; empty for a run that counted chunks as env
    steps) and the training curve against
    wall-clock minutes, the mean learner update and rollout seconds per iteration, up to the last
    checkpoint (an interrupted run's policy is its last checkpoint's)."""
    from flowrl_ray.checkpoint import latest_checkpoint, load_checkpoint
    from flowrl_ray.metrics import read_metrics
    rows = read_metrics(run_dir)
    saved = load_checkpoint(latest_checkpoint(run_dir))["trainer"]["iteration"]
    rows = [r for r in rows if r["iteration"] <= saved]
    last = rows[-1]
    chunks = lambda r: r.get("chunks", r["env_steps"])      # noqa: E731  (older runs: env_steps counted chunks)
    train = [(chunks(r), r["success_rate"]) for r in rows if r.get("success_rate") is not None]
    train_env = [(r["env_steps"], r["success_rate"]) for r in rows       # robosuite steps: runs that count both
                 if r.get("success_rate") is not None and "chunks" in r]
    evals = [(chunks(r), r["eval/success_rate"]) for r in rows if r.get("eval/success_rate") is not None]
    evals_env = [(r["env_steps"], r["eval/success_rate"]) for r in rows
                 if r.get("eval/success_rate") is not None and "chunks" in r]
    mean = lambda key: (sum(r[key] for r in rows if r.get(key) is not None)        # noqa: E731
                        / max(1, sum(r.get(key) is not None for r in rows)))
    return {"chunks": chunks(last), "env_steps": last["env_steps"] if "chunks" in last else None,
            "time_s": last["time_s"], "iterations": last["iteration"],
            # seconds per iteration: the learner's update (prepare + update) and the rollouts
            "update_time_s": mean("learner/update_time_s"), "sample_time_s": mean("sample_time_s"),
            "train_curve_time": [(r["time_s"] / 60, r["success_rate"]) for r in rows
                                 if r.get("success_rate") is not None],
            "train_success_first": train[0][1] if train else None,
            "train_success_last": train[-1][1] if train else None,
            "train_curve": train, "train_curve_env_steps": train_env, "eval_curve": evals,
            "eval_curve_env_steps": evals_env,
            "name": run_config(run_dir).name,
            "schedule": run_schedule(run_config(run_dir))}
