"""Robot family: robosuite manipulation tasks (Lift, Can, Square) with robomimic conventions.

Config (``env`` section; the conventions are in :mod:`flowrl_ray.envs.robot.env`)::

    env:
      family: robot
      id: lift                 # lift | can | square (or Lift | PickPlaceCan | NutAssemblySquare)
      obs_mode: low_dim        # or image: {"state": proprioception [9], "rgb": [3 * cams, H, W]}
      cameras: [agentview]     # image mode: agentview and/or robot0_eye_in_hand
      image_size: 84
      horizon_steps: 16        # the policy's action chunk
      act_steps: 8             # rows of it the env executes per step
      dataset: demos/lift.hdf5 # robomimic hdf5 whose min/max normalise observations and actions
      max_episode_steps: null  # low-level (20 Hz) steps; null: 300 lift, 300 can, 400 square
      kwargs: {}               # extra robosuite.make arguments
      perturb: {}              # out-of-distribution scene changes (flowrl_ray.envs.robot.perturb)

The vector env follows the env-step family contract (:mod:`flowrl_ray.envs`): same-step
autoreset with the last observation in ``infos["final_obs"]`` and the last step's infos in
``infos["final_info"]``; :func:`episode_success` reads both. ``EnvSpec.action_dim`` is the
per-step action width (7); the vector env's actions are chunks ``[N, horizon_steps, 7]``.
"""

from __future__ import annotations

import functools
import pickle
from pathlib import Path

import gymnasium as gym
import numpy as np

from flowrl_ray.config import ConfigError
from flowrl_ray.envs import EnvSpec, load_snapshot, snapshot_classes
from flowrl_ray.envs.robot.robomimic_data import NormStats, env_args, read_stats
from flowrl_ray.envs.robot import perturb
from flowrl_ray.envs.robot.config import PerturbConfig, RobotEnvConfig
from flowrl_ray.envs.robot.env import (ACTION_DIM, CAMERAS, LOW_DIM_KEYS, PROPRIO_KEYS, TASKS,
                                       RobotEnv, Task, get_task, max_steps, obs_keys)

__all__ = ["ACTION_DIM", "LOW_DIM_KEYS", "PROPRIO_KEYS", "TASKS", "PerturbConfig", "RobotEnv", "RobotEnvConfig",
           "Task", "config_class", "get_task",
           "check_config", "check_video", "load_norm", "spec", "observation_shapes", "make_env",
           "make_vector_env", "episode_success", "step_grasped", "start_seeds", "snapshot", "read_snapshot", "restore"]

#: the family's env section (flowrl_ray.envs: a family may declare its own)
config_class = RobotEnvConfig


def check_config(env_cfg: RobotEnvConfig) -> Task:
    """Validate the robot-family keys of ``env``; raises ConfigError naming the key."""
    task = get_task(env_cfg.id)
    if env_cfg.act_steps > env_cfg.horizon_steps:
        raise ConfigError(f"config key 'env.act_steps': must be <= env.horizon_steps "
                          f"({env_cfg.horizon_steps}), got {env_cfg.act_steps}")
    if env_cfg.reward == "shaped" and env_cfg.shaping_gamma is None:
        raise ConfigError("config key 'env.shaping_gamma': the shaped reward needs the discount of "
                          "its potential (a config file takes algo.gamma)")
    if env_cfg.obs_mode == "image":
        if not env_cfg.cameras:
            raise ConfigError("config key 'env.cameras': image mode needs at least one camera")
        bad = [c for c in env_cfg.cameras if c not in CAMERAS]
        if bad or len(set(env_cfg.cameras)) != len(env_cfg.cameras):
            raise ConfigError(f"config key 'env.cameras': unknown or repeated camera(s) "
                              f"{bad or env_cfg.cameras}; choose from {', '.join(CAMERAS)}")
    perturb.check(env_cfg.perturb, task.name, env_cfg.obs_mode)
    if env_cfg.dataset is not None:
        path = Path(env_cfg.dataset)
        if not path.is_file():
            raise ConfigError(f"config key 'env.dataset': no such file {str(path)!r}")
        try:
            name = env_args(path)["env_name"]
        except (OSError, KeyError, ValueError) as e:
            raise ConfigError(f"config key 'env.dataset': {str(path)!r} is not a robomimic hdf5 "
                              f"dataset ({e})") from None
        if name != task.env_name:
            raise ConfigError(f"config key 'env.dataset': {str(path)!r} holds {name} demos, "
                              f"but env.id is {task.name} ({task.env_name})")
    return task


def check_video(video) -> None:
    """Validate ``eval.video`` (a VideoConfig): a known camera, a size H.264 encodes as is."""
    if video.camera not in CAMERAS:
        raise ConfigError(f"config key 'eval.video.camera': unknown camera {video.camera!r}; "
                          f"choose from {', '.join(CAMERAS)}")
    if video.size % 16:
        raise ConfigError(f"config key 'eval.video.size': must be a multiple of 16 (H.264 "
                          f"macroblocks), got {video.size}")


def load_norm(env_cfg: RobotEnvConfig) -> NormStats | None:
    """The dataset's normalisation statistics for this observation mode, or None."""
    if env_cfg.dataset is None:
        return None
    try:
        return read_stats(env_cfg.dataset, obs_keys(env_cfg.obs_mode))
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"config key 'env.dataset': cannot read normalisation statistics "
                          f"from {env_cfg.dataset!r}: {e}") from None


def make_env(env_cfg: RobotEnvConfig, norm: NormStats | None = None) -> RobotEnv:
    """One env. ``norm`` defaults to the configured dataset's statistics."""
    check_config(env_cfg)
    return RobotEnv(env_cfg, norm if norm is not None else load_norm(env_cfg))


