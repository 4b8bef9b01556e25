"""Scripted experts for Lift, Can and Square, and demonstration collection in robomimic layout.

Each expert is a small state machine over privileged simulator state (object, handle and target
poses read from MuJoCo, not from the policy's observation). Every phase names a target gripper
pose and a gripper command; a proportional controller turns the pose error into an OSC_POSE delta
action. Diversity comes from per-episode perturbations of the waypoints (approach height, grasp
depth, lift height, speed) and from Gaussian noise added to every arm action (``noise``, in
action units: 0.1 is 5 mm / 0.05 rad a step). A missed grasp or a jammed nut is retried a couple
of times within the episode. Episodes that fail are dropped (success-filtered), and the attempt
count is reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from scipy.spatial.transform import Rotation

from flowrl_ray.envs.robot.config import RobotEnvConfig
from flowrl_ray.envs.robot.robomimic_data import (ROBOSUITE_ENV_TYPE, DemoWriter, compute_stats,
                                             write_stats)
from flowrl_ray.envs.robot.env import LOW_DIM_KEYS, RobotEnv, get_task
from flowrl_ray.progress import CountProgress

POS_SCALE = 0.05      # OSC_POSE output_max: metres per unit of action
ROT_SCALE = 0.5       # radians per unit of action
# The OSC target is "achieved pose + delta", so a load or a contact leaves a steady offset under
# proportional control alone; a small integral term, active only near the target, removes it.
KI, I_ZONE, I_MAX = 0.15, 0.02, 0.03
MAX_RETRIES = 2
OPEN, CLOSE = -1.0, 1.0


def _yaw(mat: np.ndarray) -> float:
    """Heading of a body's x axis in the world xy plane."""
    return float(np.arctan2(mat[1, 0], mat[0, 0]))


def _wrap(angle: float, period: float) -> float:
    """angle mapped to [-period / 2, period / 2)."""
    return float((angle + period / 2) % period - period / 2)


def _rot_z(angle: float) -> np.ndarray:
    return Rotation.from_euler("z", angle).as_matrix()


@dataclass
class Phase:
    """Drive the gripper to ``target()`` (position [3], yaw offset from the start orientation)
    with the gripper command ``grip``; the phase ends when ``done()`` holds or after
    ``max_steps`` steps, then the sequence goes on, or goes back to the phase named ``retry``
    (a missed grasp, a jammed nut; at most ``MAX_RETRIES`` times an episode). ``speed`` caps the
    commanded move (m a step) for careful phases; ``noise`` scales the action noise."""
    name: str
    target: Callable[[], tuple[np.ndarray, float]]
    grip: float
    done: Callable[[], bool]
    max_steps: int = 80
    retry: str | None = None
    speed: float | None = None
    noise: float = 1.0


