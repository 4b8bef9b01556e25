"""One robosuite manipulation env with robomimic's observation conventions and action chunks.

Tasks (Panda, OSC_POSE arm controller + gripper, 20 Hz, sparse success reward or shaped):

    lift    robosuite Lift               object [10]  state [19]  300 steps
    can     robosuite PickPlaceCan       object [14]  state [23]  300 steps
    square  robosuite NutAssemblySquare  object [14]  state [23]  400 steps

Observation vector ("state"), in this fixed order (robomimic's low-dim keys, as DPPO orders them):
``robot0_eef_pos [3], robot0_eef_quat [4] (x, y, z, w), robot0_gripper_qpos [2], object [..]``
where ``object`` is, as in robomimic's datasets (robosuite <= 1.4 observables):

    lift        cube_pos [3], cube_quat [4], eef_pos - cube_pos [3]
    can/square  obj_pos [3], obj_quat [4], object pose in the gripper frame: pos [3], quat [4]

The values are computed here from the simulator state at the moment they are returned, as
robomimic's dataset tools do (set the state, then observe). robosuite 1.5's own ``object-state``
is not used: it orders the slices differently, flips the sign of Lift's relative position, and
its relative-pose entries read the object pose cached at the previous observation. The gripper
frame is robosuite 1.5's grip site (``robot0_eef_quat``). In ``image`` mode the object slice is
left out (pixels replace it) and the observation is a dict
``{"state": [9], "rgb": [3 * n_cameras, H, W] uint8}`` (cameras stacked on channels, upright as
robomimic stores them).

Actions: the policy emits a chunk ``[horizon_steps, 7]`` in [-1, 1]; the env executes its first
``act_steps`` rows (DPPO's multi-step convention), each mapped to the robosuite action range
through the dataset's action min/max when a dataset is configured (else robosuite's own [-1, 1]).
The chunk's reward is the sum of the per-step sparse rewards (1 while the task is solved); the
episode terminates at the first successful step (``terminate_on_success``) or is truncated once
``max_episode_steps`` low-level steps have run, possibly in the middle of a chunk.

Shaped reward (``env.reward: shaped``): the sparse chunk reward plus potential-based shaping (Ng,
Harada and Russell, 1999) at the policy's decisions,

    r'(s, chunk, s') = r_sparse + gamma * phi(s') - phi(s),      phi(terminal) = 0,

with ``gamma = env.shaping_gamma`` (the algorithm's discount per chunk) and ``phi`` robosuite's
own shaped reward of the task at the state (``reward_shaping=True``, ``reward_scale=1``): Lift's
reaching term 1 - tanh(10 d) plus 0.25 while grasping, over 2.25 (1 once lifted); Can's and
Square's largest staged term (reach, grasp, lift, hover: up to 0.7) plus 1 per placed object.
Summed over an episode with that discount the shaping telescopes to -phi(s_0) (+ gamma^T phi(s_T)
at a truncation, which the critic's bootstrap carries), so the sparse task's optimal policy is
unchanged while every chunk carries a progress signal. ``info["sparse_reward"]`` keeps the
chunk's sparse part.
``info["success"]`` says whether the episode has been solved at any step so far and
``info["substeps"]`` how many low-level steps the chunk ran, ``info["grasped"]`` whether the
gripper holds the object after it.

Videos: with ``video = (camera, size)`` set, the env renders one frame [size, size, 3] uint8 at
every reset (the first frame) and after every executed low-level step, so an episode of S
low-level steps has S + 1 frames, shown at the control frequency (20 fps: real time). A reset
moves the finished episode's frames to ``finished_frames`` (vector envs reset in the same step
that ends an episode). Rendering is off by default: on the CPU a frame costs several times a
control step's physics, and a model rebuild (seeded reset) needs a new GL context (about 1.5 s).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from flowrl_ray.config import ConfigError
from flowrl_ray.envs.robot.config import RobotEnvConfig
from flowrl_ray.envs.gym import get_mujoco_state, rescale_action, set_mujoco_state
from flowrl_ray.envs.robot.robomimic_data import NormStats
from flowrl_ray.envs.robot import perturb

PROPRIO_KEYS = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos")
LOW_DIM_KEYS = PROPRIO_KEYS + ("object",)
PROPRIO_DIM = 3 + 4 + 2
ACTION_DIM = 7                     # OSC_POSE delta (x, y, z, ax, ay, az) + gripper (-1 open, 1 close)
CONTROL_FREQ = 20
CAMERAS = ("agentview", "robot0_eye_in_hand", "frontview", "birdview", "sideview")


@dataclass(frozen=True)
class Task:
    name: str                  # short name used in configs
    env_name: str              # robosuite environment class
    max_episode_steps: int
    object_dim: int            # width of robomimic's "object" key


TASKS = {t.name: t for t in (Task("lift", "Lift", 300, 10),
                             Task("can", "PickPlaceCan", 300, 14),
                             Task("square", "NutAssemblySquare", 400, 14))}


def get_task(name: str) -> Task:
    """A task by short name or robosuite name, any case ("can", "PickPlaceCan")."""
    for task in TASKS.values():
        if name.lower() in (task.name, task.env_name.lower()):
            return task
    raise ConfigError(f"config key 'env.id': unknown robot task {name!r}; choose one of "
                      f"{', '.join(f'{t.name} ({t.env_name})' for t in TASKS.values())}")


def obs_keys(obs_mode: str) -> tuple[str, ...]:
    """The low-dim keys that make the observation vector, in order."""
    return LOW_DIM_KEYS if obs_mode == "low_dim" else PROPRIO_KEYS


def import_robosuite():
    """robosuite, imported quietly: at import it warns that no private macro file exists (the
    file is optional) and it logs every controller file it loads at INFO."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        import robosuite
    finally:
        logging.disable(previous)
    logging.getLogger("robosuite_logs").setLevel(logging.WARNING)
    return robosuite


