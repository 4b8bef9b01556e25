"""Gymnasium adapter: continuous-control envs with actions normalised to [-1, 1]."""

from __future__ import annotations

import dataclasses
import functools
import pickle

import gymnasium as gym
import numpy as np

from flowrl_ray.config import ConfigError, EnvConfig
from flowrl_ray.envs import EnvSpec, load_snapshot


class NormalizedActions(gym.ActionWrapper):
    """The policy acts in [-1, 1]^A; the env receives low + (a + 1) / 2 * (high - low).
    (A plain class rather than gymnasium's RescaleAction, whose closures do not pickle.)"""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        space = env.action_space
        self.low, self.high = space.low.astype(np.float64), space.high.astype(np.float64)
        self.action_space = gym.spaces.Box(-1.0, 1.0, space.shape, space.dtype)

    def action(self, action: np.ndarray) -> np.ndarray:
        return rescale_action(action, self.low, self.high).astype(self.env.action_space.dtype)


def rescale_action(normalized: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """[-1, 1] -> [low, high] (inputs outside [-1, 1] are clipped first)."""
    a = np.clip(np.asarray(normalized, np.float64), -1.0, 1.0)
    return low + (a + 1.0) * 0.5 * (high - low)


def make_env(env_cfg: EnvConfig, render_mode: str | None = None) -> gym.Env:
    kwargs = dict(env_cfg.kwargs)
    if env_cfg.max_episode_steps is not None:
        kwargs["max_episode_steps"] = env_cfg.max_episode_steps
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    try:
        env = gym.make(env_cfg.id, **kwargs)
    except gym.error.Error as e:
        raise ConfigError(f"config key 'env.id': cannot make gymnasium env {env_cfg.id!r}: {e}") from None
    except (ImportError, ModuleNotFoundError) as e:
        raise ConfigError(f"config key 'env.id': {env_cfg.id!r} needs a missing package: {e}") from None
    if not isinstance(env.action_space, gym.spaces.Box):
        raise ConfigError(f"config key 'env.id': {env_cfg.id!r} has a {type(env.action_space).__name__} "
                          "action space; the Gaussian policies need a continuous (Box) one")
    if not np.all(np.isfinite(env.action_space.low)) or not np.all(np.isfinite(env.action_space.high)):
        raise ConfigError(f"config key 'env.id': {env_cfg.id!r} has unbounded actions")
    # The policy acts in [-1, 1]^A; the env sees its own bounds.
    return NormalizedActions(env)


def job_env_vars(env_cfg: EnvConfig) -> dict:
    """Environment variables a cluster job running ``env.id`` needs: MuJoCo envs render headless
    with EGL (read from the id's gymnasium entry point)."""
    try:
        entry = str(gym.spec(env_cfg.id).entry_point)
    except gym.error.Error:                    # not registered here: a plugin's id
        return {}
    return {"MUJOCO_GL": "egl"} if entry.startswith("gymnasium.envs.mujoco") else {}


def spec(env_cfg: EnvConfig) -> EnvSpec:
    env = make_env(env_cfg)
    try:
        obs_shape = env.observation_space.shape
        if obs_shape is None or len(obs_shape) != 1:
            raise ConfigError(f"config key 'env.id': {env_cfg.id!r} has observation shape {obs_shape}; "
                              "the gym adapter handles flat vector observations")
        return EnvSpec(obs_shape=tuple(obs_shape), action_dim=int(env.action_space.shape[0]),
                       max_episode_steps=env.spec.max_episode_steps if env.spec else None)
    finally:
        env.close()


def make_vector_env(env_cfg: EnvConfig, num_envs: int) -> gym.vector.VectorEnv:
    # functools.partial: the snapshot reads the env config back from it.
    return gym.vector.SyncVectorEnv([functools.partial(make_env, env_cfg) for _ in range(num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)


def get_mujoco_state(model, data) -> np.ndarray:
    """MuJoCo's full integration state (qpos, qvel, act, controls, warm start, ...): what the next
    step depends on. Pickling MjData does not keep all of it."""
    import mujoco
    spec = mujoco.mjtState.mjSTATE_INTEGRATION
    state = np.empty(mujoco.mj_stateSize(model, spec))
    mujoco.mj_getState(model, data, state, spec)
    return state


def set_mujoco_state(model, data, state: np.ndarray) -> None:
    """Inverse of get_mujoco_state, then mj_forward so derived quantities match the state."""
    import mujoco
    mujoco.mj_setState(model, data, state, mujoco.mjtState.mjSTATE_INTEGRATION)
    mujoco.mj_forward(model, data)


def _mujoco_states(vec: gym.vector.VectorEnv) -> list:
    """Integration state of each MuJoCo sub-env, None for the others."""
    import mujoco
    return [get_mujoco_state(env.unwrapped.model, env.unwrapped.data)
            if isinstance(getattr(env.unwrapped, "data", None), mujoco.MjData) else None
            for env in vec.envs]


def _layers(env: gym.Env) -> list:
    """The wrappers of one env, outermost first, then the env itself."""
    layers = [env]
    while isinstance(layers[-1], gym.Wrapper):
        layers.append(layers[-1].env)
    return layers


def _is_plain(x) -> bool:
    if x is None or isinstance(x, (bool, int, float, str, bytes, np.generic)):
        return True
    if isinstance(x, np.ndarray):
        return x.dtype != object
    if isinstance(x, (list, tuple)):
        return all(_is_plain(v) for v in x)
    if isinstance(x, dict):
        return all(isinstance(k, (str, int)) and _is_plain(v) for k, v in x.items())
    return False


def _plain_state(obj) -> dict:
    """An object's own attributes that are plain data (numbers, strings, arrays, None, containers
    of them; the step counters, flags, buffers and physical state of gymnasium's envs, wrappers
    and vector envs), and its numpy generators as their bit generators' states."""
    attrs = vars(obj)
    return {"attrs": {k: v for k, v in attrs.items() if _is_plain(v)},
            "generators": {k: v.bit_generator.state for k, v in attrs.items() if isinstance(v, np.random.Generator)}}


#: the bit generators a generator's saved state may name
_BIT_GENERATORS = {c.__name__: c for c in (np.random.PCG64, np.random.PCG64DXSM, np.random.MT19937,
                                          np.random.Philox, np.random.SFC64)}


def _set_plain_state(obj, state: dict) -> None:
    for key, value in state["attrs"].items():
        setattr(obj, key, value)
    for key, rng_state in state["generators"].items():
        bit_generator = _BIT_GENERATORS[rng_state["bit_generator"]]()
        bit_generator.state = rng_state
        setattr(obj, key, np.random.Generator(bit_generator))


def snapshot(vec: gym.vector.VectorEnv) -> bytes | None:
    """Snapshot of a vector env for exact resume, as plain data: the env config it was built from,
    every wrapper's and env's plain attributes and generator states (:func:`_plain_state`), the
    vector env's buffers, and MuJoCo's integration state. None for envs whose state is not plain
    (Box2D worlds): those are reset on resume."""
    if any(hasattr(env.unwrapped, "world") for env in vec.envs):
        return None
    env_cfg = vec.env_fns[0].args[0]                 # the functools.partial(make_env, env_cfg) it was built from
    return pickle.dumps({"env_cfg": dataclasses.asdict(env_cfg), "vector": _plain_state(vec),
                         "envs": [[_plain_state(layer) for layer in _layers(env)] for env in vec.envs],
                         "mujoco": _mujoco_states(vec)})


def read_snapshot(blob: bytes) -> dict:
    """:func:`snapshot`'s dict, read running no code (plain data and numpy only)."""
    return load_snapshot(blob, EnvConfig)


def restore(blob: bytes) -> gym.vector.VectorEnv:
    """The vector env of :func:`snapshot`, rebuilt from its config and set to the saved state. A
    snapshot of an older version pickled the vector env whole: it names gymnasium's classes, so it
    loads only under the legacy opt-in (:func:`flowrl_ray.utils.restricted_loads`)."""
    saved = read_snapshot(blob)
    if "env_cfg" in saved:
        vec = make_vector_env(EnvConfig(**saved["env_cfg"]), len(saved["envs"]))
        _set_plain_state(vec, saved["vector"])
        for env, layers in zip(vec.envs, saved["envs"]):
            for layer, state in zip(_layers(env), layers, strict=True):
                _set_plain_state(layer, state)
    else:
        vec = saved["envs"]
    for env, state in zip(vec.envs, saved["mujoco"]):
        if state is not None:
            set_mujoco_state(env.unwrapped.model, env.unwrapped.data, state)
    return vec