class Expert:
    """Base: the pose controller and the phase sequencing. Subclasses build the phases of an
    episode in :meth:`build` (called at every :meth:`reset`, after the env's reset)."""

    def __init__(self, env: RobotEnv, rng: np.random.Generator, noise: float):
        self.env, self.rng, self.noise = env, rng, noise
        self.phases: list[Phase] = []

    def reset(self) -> None:
        robot = self.env.raw.robots[0]
        self.sim = self.env.raw.sim
        self.site = robot.eef_site_id["right"]
        self.gripper = robot.gripper["right"]
        self.start_mat = self.eef_mat()
        # A per-episode speed: the proportional gain of the pose controller.
        self.gain = float(self.rng.uniform(0.7, 1.0))
        self.phase, self.phase_steps, self.retries = 0, 0, 0
        self.integral = np.zeros(3)                   # metre-steps, see KI
        self.phases = self.build()

    def build(self) -> list[Phase]:
        raise NotImplementedError

    def go_to(self, index: int) -> None:
        """Start phase ``index``; going back unpins the latched targets from there on."""
        for phase in self.phases[index:]:
            if isinstance(phase.target, Latch):
                phase.target.pos = None
        self.phase, self.phase_steps = index, 0
        self.integral[:] = 0

    # ---- privileged state
    def eef_pos(self) -> np.ndarray:
        return np.array(self.sim.data.site_xpos[self.site])

    def eef_mat(self) -> np.ndarray:
        return np.array(self.sim.data.site_xmat[self.site]).reshape(3, 3)

    def body_pos(self, body_id: int) -> np.ndarray:
        return np.array(self.sim.data.body_xpos[body_id])

    def body_mat(self, body_id: int) -> np.ndarray:
        return np.array(self.sim.data.body_xmat[body_id]).reshape(3, 3)

    def finger_yaw(self) -> float:
        """Direction in which the fingers close, as a yaw angle (a line: defined mod pi)."""
        pads = self.gripper.important_geoms
        left = self.sim.data.geom_xpos[self.sim.model.geom_name2id(pads["left_fingerpad"][0])]
        right = self.sim.data.geom_xpos[self.sim.model.geom_name2id(pads["right_fingerpad"][0])]
        d = right - left
        return float(np.arctan2(d[1], d[0]))

    def eef_yaw(self) -> float:
        """Current rotation about world z relative to the start orientation."""
        rel = self.eef_mat() @ self.start_mat.T
        return _yaw(rel)

    def near(self, target: np.ndarray, tol: float) -> bool:
        return bool(np.linalg.norm(self.eef_pos() - target) < tol)

    # ---- control
    def act(self) -> np.ndarray:
        """[7] action in robosuite units for the current phase (advancing phases as they end)."""
        while self.phase < len(self.phases) - 1:
            phase = self.phases[self.phase]
            if phase.done():
                self.go_to(self.phase + 1)
            elif self.phase_steps < phase.max_steps:
                break
            elif phase.retry is not None and self.retries < MAX_RETRIES:
                self.retries += 1
                self.go_to([p.name for p in self.phases].index(phase.retry))
            else:
                self.go_to(self.phase + 1)
        phase = self.phases[self.phase]
        self.phase_steps += 1
        pos, yaw = phase.target()
        err = pos - self.eef_pos()                                   # [3] metres
        dist = float(np.linalg.norm(err))
        if phase.speed is not None and dist > phase.speed:
            err *= phase.speed / dist
        if dist < I_ZONE:
            self.integral = np.clip(self.integral + err, -I_MAX, I_MAX)
        dpos = (self.gain * err + KI * self.integral) / POS_SCALE
        target_mat = _rot_z(yaw) @ self.start_mat
        drot = Rotation.from_matrix(target_mat @ self.eef_mat().T).as_rotvec() / ROT_SCALE * self.gain
        arm = np.concatenate([_limit(dpos), _limit(drot)])
        arm = arm + phase.noise * self.noise * self.rng.standard_normal(6)
        return np.concatenate([np.clip(arm, -1, 1), [phase.grip]])


def _limit(v: np.ndarray) -> np.ndarray:
    """Scale a vector down (keeping its direction) so no component exceeds 1."""
    m = np.abs(v).max()
    return v / m if m > 1 else v


class Latch:
    """A target pinned where the gripper is when its phase starts (to close or open in place);
    later phases read ``pos``."""

    def __init__(self, expert: Expert, yaw: Callable[[], float]):
        self.expert, self.yaw = expert, yaw
        self.pos: np.ndarray | None = None
        self.pinned_yaw = 0.0

    def __call__(self) -> tuple[np.ndarray, float]:
        if self.pos is None:
            self.pos, self.pinned_yaw = self.expert.eef_pos(), self.yaw()
        return self.pos, self.pinned_yaw