def robosuite_kwargs(task: Task, env_cfg: RobotEnvConfig) -> dict:
    """The robosuite.make arguments; also stored as robomimic's env_args["env_kwargs"]."""
    from robosuite.controllers import load_composite_controller_config
    image = env_cfg.obs_mode == "image"
    kwargs = dict(robots="Panda",
                  # Panda's default composite controller: OSC_POSE on the arm (delta pose in the
                  # robot base frame, up to 5 cm and 0.5 rad a step) plus the gripper.
                  controller_configs=load_composite_controller_config(robot="Panda"),
                  control_freq=CONTROL_FREQ, reward_shaping=False, use_object_obs=True,
                  # Images are rendered here, only when an observation is returned (once a chunk),
                  # not by robosuite's camera observables at every control step.
                  use_camera_obs=False, has_renderer=False, has_offscreen_renderer=image,
                  # Episode length is handled here; hard_reset=False keeps the model loaded across
                  # resets (reloading it costs time and memory).
                  ignore_done=True, hard_reset=False, horizon=max_steps(task, env_cfg))
    kwargs.update(env_cfg.kwargs)
    return kwargs


def max_steps(task: Task, env_cfg: RobotEnvConfig) -> int:
    return env_cfg.max_episode_steps or task.max_episode_steps


def start_seed(base: int, group: int, episode: int) -> int:
    """The seed of the ``episode``-th start state of ``group`` (env.start_group) in the envs
    whose reset seed is ``base``: 63 bits, from numpy's SeedSequence, so that other bases (other
    workers), groups and episodes get unrelated seeds."""
    return int(np.random.SeedSequence([int(base), int(group), int(episode)]).generate_state(1, np.uint64)[0]) >> 1