def observation_shapes(env_cfg: RobotEnvConfig) -> dict[str, tuple[int, ...]]:
    """{"state": (D,)} and, in image mode, {"rgb": (3 * cameras, H, W)} (no simulator needed)."""
    task = check_config(env_cfg)
    if env_cfg.obs_mode == "low_dim":
        return {"state": (3 + 4 + 2 + task.object_dim,)}
    s = env_cfg.image_size
    return {"state": (3 + 4 + 2,), "rgb": (3 * len(env_cfg.cameras), s, s)}


def job_env_vars(env_cfg: RobotEnvConfig) -> dict:
    """Environment variables a cluster job running robosuite needs: MuJoCo renders headless with EGL."""
    return {"MUJOCO_GL": "egl"}


def spec(env_cfg: RobotEnvConfig) -> EnvSpec:
    """Shapes of the configured task; ``obs_shape`` is the state vector's (image mode: also see
    :func:`observation_shapes`), ``action_dim`` the per-step action width."""
    task = check_config(env_cfg)
    load_norm(env_cfg)            # a bad dataset fails here, before any actor starts
    return EnvSpec(obs_shape=observation_shapes(env_cfg)["state"], action_dim=ACTION_DIM,
                   max_episode_steps=max_steps(task, env_cfg))


def make_vector_env(env_cfg: RobotEnvConfig, num_envs: int, start_group: int = 1) -> gym.vector.VectorEnv:
    """``start_group`` > 1 (training envs with env.start_group): groups of that many consecutive
    envs start every episode from the same seeded state (:class:`RobotEnv`)."""
    check_config(env_cfg)
    return _vector_env(env_cfg, load_norm(env_cfg), num_envs, start_group)   # statistics read once, shared


def _vector_env(env_cfg: RobotEnvConfig, norm: NormStats | None, num_envs: int,
                start_group: int = 1) -> gym.vector.VectorEnv:
    if num_envs % start_group:
        raise ValueError(f"start_group {start_group} must divide the number of envs ({num_envs})")
    # functools.partial rather than a lambda: the factories must pickle.
    return gym.vector.SyncVectorEnv([functools.partial(RobotEnv, env_cfg, norm, i, start_group)
                                     for i in range(num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def episode_success(infos: dict, done: np.ndarray) -> np.ndarray:
    """[N] bool: for the envs whose episode ended at this step (``done``), whether it was solved.
    With same-step autoreset the last step's infos are under ``final_info``."""
    final = infos.get("final_info", {})
    success = np.asarray(final.get("success", np.zeros(len(done), bool)), bool)
    return np.asarray(done, bool) & success


def step_grasped(infos: dict, done: np.ndarray) -> np.ndarray:
    """[N] bool: whether each env's gripper held the object at the end of this step (an ended
    episode's last step: under ``final_info``)."""
    done = np.asarray(done, bool)
    out = np.asarray(infos.get("grasped", np.zeros(len(done), bool)), bool) & \
        np.asarray(infos.get("_grasped", np.ones(len(done), bool)), bool)
    final = infos.get("final_info", {})
    if "grasped" in final:
        ended = done & np.asarray(final.get("_grasped", True), bool)
        out = np.where(ended, np.asarray(final["grasped"], bool), out)
    return out


def _step_values(infos: dict, done: np.ndarray, key: str, fill: int) -> np.ndarray:
    """[N] int64: each env's info ``key`` at this step (``fill`` where an env reported none); with
    same-step autoreset an ended env's last step reports under ``final_info``."""
    done = np.asarray(done, bool)
    out = np.full(len(done), fill, np.int64)
    if key in infos:
        out = np.where(np.asarray(infos.get(f"_{key}", True), bool), infos[key], out)
    final = infos.get("final_info", {})
    if key in final:
        out = np.where(done & np.asarray(final.get(f"_{key}", True), bool), final[key], out)
    return out.astype(np.int64)


def executed_rows(infos: dict, done: np.ndarray) -> np.ndarray:
    """[N] int64: how many rows of its action chunk each env executed at this step (``act_steps``,
    or fewer where the episode ended inside the chunk)."""
    return _step_values(infos, done, "substeps", 0)


def start_seeds(infos: dict, done: np.ndarray) -> np.ndarray:
    """[N] int64: the seed each env's episode at this step started from (env.start_group; -1
    where the episode was not started from a known seed)."""
    return _step_values(infos, done, "start_seed", -1)


def snapshot(vec: gym.vector.VectorEnv) -> bytes:
    """Simulator and RNG state of every env, for exact resume (robosuite envs do not pickle)."""
    first = vec.envs[0]
    return pickle.dumps({"env_cfg": first.env_cfg, "norm": first.norm,
                         "envs": [env.get_state() for env in vec.envs]})


def read_snapshot(blob: bytes) -> dict:
    """:func:`snapshot`'s dict, read running no code: plain data, numpy and this family's config
    dataclasses only (anything else is refused naming it)."""
    return load_snapshot(blob, RobotEnvConfig, snapshot_classes(PerturbConfig, NormStats))


def restore(blob: bytes) -> gym.vector.VectorEnv:
    saved = read_snapshot(blob)
    group = saved["envs"][0].get("start", {}).get("start_group", 1)     # older snapshots: ungrouped
    vec = _vector_env(saved["env_cfg"], saved["norm"], len(saved["envs"]), group)
    for env, state in zip(vec.envs, saved["envs"]):
        env.set_state(state)
    return vec