class LiftExpert(Expert):
    """Approach above the cube with the fingers across two faces, descend, close, lift."""

    def build(self) -> list[Phase]:
        r = self.rng
        cube = self.env.object_body_id()
        above, grasp_dz, lift = r.uniform(0.06, 0.12), r.uniform(-0.012, 0.0), r.uniform(0.12, 0.2)
        # A cube is 4-fold symmetric: turn the least angle that puts the fingers across faces.
        yaw = _wrap(_yaw(self.body_mat(cube)) - self.finger_yaw(), np.pi / 2)
        cube_at = lambda dz: self.body_pos(cube) + [0, 0, dz]          # noqa: E731
        grasp = Latch(self, lambda: yaw)
        return [
            Phase("approach", lambda: (cube_at(above), yaw), OPEN,
                  lambda: self.near(cube_at(above), 0.015) and abs(self.eef_yaw() - yaw) < 0.1),
            Phase("descend", lambda: (cube_at(grasp_dz), yaw), OPEN,
                  lambda: self.near(cube_at(grasp_dz), 0.008), noise=0.5),
            Phase("grasp", grasp, CLOSE, lambda: False, max_steps=int(r.integers(8, 12)), noise=0.5),
            # Success (cube 4 cm up) ends the episode; still on the table after 40 steps: a miss.
            Phase("lift", lambda: (grasp.pos + [0, 0, lift], yaw), CLOSE, lambda: False,
                  max_steps=40, retry="approach"),
            Phase("hold", lambda: (grasp.pos + [0, 0, lift], yaw), CLOSE, lambda: False, 400),
        ]


class CanExpert(Expert):
    """Pick the can from the left bin, carry it high, lower it into its target bin, release,
    back away (robosuite counts the can as placed only once the gripper has left it)."""

    def build(self) -> list[Phase]:
        raw, r = self.env.raw, self.rng
        can = self.env.object_body_id()
        goal = np.array(raw.target_bin_placements[raw.object_id])
        goal[:2] += r.uniform(-0.02, 0.02, 2)
        above, grasp_dz = r.uniform(0.08, 0.12), r.uniform(-0.005, 0.01)
        carry_z = raw.bin2_pos[2] + r.uniform(0.2, 0.26)
        drop_z = raw.bin2_pos[2] + r.uniform(0.1, 0.13)     # gripper height at release: a short drop
        can_at = lambda dz: self.body_pos(can) + [0, 0, dz]            # noqa: E731
        grasp, release = Latch(self, lambda: 0.0), Latch(self, lambda: 0.0)

        def over_goal(z: float) -> tuple[np.ndarray, float]:
            # Closed loop on the can (not the gripper): move by the can's offset from the goal.
            offset = self.eef_pos()[:2] - self.body_pos(can)[:2]
            return np.array([*(goal[:2] + offset), z]), 0.0

        lifted = lambda: self.body_pos(can)[2] > carry_z - 0.06                    # noqa: E731
        arrived = lambda: np.linalg.norm(self.body_pos(can)[:2] - goal[:2]) < 0.02  # noqa: E731
        return [
            Phase("approach", lambda: (can_at(above), 0.0), OPEN, lambda: self.near(can_at(above), 0.015)),
            Phase("descend", lambda: (can_at(grasp_dz), 0.0), OPEN,
                  lambda: self.near(can_at(grasp_dz), 0.01), noise=0.5),
            Phase("grasp", grasp, CLOSE, lambda: False, max_steps=int(r.integers(8, 12)), noise=0.5),
            Phase("lift", lambda: (np.array([*grasp.pos[:2], carry_z]), 0.0), CLOSE, lifted,
                  max_steps=40, retry="approach"),
            Phase("carry", lambda: over_goal(carry_z), CLOSE, arrived, max_steps=120, retry="approach"),
            Phase("lower", lambda: over_goal(drop_z), CLOSE, lambda: self.eef_pos()[2] < drop_z + 0.01),
            Phase("release", release, OPEN, lambda: False, max_steps=int(r.integers(6, 10))),
            Phase("retreat", lambda: (release.pos + [0, 0, 0.15], 0.0), OPEN, lambda: False, 400),
        ]