class RobotEnv(gym.Env):
    """A robosuite task as a gymnasium env (see the module docstring for the conventions).

    ``norm``: dataset statistics for observation and action normalisation, or None for raw
    observations and robosuite's own [-1, 1] actions (what the scripted experts use).
    """

    metadata = {"render_modes": []}

    def __init__(self, env_cfg: RobotEnvConfig, norm: NormStats | None = None, column: int = 0,
                 start_group: int = 1):
        self.task = get_task(env_cfg.id)
        # start_group > 1: this env (column ``column`` of its vector env) starts its k-th episode
        # from start_seed(base, column // start_group, k), as the other envs of its group do; base is
        # the vector env's reset seed (the first reset seeds column i with base + i)
        self.column, self.start_group = column, start_group
        self.start = {"base": None, "episode": -1, "seed": -1}
        self.env_cfg, self.norm = env_cfg, norm
        self.image = env_cfg.obs_mode == "image"
        self.cameras = tuple(env_cfg.cameras) if self.image else ()
        self.image_size = env_cfg.image_size
        self.horizon_steps, self.act_steps = env_cfg.horizon_steps, env_cfg.act_steps
        self.max_episode_steps = max_steps(self.task, env_cfg)
        self.keys = obs_keys(env_cfg.obs_mode)
        # Rendering (image mode) is on the CPU through Mesa: robosuite selects MUJOCO_GL=egl at
        # import unless MUJOCO_GL=osmesa (with PYOPENGL_PLATFORM=osmesa) is set beforehand.
        robosuite = import_robosuite()
        self.robosuite_version = robosuite.__version__
        self.robosuite_kwargs = robosuite_kwargs(self.task, env_cfg)
        try:
            self.raw = robosuite.make(self.task.env_name, **self.robosuite_kwargs)
        except (TypeError, ValueError, AssertionError) as e:
            raise ConfigError(f"config key 'env.kwargs': robosuite.make({self.task.env_name!r}) "
                              f"failed: {e}") from None
        from robosuite.utils import transform_utils
        self._transforms = transform_utils
        # Observations are computed in raw_obs; robosuite's observables would only cost time
        # at every physics substep.
        for name in list(self.raw._observables):
            self.raw.modify_observable(name, "enabled", False)
        state_dim = PROPRIO_DIM + (0 if self.image else self.task.object_dim)
        state_space = gym.spaces.Box(-np.inf, np.inf, (state_dim,), np.float32)
        if self.image:
            rgb = gym.spaces.Box(0, 255, (3 * len(self.cameras), self.image_size, self.image_size),
                                 np.uint8)
            self.observation_space = gym.spaces.Dict({"state": state_space, "rgb": rgb})
        else:
            self.observation_space = state_space
        self.action_space = gym.spaces.Box(-1.0, 1.0, (self.horizon_steps, ACTION_DIM), np.float32)
        # Without a dataset the policy's [-1, 1] is robosuite's own range.
        low, high = self.raw.action_spec
        self.action_low = norm.action_min if norm is not None else np.asarray(low, np.float64)
        self.action_high = norm.action_max if norm is not None else np.asarray(high, np.float64)
        self.model_seed: int | None = None   # seed of the last model build (see rebuild)
        self.steps = 0                 # low-level steps in this episode
        self.solved = False            # success reached at some step of this episode
        self.control_freq = CONTROL_FREQ  # low-level steps per second: a video's fps
        self.video: tuple[str, int] | None = None   # (camera, size): record frames (see module doc)
        self.frames: list[np.ndarray] = []           # this episode's frames, [H, W, 3] uint8 each
        self.finished_frames: list[np.ndarray] = []  # the previous episode's, moved at reset
        # env.perturb (flowrl_ray.envs.robot.perturb): the out-of-distribution scene changes, made
        # after every model build; the action noise draws from its own generator
        self.perturb_rng = np.random.default_rng(0)
        perturb.apply_model(self)

    # ------------------------------------------------------------------ observations

    def task_object(self):
        """robosuite's object of the task (the cube, the can, the square nut)."""
        raw = self.raw
        if self.task.name == "lift":
            return raw.cube
        return raw.objects[raw.object_id] if self.task.name == "can" else raw.nuts[raw.nut_id]

    def object_body_id(self) -> int:
        """MuJoCo body id of the task's object."""
        if self.task.name == "lift":
            return self.raw.cube_body_id
        return self.raw.obj_body_id[self.task_object().name]

    def raw_obs(self) -> dict[str, np.ndarray]:
        """robomimic's low-dim keys (+ ``<camera>_image`` [H, W, 3] uint8 in image mode), from
        the current simulator state (see the module docstring for the ``object`` layout)."""
        T = self._transforms
        data, robot = self.raw.sim.data, self.raw.robots[0]
        site = robot.eef_site_id["right"]
        eef_pos = np.array(data.site_xpos[site])
        eef_quat = T.mat2quat(np.array(data.site_xmat[site]).reshape(3, 3))          # x, y, z, w
        body = self.object_body_id()
        obj_pos = np.array(data.body_xpos[body])
        obj_quat = T.convert_quat(np.array(data.body_xquat[body]), to="xyzw")
        if self.task.name == "lift":
            obj = [obj_pos, obj_quat, eef_pos - obj_pos]
        else:
            world_in_eef = T.pose_inv(T.pose2mat((eef_pos, eef_quat)))
            rel = T.pose_in_A_to_pose_in_B(T.pose2mat((obj_pos, obj_quat)), world_in_eef)
            obj = [obj_pos, obj_quat, *T.mat2pose(rel)]
        out = {"robot0_eef_pos": eef_pos, "robot0_eef_quat": eef_quat,
               "robot0_gripper_qpos": np.array(data.qpos[robot._ref_gripper_joint_pos_indexes["right"]]),
               "object": np.concatenate(obj)}
        for cam in self.cameras:
            out[f"{cam}_image"] = self.render_camera(cam)
        return out

    def render_camera(self, camera: str, size: int | None = None,
                      reflections: bool = True) -> np.ndarray:
        """[H, W, 3] uint8 with H = W = ``size`` (default env.image_size), upright (OpenGL reads
        rows bottom-up; robomimic stores them flipped). ``reflections=False`` skips the table's
        mirror pass (half the CPU time of a frame, barely visible; videos only: observations keep
        the look the demos were rendered with)."""
        import mujoco
        sim = self.raw.sim
        if sim._render_context_offscreen is None:
            # State-observation envs are built without a renderer (a model rebuild drops it as
            # well): make robosuite's offscreen context on first use (EGL or OSMesa, as MUJOCO_GL).
            from robosuite.utils.binding_utils import MjRenderContextOffscreen
            MjRenderContextOffscreen(sim, device_id=-1)
        # This env's GL context must be the thread's current one. Freeing any other context
        # (another env's replaced simulator) calls eglReleaseThread, which leaves no context
        # current: robosuite's render would then read back garbage.
        sim._render_context_offscreen.gl_ctx.make_current()
        flags, flag = sim._render_context_offscreen.scn.flags, mujoco.mjtRndFlag.mjRND_REFLECTION
        previous = flags[flag]
        flags[flag] = previous and reflections
        try:
            size = size or self.image_size
            img = sim.render(width=size, height=size, camera_name=camera)
        finally:
            flags[flag] = previous
        return np.ascontiguousarray(img[::-1])

    def _record_frame(self) -> None:
        if self.video is not None:
            camera, size = self.video
            self.frames.append(self.render_camera(camera, size, reflections=False))

    def observation(self, raw: dict[str, np.ndarray]):
        state = np.concatenate([np.asarray(raw[k], np.float64).ravel() for k in self.keys])
        state = self.norm.normalize_obs(state) if self.norm is not None else state.astype(np.float32)
        if not self.image:
            return state
        rgb = np.concatenate([raw[f"{cam}_image"].transpose(2, 0, 1) for cam in self.cameras])
        return {"state": state, "rgb": rgb}

    # ------------------------------------------------------------------ gymnasium API

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if self.start_group > 1:                  # a group's schedule: every episode seeded
            if seed is not None:
                self.start.update(base=seed - self.column, episode=-1)
            if self.start["base"] is not None:
                self.start["episode"] += 1
                seed = start_seed(self.start["base"], self.column // self.start_group, self.start["episode"])
        self.start["seed"] = -1 if seed is None else int(seed)
        super().reset(seed=seed)
        if seed is not None:
            self.rebuild(seed)
        self.raw.reset()
        perturb.after_reset(self)
        self.steps, self.solved = 0, False
        self.finished_frames, self.frames = self.frames, []
        self._record_frame()
        return self.observation(self.raw_obs()), {"success": False, "start_seed": self.start["seed"]}

    def rebuild(self, seed: int) -> None:
        """Reload robosuite's model with its Generator seeded: ``reset(seed)`` then fixes
        everything random about the env. robosuite draws part of the scene when it builds the
        model (Lift's cube size), from an unseeded Generator at construction; with
        ``hard_reset=False`` that draw otherwise lasts the env's lifetime and differs between
        processes. A reload takes about 0.14 s (Lift), paid only on seeded resets. The
        placement samplers and the robot's initial-joint noise draw from the same Generator.

        The replaced simulator's render context is freed here (see ``_free_render_context``)."""
        rendered = self._free_render_context()
        self.raw.rng.bit_generator.state = np.random.default_rng(seed).bit_generator.state
        self.raw.hard_reset = True
        try:
            self.raw.reset()
        finally:
            self.raw.hard_reset = False
        if rendered:
            gc.collect()
        self.model_seed = seed
        perturb.apply_model(self)
        self.perturb_rng = np.random.default_rng((seed, 1))

    def step(self, action: np.ndarray):
        """action: [T, 7] with T >= act_steps (a chunk; rows past act_steps are ignored) or [7]
        when act_steps == 1. Returns the observation after the last executed row."""
        chunk = np.asarray(action, np.float64)
        if chunk.ndim == 1:
            chunk = chunk[None]
        if chunk.ndim != 2 or chunk.shape[1] != ACTION_DIM or chunk.shape[0] < self.act_steps:
            raise ValueError(f"expected an action chunk [>= {self.act_steps}, {ACTION_DIM}], "
                             f"got shape {np.shape(action)}")
        reward, terminated, truncated, substeps = 0.0, False, False, 0
        phi = self.potential() if self.env_cfg.reward == "shaped" else 0.0
        for row in chunk[:self.act_steps]:
            success = self.step_raw(rescale_action(perturb.noisy_row(self, row), self.action_low,
                                                   self.action_high))
            self._record_frame()
            substeps += 1
            reward += float(success)
            terminated = success and self.env_cfg.terminate_on_success
            truncated = self.steps >= self.max_episode_steps
            if terminated or truncated:
                break
        info = {"success": self.solved, "substeps": substeps, "grasped": self.grasped(),
                "start_seed": self.start["seed"]}
        if self.env_cfg.reward == "shaped":
            info["sparse_reward"] = reward
            phi_next = 0.0 if terminated else self.potential()
            reward += self.env_cfg.shaping_gamma * phi_next - phi
        return self.observation(self.raw_obs()), reward, terminated, truncated, info

    def grasped(self) -> bool:
        """Whether the gripper holds the task's object now (robosuite's own check: both finger pads
        touch it): the key step FlowSAR's analysis marks on an episode's per-step errors."""
        return bool(self.raw._check_grasp(gripper=self.raw.robots[0].gripper, object_geoms=self.task_object()))

    def potential(self) -> float:
        """phi(s) of the shaped reward: robosuite's shaped task reward at the current state with
        ``reward_scale`` 1 (see the module docstring); a function of the simulator state alone."""
        raw = self.raw
        shaping, scale = raw.reward_shaping, raw.reward_scale
        raw.reward_shaping, raw.reward_scale = True, 1.0
        try:
            return float(raw.reward())
        finally:
            raw.reward_shaping, raw.reward_scale = shaping, scale

    def step_raw(self, env_action: np.ndarray) -> bool:
        """One 20 Hz control step with an action in robosuite's units; returns task success."""
        self.raw.step(env_action)
        # MuJoCo's last substep leaves positions-derived quantities (body and site poses) one
        # physics step behind the integrated state; recompute them so the success check and the
        # observation describe the state the next action starts from. (This changes nothing in
        # the dynamics: every substep recomputes them before acting.)
        self.raw.sim.forward()
        self.steps += 1
        success = bool(self.raw._check_success())
        self.solved |= success
        return success

    def _free_render_context(self) -> bool:
        """Free the simulator's offscreen render context now, correctly; True if there was one.

        robosuite leaves it to ``__del__``, which goes wrong twice. The context and its MjSim
        sit in a reference cycle, so they are freed only when Python's cyclic collector runs,
        and the context holds ~0.34 GB of Mesa buffers (scene, shadow map, framebuffer): an
        image env evaluating seeded episodes grew by that much per episode (8 envs passed
        15 GB). And ``__del__`` frees the MjrContext's GL objects in whatever context is
        current then: another env's, whose objects have the same ids, so that env rendered
        garbage from then on. Here the context's objects are freed with the context current,
        then the context itself; the caller collects the cycle."""
        sim = self.raw.sim
        ctx = None if sim is None else sim._render_context_offscreen
        if ctx is None:
            return False
        ctx.gl_ctx.make_current()
        ctx.con.free()                      # GL objects, in their own context
        ctx.gl_ctx.free()                   # the context (releases the thread's current one)
        return True

    def close(self) -> None:
        try:
            rendered = self._free_render_context()
        except Exception:       # at interpreter exit EGL's display may already be terminated
            rendered = False
        self.raw.close()
        if rendered:
            gc.collect()

    # ------------------------------------------------------------------ exact resume

    def get_state(self) -> dict:
        """Everything the next steps depend on: the seed the model was built from (the scene:
        Lift's cube size), the MuJoCo integration state (which includes
        the actuator controls and the solver's warm start), robosuite's RNG (object placement
        at the next reset), the gripper's ramped command, the controllers' arrays (the OSC pulls
        the arm's null space towards the episode's initial joints, and caches kinematics), the
        step counters."""
        sim = get_mujoco_state(self.raw.sim.model._model, self.raw.sim.data._data)
        robot = self.raw.robots[0]
        controllers = {name: {k: (v.copy() if isinstance(v, np.ndarray) else v)
                              for k, v in vars(c).items()
                              if isinstance(v, np.ndarray) or k == "new_update"}
                       for name, c in robot.composite_controller.part_controllers.items()}
        return {"model_seed": self.model_seed, "sim": sim, "rng": self.raw.rng.bit_generator.state,
                "controllers": controllers,
                "gripper": {arm: np.array(robot.gripper[arm].current_action) for arm in robot.arms},
                "timestep": self.raw.timestep, "cur_time": self.raw.cur_time,
                "steps": self.steps, "solved": self.solved, "perturb_rng": self.perturb_rng.bit_generator.state,
                "start": {**self.start, "column": self.column, "start_group": self.start_group}}

    def set_state(self, state: dict) -> None:
        if state.get("model_seed") is not None:     # absent in snapshots of older versions
            self.rebuild(state["model_seed"])        # the same scene (cube size) as the saved env
        self.raw.reset()          # sets up robosuite's per-episode bookkeeping
        set_mujoco_state(self.raw.sim.model._model, self.raw.sim.data._data, state["sim"])
        self.raw.rng.bit_generator.state = state["rng"]
        robot = self.raw.robots[0]
        for arm, command in state["gripper"].items():
            robot.gripper[arm].current_action = np.array(command)
        parts = robot.composite_controller.part_controllers
        for name, attrs in state["controllers"].items():
            for key, value in attrs.items():
                setattr(parts[name], key, value.copy() if isinstance(value, np.ndarray) else value)
        self.raw.timestep, self.raw.cur_time = state["timestep"], state["cur_time"]
        self.steps, self.solved = state["steps"], state["solved"]
        if "perturb_rng" in state:                   # absent in snapshots of older versions
            self.perturb_rng.bit_generator.state = state["perturb_rng"]
        if "start" in state:                         # absent in snapshots of older versions
            start = dict(state["start"])
            self.column, self.start_group = start.pop("column"), start.pop("start_group")
            self.start = start
