"""Out-of-distribution robot scenes: the changes of ``env.perturb`` and the evaluation suite.

A policy fine-tuned on the training scenes is evaluated on scenes it never saw (the FlowSAR
specification's OOD experiment). Each change is made to robosuite's own objects or to the
compiled MuJoCo model, after every model build, so a seeded episode is the same scene with and
without the change except for the change itself:

    placement_scale       the object's x/y placement range (robosuite's placement sampler) widened
                          about its centre: Lift's cube, Square's nuts (Can's can already spans its
                          bin, so the change is refused there)
    object_scale          the object's collision and visual geoms (primitive shapes: Lift's cube,
                          Square's nut; the can is a mesh, refused) scaled in size and offset, with
                          their bounding volumes; the mass is kept. At reset the object is raised
                          by the change of its bottom offset so that it rests on the surface.
    table_friction_scale  the sliding friction of the surface the object starts on (Lift's and
                          Square's table, Can's bin), which is given contact priority so that its
                          friction, not the larger of the pair, acts on the object
    action_noise_std      N(0, std^2) on each executed action row in the policy's [-1, 1] units,
                          clipped to [-1, 1] (a generator seeded at every seeded reset)
    camera_shift          [dx, dy, dz] metres added to each observation camera's position
    light_scale           the scene's lights and MuJoCo's headlight (diffuse and ambient) scaled

``OOD_SUITE`` names the evaluation's sets; :func:`suite_for` lists those a task and observation
mode can run (camera and lighting change only pixels).
"""

from __future__ import annotations

import numpy as np

from flowrl_ray.config import ConfigError
from flowrl_ray.envs.robot.config import PerturbConfig

OOD_SUITE: dict[str, dict] = {
    "placement": {"placement_scale": 2.0},
    "object_size": {"object_scale": 1.3},
    "friction": {"table_friction_scale": 0.2},
    "action_noise": {"action_noise_std": 0.1},
    "camera": {"camera_shift": [0.0, 0.05, 0.03]},
    "lighting": {"light_scale": 0.35},
}
IMAGE_ONLY = ("camera", "lighting")
SURFACE_BODY = {"lift": "table", "square": "table", "can": "bin1"}
MESH_OBJECT_TASKS = ("can",)          # object_scale needs primitive geoms
PLACEMENT_TASKS = ("lift", "square")


def is_identity(p: PerturbConfig) -> bool:
    return p == PerturbConfig()


def preset(name: str) -> PerturbConfig:
    """The suite's set ``name`` as a PerturbConfig."""
    if name not in OOD_SUITE:
        raise ConfigError(f"unknown perturbation {name!r}; the suite has {', '.join(OOD_SUITE)}")
    return PerturbConfig(**OOD_SUITE[name])


def suite_for(task: str, obs_mode: str) -> list[str]:
    """The suite's sets that apply to ``task`` (short name) in ``obs_mode``."""
    names = []
    for name, values in OOD_SUITE.items():
        try:
            check(PerturbConfig(**values), task, obs_mode)
        except ConfigError:
            continue
        names.append(name)
    return names


def check(p: PerturbConfig, task: str, obs_mode: str) -> None:
    """Raises ConfigError naming the ``env.perturb`` key a task or mode cannot take."""
    if len(p.camera_shift) != 3 or not all(isinstance(x, (int, float)) for x in p.camera_shift):
        raise ConfigError(f"config key 'env.perturb.camera_shift': expected [dx, dy, dz] in metres, "
                          f"got {p.camera_shift!r}")
    if p.placement_scale != 1.0 and task not in PLACEMENT_TASKS:
        raise ConfigError(f"config key 'env.perturb.placement_scale': {task}'s object is already placed "
                          f"over its whole bin; the placement change applies to {', '.join(PLACEMENT_TASKS)}")
    if p.object_scale != 1.0 and task in MESH_OBJECT_TASKS:
        raise ConfigError(f"config key 'env.perturb.object_scale': {task}'s object is a mesh, whose "
                          f"collision shape is compiled; the size change applies to primitive-shape "
                          f"objects (lift, square)")
    if obs_mode != "image":
        for key, default in (("camera_shift", [0.0, 0.0, 0.0]), ("light_scale", 1.0)):
            if getattr(p, key) != default:
                raise ConfigError(f"config key 'env.perturb.{key}': changes only pixels; "
                                  f"env.obs_mode is {obs_mode!r} (use image)")


# --------------------------------------------------------------------------- applying them

def _object_geoms(model, body: int) -> np.ndarray:
    """Geom ids of the object body and the bodies below it."""
    return np.flatnonzero(np.isin(model.geom_bodyid, [b for b in range(model.nbody)
                                                       if b == body or _is_below(model, b, body)]))


def _is_below(model, b: int, ancestor: int) -> bool:
    while b > 0:
        b = int(model.body_parentid[b])
        if b == ancestor:
            return True
    return False