class SquareExpert(Expert):
    """Grasp the square nut by its handle, lift it above the peg, turn it so its square hole
    lines up with the peg and centre it there in closed loop on the nut's own pose, lower it
    onto the peg until the peg guides it, release (it drops to the table), back away."""

    def build(self) -> list[Phase]:
        raw, r = self.env.raw, self.rng
        nut = raw.nuts[raw.nut_id]
        nut_body = self.env.object_body_id()
        handle = self.sim.model.site_name2id(nut.important_sites["handle"])
        peg = self.body_pos(raw.peg1_body_id)
        peg_yaw = _yaw(self.body_mat(raw.peg1_body_id))
        peg_top = peg[2] + 0.1                               # the peg's half height is 10 cm
        handle_pos = lambda: np.array(self.sim.data.site_xpos[handle])      # noqa: E731
        # The fingers close across the handle, i.e. along the nut's own y axis (a line: mod pi).
        grasp_yaw = _wrap(_yaw(self.body_mat(nut_body)) + np.pi / 2 - self.finger_yaw(), np.pi)
        above, grasp_dz = r.uniform(0.06, 0.1), r.uniform(0.003, 0.008)
        carry_z = peg_top + r.uniform(0.05, 0.08)
        grasp, release = Latch(self, lambda: grasp_yaw), Latch(self, self.eef_yaw)
        place: list[float] = []

        def place_yaw() -> float:
            """The nut's yaw on the peg, chosen once it is in hand. The square hole fits in 4
            ways; the handle must not point away from the robot (the gripper holding it would be
            past the arm's reach), and of the others the one needing the least wrist turn wins."""
            if not place:
                nut_yaw, eef_yaw = _yaw(self.body_mat(nut_body)), self.eef_yaw()
                options = [peg_yaw + k * np.pi / 2 for k in range(4)]
                options = [o for o in options if np.cos(o) < 0.5]
                turn = [abs(eef_yaw + _wrap(o - nut_yaw, 2 * np.pi)) for o in options]
                place.append(options[int(np.argmin(turn))])
            return place[0]

        def align_yaw() -> float:
            # The gripper yaw that turns the nut to its placing yaw (closed loop on the nut).
            return self.eef_yaw() - _wrap(_yaw(self.body_mat(nut_body)) - place_yaw(), 2 * np.pi)

        def over_peg(nut_z: float) -> tuple[np.ndarray, float]:
            # Closed loop on the nut: move the gripper by the nut's offset from the target.
            offset = self.eef_pos() - self.body_pos(nut_body)
            return np.array([*(peg[:2] + offset[:2]), nut_z + offset[2]]), align_yaw()

        nut_xy_err = lambda: np.linalg.norm(self.body_pos(nut_body)[:2] - peg[:2])   # noqa: E731
        nut_yaw_err = lambda: abs(align_yaw() - self.eef_yaw())                       # noqa: E731
        handle_xy_err = lambda: np.linalg.norm(self.eef_pos()[:2] - handle_pos()[:2])  # noqa: E731
        lifted = lambda: self.body_pos(nut_body)[2] > carry_z - 0.02                  # noqa: E731
        return [
            Phase("approach", lambda: (handle_pos() + [0, 0, above], grasp_yaw), OPEN,
                  lambda: self.near(handle_pos() + [0, 0, above], 0.01) and handle_xy_err() < 0.005
                  and abs(_wrap(self.eef_yaw() - grasp_yaw, 2 * np.pi)) < 0.05, noise=0.5),
            Phase("descend", lambda: (handle_pos() + [0, 0, grasp_dz], grasp_yaw), OPEN,
                  lambda: self.near(handle_pos() + [0, 0, grasp_dz], 0.006), max_steps=40,
                  speed=0.03, noise=0.3),
            Phase("grasp", grasp, CLOSE, lambda: False, max_steps=int(r.integers(8, 12)), noise=0.3),
            Phase("lift", lambda: (np.array([*grasp.pos[:2], carry_z]), grasp_yaw), CLOSE, lifted,
                  max_steps=40, retry="approach"),
            Phase("carry", lambda: over_peg(carry_z), CLOSE,
                  lambda: nut_xy_err() < 0.003 and nut_yaw_err() < 0.03, max_steps=120, noise=0.3),
            # Onto the peg: once the nut's bottom is 2 cm down it, the peg guides it and it drops.
            Phase("insert", lambda: over_peg(peg_top - 0.03), CLOSE,
                  lambda: self.body_pos(nut_body)[2] < peg_top - 0.025, max_steps=60,
                  retry="carry", speed=0.01, noise=0.2),
            Phase("release", release, OPEN, lambda: False, max_steps=int(r.integers(6, 10)), noise=0.2),
            Phase("retreat", lambda: (release.pos + [0, 0, 0.12], release.pinned_yaw), OPEN,
                  lambda: False, 400),
        ]


