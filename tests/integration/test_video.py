"""Evaluation videos of robot policies and the progress lines of long evaluations.

Episodes here are 7 robosuite steps run as chunks of 2 (the last chunk is cut after 1 step), so a
filmed episode that fails (a random policy lifts nothing in 0.35 s) has exactly 7 + 1 frames:
the reset frame and one per robosuite step."""

import os
import re

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402

from flowrl_ray.config import config_from_dict  # noqa: E402
from unit.test_video import FRAMES, robot_config  # noqa: E402


def test_only_the_wanted_episodes_are_rendered(monkeypatch):
    from flowrl_ray.algorithms.fpopp import FPOPP
    from flowrl_ray.envs import env_family
    from flowrl_ray.envs.robot import RobotEnv
    from flowrl_ray.envs.rollout import EnvRunner
    renders = []
    render = RobotEnv.render_camera
    monkeypatch.setattr(RobotEnv, "render_camera",
                        lambda self, *args, **kw: renders.append(id(self)) or render(self, *args, **kw))
    cfg = config_from_dict(robot_config())
    family = env_family("robot")
    runner = EnvRunner(family, cfg.env, 2, 0, FPOPP.make_policy(cfg, family.spec(cfg.env)))
    try:
        plain = runner.evaluate(3)
        assert renders == [] and "videos" not in plain
        filmed = runner.evaluate(3, video_episodes=1, video=("agentview", 32))
    finally:
        runner.close()
    # 3 episodes on 2 envs: env 0 films its first one; env 1 never renders. The 9th render is the
    # reset frame of env 0's next episode, taken at the autoreset before the runner stops it.
    assert len(set(renders)) == 1 and len(renders) == FRAMES + 1
    [video] = filmed["videos"]
    assert video["frames"].shape == (FRAMES, 32, 32, 3) and video["frames"].dtype == np.uint8
    assert video["fps"] == 20 and video["success"] is False and video["length"] == 4     # 4 chunks
    assert filmed["episode_returns"] == plain["episode_returns"]    # filming changes no episode
    assert not np.array_equal(video["frames"][0], video["frames"][-1])                  # the arm moved


def test_pretraining_evaluation_and_demo_collection_show_progress(tmp_path, capsys):
    from flowrl_ray.algorithms.fpopp import FPOPP
    from flowrl_ray.envs import env_family
    from flowrl_ray.envs.robot.experts import collect_demos
    from flowrl_ray.pretrain.flow_bc import evaluate
    cfg = config_from_dict(robot_config())
    policy = FPOPP.make_policy(cfg, env_family("robot").spec(cfg.env))
    result = evaluate(cfg, policy, 2, progress=True)
    assert result["zero"]["success_rate"] == 0.0
    lines = capsys.readouterr().out.splitlines()
    # 2 envs finish together: one line per sampling mode, 2 + 2 episodes in all
    assert [line.split(" | ")[0] for line in lines] == ["[pretrain eval] 2/4 episodes (zero sampling)",
                                                        "[pretrain eval] 4/4 episodes (random sampling)"]
    assert all(re.search(r"\| \d+\.\d s/episode \| elapsed \d+s \| ETA", line) for line in lines)

    stats = collect_demos("lift", 1, tmp_path / "lift.hdf5", max_attempts=1, progress=True)
    [line] = capsys.readouterr().out.splitlines()
    ok = "ok" if stats.successes else "failed"
    assert line.startswith(f"[demos lift] {stats.successes}/1 demos (attempt 1: {ok}, "
                           f"{stats.steps} robosuite steps) | ")
    assert re.search(r"s/demo \| elapsed \d+s \| ETA (0s|-)$", line)