def apply_model(env) -> None:
    """The changes to a freshly built model and to robosuite's placement samplers (after the
    env's construction and after every rebuild). ``env`` is a RobotEnv."""
    import mujoco
    p: PerturbConfig = env.env_cfg.perturb
    if is_identity(p):
        return
    model = env.raw.sim.model._model
    if p.placement_scale != 1.0:
        _scale_placement(env, p.placement_scale)
    if p.object_scale != 1.0:
        s = p.object_scale
        geoms = _object_geoms(model, env.object_body_id())
        if np.any(model.geom_type[geoms] == mujoco.mjtGeom.mjGEOM_MESH):
            raise ConfigError("config key 'env.perturb.object_scale': the object has mesh geoms")
        model.geom_size[geoms] *= s
        model.geom_pos[geoms] *= s
        model.geom_rbound[geoms] *= s
        model.geom_aabb[geoms] *= s
    if p.table_friction_scale != 1.0:
        body = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, SURFACE_BODY[env.task.name])
        surface = np.flatnonzero((model.geom_bodyid == body)
                                 & ((model.geom_contype != 0) | (model.geom_conaffinity != 0)))
        model.geom_friction[surface, 0] *= p.table_friction_scale
        model.geom_priority[surface] = int(model.geom_priority.max()) + 1
    if any(p.camera_shift):
        for cam in env.cameras:
            cid = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, cam)
            model.cam_pos[cid] += np.asarray(p.camera_shift, np.float64)
    if p.light_scale != 1.0:
        model.light_diffuse[:] *= p.light_scale
        model.light_ambient[:] *= p.light_scale
        model.vis.headlight.diffuse[:] = np.asarray(model.vis.headlight.diffuse) * p.light_scale
        model.vis.headlight.ambient[:] = np.asarray(model.vis.headlight.ambient) * p.light_scale
    env.raw.sim.forward()


def _scale_placement(env, scale: float) -> None:
    """Each object sampler's x/y range, from the range robosuite built it with (kept on the env
    the first time, so a sampler that robosuite keeps across rebuilds is not widened twice)."""
    init = env.raw.placement_initializer
    samplers = list(init.samplers.values()) if hasattr(init, "samplers") else [init]
    originals = env.__dict__.setdefault("_placement_ranges", {})
    for smp in samplers:
        x0, y0 = originals.setdefault(smp.name, (tuple(smp.x_range), tuple(smp.y_range)))
        smp.x_range = _widen(x0, scale)
        smp.y_range = _widen(y0, scale)


def _widen(bounds: tuple[float, float], scale: float) -> list[float]:
    centre, half = (bounds[0] + bounds[1]) / 2.0, (bounds[1] - bounds[0]) / 2.0
    return [centre - half * scale, centre + half * scale]


def after_reset(env) -> None:
    """At reset, after robosuite placed the object: raise a rescaled object by the change of its
    bottom offset, so that it starts on the surface rather than in or above it."""
    p: PerturbConfig = env.env_cfg.perturb
    if p.object_scale == 1.0:
        return
    obj = env.task_object()
    addr = env.raw.sim.model.get_joint_qpos_addr(obj.joints[0])[0]        # free joint: x y z qw qx qy qz
    env.raw.sim.data.qpos[addr + 2] += (p.object_scale - 1.0) * -float(obj.bottom_offset[2])
    env.raw.sim.forward()


def noisy_row(env, row: np.ndarray) -> np.ndarray:
    """An executed action row [7] in [-1, 1] with the configured noise (unchanged without)."""
    std = env.env_cfg.perturb.action_noise_std
    if std == 0.0:
        return row
    return np.clip(row + env.perturb_rng.normal(0.0, std, row.shape), -1.0, 1.0)


def perturbed_config(run_dir, cfg, items: list[str]):
    """(the run's config with env.perturb set, {"name": ..., changed key: value}) from
    ``flowrl-ray eval --perturb`` items: one set of the OOD suite (``placement``) or ``key=value``
    changes of ``env.perturb`` (``action_noise_std=0.05``), read through the config loader;
    ConfigError (one line) for what the robot family refuses."""
    import dataclasses
    import json
    from pathlib import Path

    from flowrl_ray.config import load_config
    from flowrl_ray.envs.robot import check_config
    if cfg.env.family != "robot":
        raise ConfigError(f"perturbed scenes are for robot tasks, not env.family {cfg.env.family!r}")
    names = [i for i in items if "=" not in i]
    if names and len(items) > 1:
        raise ConfigError(f"one suite set ({', '.join(OOD_SUITE)}) or key=value items, got {items}")
    if names:
        overrides = [f"env.perturb.{k}={json.dumps(v)}" for k, v in dataclasses.asdict(preset(names[0])).items()]
    else:
        overrides = [f"env.perturb.{item}" for item in items]
    new = load_config(Path(run_dir) / "config.yaml", overrides)
    check_config(new.env)
    default = PerturbConfig()
    changed = {k: v for k, v in dataclasses.asdict(new.env.perturb).items() if v != getattr(default, k)}
    return dataclasses.replace(cfg, env=new.env), {"name": names[0] if names else "custom", **changed}
