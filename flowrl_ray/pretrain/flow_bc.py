"""Behaviour cloning of a flow-matching action-chunk policy from robomimic demonstrations.

Every step ``t`` of every demo is one sample: the observation at ``t``, normalised exactly as the
robot env normalises it, and the action chunk ``a[t : t + horizon_steps]`` normalised to [-1, 1]
with the dataset's action statistics, padded past the demo's end by repeating its last action
(DPPO's convention). The policy is the one FPO++ fine-tunes (:func:`make_flow_policy`), trained
with the CFM loss; the checkpoint is what ``algo.base_policy`` loads. Pure torch + h5py, no Ray.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from flowrl_ray.config import Config, ConfigError, FlowBCPretrainConfig
from flowrl_ray.envs.robot.robomimic_data import NormStats, iter_demos
from flowrl_ray.envs.robot.config import RobotEnvConfig
from flowrl_ray.optim import minibatches, optimizer_step
from flowrl_ray.utils import atomic_write_bytes, atomic_write_text, torch_threads

#: the algo keys the flow policy is built from (FPO++'s, and any flow algorithm's)
FLOW_KEYS = ("hidden_sizes", "time_dim", "feature_dim", "flow_steps")


def chunk_dataset(path: str | Path, env_cfg: RobotEnvConfig, norm: NormStats):
    """(obs, actions) over every step of every demo: obs [M, D] float32 (low_dim) or
    {"state": [M, 9] float32, "rgb": [M, 3 * cams, H, W] uint8} (image); actions
    [M, horizon_steps, 7] float32 in [-1, 1]."""
    from flowrl_ray.envs.robot import obs_keys
    image = env_cfg.obs_mode == "image"
    cams = [f"{c}_image" for c in env_cfg.cameras] if image else []
    keys = list(obs_keys(env_cfg.obs_mode))
    h = env_cfg.horizon_steps
    states, rgbs, chunks = [], [], []
    try:
        demos = list(iter_demos(path, keys + cams))
    except KeyError as e:
        key = "env.cameras" if any(c in str(e) for c in cams) else "env.dataset"
        raise ConfigError(f"config key '{key}': {e.args[0]}") from None
    for demo in demos:
        t = len(demo["actions"])
        state = np.concatenate([np.asarray(demo["obs"][k], np.float64).reshape(t, -1) for k in keys], 1)
        states.append(norm.normalize_obs(state))
        acts = norm.normalize_action(np.asarray(demo["actions"], np.float64))        # [T, 7]
        idx = np.minimum(np.arange(t)[:, None] + np.arange(h)[None], t - 1)        # [T, h]
        chunks.append(acts[idx])
        if image:
            size = (env_cfg.image_size, env_cfg.image_size, 3)
            for k in cams:
                if demo["obs"][k].shape[1:] != size:
                    raise ConfigError(f"config key 'env.image_size': dataset key {k!r} holds "
                                      f"{demo['obs'][k].shape[1:]} images, expected {size}")
            rgbs.append(np.concatenate([demo["obs"][k].transpose(0, 3, 1, 2) for k in cams], 1))
    if not demos:
        raise ConfigError(f"config key 'env.dataset': {str(path)!r} holds no demos")
    state = np.concatenate(states).astype(np.float32)
    obs = {"state": state, "rgb": np.concatenate(rgbs).astype(np.uint8)} if image else state
    return obs, np.concatenate(chunks).astype(np.float32)


def _success(runner, episodes: int, deterministic: bool, on_episodes=None) -> dict:
    r = runner.evaluate(episodes, deterministic=deterministic, on_episodes=on_episodes)
    return {"success_rate": float(np.mean(r["episode_successes"])),
            "return_mean": float(np.mean(r["episode_returns"])),
            "length_mean": float(np.mean(r["episode_lengths"]))}


def evaluate(cfg: Config, policy, episodes: int, seed: int = 0, progress: bool = False) -> dict:
    """Success rates of ``policy`` in the real env: zero-sampling (eps = 0) and random sampling.
    ``progress``: a line whenever episodes finish (2 x ``episodes`` in all), with rate and ETA."""
    from flowrl_ray.envs import env_family
    from flowrl_ray.envs.rollout import EnvRunner
    from flowrl_ray.progress import CountProgress
    start = time.perf_counter()
    policy.eval()
    runner = EnvRunner(env_family(cfg.env.family), cfg.env, 1, seed, policy, start_group=1)   # evaluate() makes its own envs
    line = CountProgress(2 * episodes, "pretrain eval", "episodes") if progress else None

    def report(offset: int, sampling: str):
        return None if line is None else (lambda done, total: line.update(offset + done, f"{sampling} sampling"))

    try:
        # A few observations per call: more threads would only add synchronisation.
        with torch_threads(1):
            out = {"episodes": episodes, "zero": _success(runner, episodes, True, report(0, "zero")),
                   "random": _success(runner, episodes, False, report(episodes, "random"))}
    finally:
        runner.close()
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def run(cfg: Config, p: FlowBCPretrainConfig, seed: int, progress: bool = True) -> dict:
    """``flowrl-ray pretrain`` for the flow-policy algorithms: the ``pretrain:`` section ``p``."""
    return pretrain_flow_policy(cfg, dataset=p.dataset, out=p.out, epochs=p.epochs, batch_size=p.batch_size,
                                lr=p.lr, seed=seed, eval_episodes=p.eval_episodes, progress=progress)


def pretrain_flow_policy(cfg: Config, dataset: str | Path | None = None, out: str | Path | None = None,
                         epochs: int = 50, batch_size: int = 256, lr: float = 1e-3, seed: int = 0,
                         eval_episodes: int = 0, progress: bool = True) -> dict:
    """Train the config's flow policy on ``dataset`` (default ``env.dataset``) and write the
    checkpoint to ``out`` (default ``algo.base_policy``), with ``<stem>.metrics.jsonl`` and
    ``<stem>.loss.png`` beside it. Returns the summary."""
    from flowrl_ray.models.flow_policy import make_flow_policy, policy_arch
    from flowrl_ray.envs import env_family
    if cfg.env.family != "robot":
        raise ConfigError(f"config key 'env.family': pretraining reads robomimic demos of the robot "
                          f"family, got {cfg.env.family!r}")
    if not all(hasattr(cfg.algo, k) for k in FLOW_KEYS):
        raise ConfigError(f"config key 'algorithm': {cfg.algorithm!r} has no flow policy to pretrain "
                          f"(use fpopp, reinflow or flowsar)")
    dataset = dataset if dataset is not None else cfg.env.dataset
    if dataset is None:
        raise ConfigError("config key 'env.dataset': no dataset to pretrain on (set it or pass --dataset)")
    if not Path(dataset).is_file():
        raise ConfigError(f"config key 'env.dataset' / --dataset: no such file {str(dataset)!r}")
    out = out if out is not None else getattr(cfg.algo, "base_policy", None)
    if out is None:
        raise ConfigError("config key 'algo.base_policy': no output path for the base policy "
                          "(set it or pass --out)")
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("lr", lr)):
        if not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be > 0, got {value}")
    out = Path(out)
    # The env normalises with this dataset's statistics: record it in the config.
    cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, dataset=str(dataset)))
    if hasattr(cfg.algo, "base_policy"):           # the config a fine-tuning run would use
        cfg.algo = dataclasses.replace(cfg.algo, base_policy=str(out))
    family = env_family(cfg.env.family)
    spec = family.spec(cfg.env)                    # checks the dataset against the task
    obs, actions = chunk_dataset(dataset, cfg.env, family.load_norm(cfg.env))
    obs = {k: torch.from_numpy(v) for k, v in obs.items()} if isinstance(obs, dict) else torch.from_numpy(obs)
    actions = torch.from_numpy(actions)
    with h5py.File(dataset, "r") as f:
        n_demos = len(f["data"])

    torch.manual_seed(seed)
    policy = make_flow_policy(cfg, spec)
    metrics_path, png_path = (out.parent / f"{out.stem}.{s}" for s in ("metrics.jsonl", "loss.png"))
    if progress:
        print(f"[pretrain] {n_demos} demos, {len(actions)} samples, {spec.obs_dim}-d state"
              f"{', images' if isinstance(obs, dict) else ''}, chunk {tuple(actions.shape[1:])}, "
              f"{sum(p.numel() for p in policy.parameters()):,} parameters", flush=True)
    with torch_threads(cfg.runtime.torch_threads):        # as the learner actor (default 1)
        start = time.perf_counter()
        rows = fit(policy, obs, actions, epochs, batch_size, lr, seed, metrics_path, progress)
        train_s = time.perf_counter() - start
        result = evaluate(cfg, policy, eval_episodes, seed, progress) if eval_episodes > 0 else None

    from flowrl_ray.plotting import plot_curves
    plot_curves({"bc loss": [(np.array([r["epoch"] for r in rows]), np.array([r["loss"] for r in rows]))]},
                png_path, "epoch", "CFM loss", f"flow BC on {Path(dataset).name}")
    ckpt = {"policy": policy.state_dict(), "arch": policy_arch(cfg), "config": cfg.to_dict(),
            "dataset": str(dataset), "demos": n_demos, "samples": len(actions), "epochs": epochs,
            "final_loss": rows[-1]["loss"], "eval": result}
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    atomic_write_bytes(out, buf.getvalue())
    summary = {"out": str(out), "dataset": str(dataset), "demos": n_demos, "samples": len(actions),
               "epochs": epochs, "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"],
               "train_s": round(train_s, 1), "s_per_epoch": round(train_s / epochs, 3),
               "metrics": str(metrics_path), "loss_plot": str(png_path)}
    if result is not None:
        summary.update(success_zero=result["zero"]["success_rate"],
                       success_random=result["random"]["success_rate"], eval=result)
    return summary


def fit(policy, obs, actions: torch.Tensor, epochs: int, batch_size: int, lr: float, seed: int,
        metrics_path: Path, progress: bool) -> list[dict]:
    """AdamW, cosine LR over all steps (to lr / 10), one CFM (tau, eps) pair per sample; random
    shifts on images. Writes one metrics row per epoch; returns the rows."""
    m, image = len(actions), isinstance(obs, dict)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * math.ceil(m / batch_size),
                                                       eta_min=0.1 * lr)
    rows, start = [], time.perf_counter()
    policy.train()
    for epoch in range(1, epochs + 1):
        total, seen, skipped = 0.0, 0, 0
        for idx in minibatches(m, batch_size, gen):
            batch_obs = {k: v[idx] for k, v in obs.items()} if image else obs[idx]
            loss = policy.bc_loss(batch_obs, actions[idx], generator=gen, augment=image)
            _, stepped = optimizer_step(loss, opt, None)        # a non-finite step: skipped, counted
            sched.step()
            if stepped:
                total, seen = total + loss.item() * len(idx), seen + len(idx)
            skipped += int(not stepped)
        mean_loss = total / seen if seen else float("nan")          # over the steps taken
        rows.append({"epoch": epoch, "loss": mean_loss, "lr": sched.get_last_lr()[0],
                     "skipped_steps": skipped, "time_s": round(time.perf_counter() - start, 2)})
        atomic_write_text(metrics_path, "".join(json.dumps(r) + "\n" for r in rows))
        if progress:
            print(f"[pretrain] epoch {epoch}/{epochs} loss {mean_loss:.4f} "
                  + (f"skipped {skipped} non-finite steps " if skipped else "") +
                  f"({time.perf_counter() - start:.1f}s)", flush=True)
    policy.eval()
    return rows