EXPERTS: dict[str, type[Expert]] = {"lift": LiftExpert, "can": CanExpert, "square": SquareExpert}


@dataclass
class DemoStats:
    task: str
    successes: int
    attempts: int
    steps: int                 # low-level env steps simulated, failed attempts included
    seconds: float

    @property
    def success_rate(self) -> float:
        return self.successes / max(self.attempts, 1)


def run_expert(env: RobotEnv, expert: Expert, seed: int) -> tuple[dict, bool]:
    """One episode; returns its robomimic record (obs before each action, actions, rewards,
    dones, flattened MuJoCo states) and whether it succeeded."""
    env.reset(seed=seed)
    expert.reset()
    record: dict = {"obs": [], "actions": [], "rewards": [], "states": []}
    success = False
    while not success and env.steps < env.max_episode_steps:
        record["obs"].append(env.raw_obs())
        record["states"].append(np.array(env.raw.sim.get_state().flatten()))
        action = expert.act()
        success = env.step_raw(action)
        record["actions"].append(action)
        record["rewards"].append(float(success))
    return record, success


def collect_demos(task: str, episodes: int, out_path: str | Path, seed: int = 0,
                  noise: float = 0.1, cameras: tuple[str, ...] = (), image_size: int = 84,
                  max_attempts: int | None = None, progress: bool = False) -> DemoStats:
    """Run the scripted expert until ``episodes`` successful demos (or ``max_attempts``
    attempts, default 4x) and write the successful ones to ``out_path`` in robomimic's layout,
    with the low-dim normalisation statistics. ``cameras`` also records ``<cam>_image``
    [T, H, W, 3] for image policies. Returns the expert's success count over its attempts."""
    t = get_task(task)
    cfg = RobotEnvConfig(family="robot", id=t.name, obs_mode="image" if cameras else "low_dim",
                    cameras=list(cameras) or ["agentview"], image_size=image_size)
    env = RobotEnv(cfg)
    rng = np.random.default_rng(seed)
    expert = EXPERTS[t.name](env, rng, noise)
    max_attempts = max_attempts or 4 * episodes
    attempts = successes = steps = 0
    start = time.perf_counter()
    # One line per attempt: demos so far, seconds per kept demo (failed attempts included), ETA.
    line = CountProgress(episodes, f"demos {t.name}", "demos") if progress else None
    args = {"env_name": t.env_name, "env_version": env.robosuite_version, "type": ROBOSUITE_ENV_TYPE,
            "env_kwargs": {**env.robosuite_kwargs, "camera_names": list(cameras),
                           "camera_heights": image_size, "camera_widths": image_size}}
    with DemoWriter(out_path, args) as writer:
        while successes < episodes and attempts < max_attempts:
            record, ok = run_expert(env, expert, seed=seed + attempts)
            attempts += 1
            steps += len(record["actions"])
            if ok:
                successes += 1
                n = len(record["actions"])
                obs = {k: np.stack([o[k] for o in record["obs"]]) for k in record["obs"][0]}
                dones = np.zeros(n)
                dones[-1] = 1
                writer.add(obs, np.array(record["actions"]), np.array(record["rewards"]), dones,
                           np.stack(record["states"]),
                           # each seeded reset rebuilds the scene (Lift's cube size): its own MJCF
                           model_file=env.raw.sim.model.get_xml())
            if line is not None:
                line.update(successes, f"attempt {attempts}: {'ok' if ok else 'failed'}, "
                                       f"{len(record['actions'])} robosuite steps")
    env.close()
    if successes:
        write_stats(out_path, compute_stats(out_path, LOW_DIM_KEYS))
    return DemoStats(t.name, successes, attempts, steps, time.perf_counter() - start)
