"""The robot protocol on real robosuite: the episode pairing it relies on, and the demos an image
config records with its cameras."""

import os
import sys

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402

from conftest import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))

# --------------------------------------------------------------------------- the pairing

def test_an_episode_key_names_the_same_initial_state_whatever_the_policy_did():
    """Env i's k-th evaluation episode starts from its seeded reset and k autoresets: what ran
    before (other actions, other episode lengths) must not change its initial state."""
    from flowrl_ray.config import config_from_dict
    from flowrl_ray.envs.robot import RobotEnv
    cfg = config_from_dict({"algorithm": "fpopp", "env": {"family": "robot", "id": "lift", "horizon_steps": 4,
                                                          "act_steps": 2, "max_episode_steps": 40}})
    starts = []
    for actions, steps in ((np.zeros((4, 7)), 2), (np.full((4, 7), 0.8), 7)):
        env = RobotEnv(cfg.env, None)
        try:
            first, _ = env.reset(seed=101)
            for _ in range(steps):
                env.step(actions)
            second, _ = env.reset()          # an autoreset: no seed
            starts.append((first, second))
        finally:
            env.close()
    np.testing.assert_array_equal(starts[0][0], starts[1][0])
    np.testing.assert_array_equal(starts[0][1], starts[1][1])
    assert not np.array_equal(starts[0][0], starts[0][1])       # the next episode is another scene


def test_missing_image_demos_are_recorded_with_the_configs_cameras(tmp_path, monkeypatch):
    """An image config's demos are made with its cameras at its image size (without them the
    demos hold no images and pretraining refuses the dataset); the command is run for real."""
    import subprocess

    import h5py
    from _robot import ensure_demos_and_base

    from flowrl_ray.config import load_config
    demos, base = tmp_path / "lift_image.hdf5", tmp_path / "base.pt"
    cfg = load_config(REPO / "configs/fpopp/lift_image_quickstart.yaml",
                      [f"env.dataset={demos}", f"algo.base_policy={base}", "env.image_size=32"])
    commands = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: commands.append(cmd))
    ensure_demos_and_base("c.yaml", cfg, "lift", 1, 3)
    demo_cmd, pretrain_cmd = commands
    i = demo_cmd.index("demos")
    assert demo_cmd[i:i + 2] == ["demos", "lift"] and demo_cmd[demo_cmd.index("--cameras") + 1] == "agentview"
    assert demo_cmd[demo_cmd.index("--image-size") + 1] == "32"
    assert pretrain_cmd[-2:] == ["--epochs", "3"]
    monkeypatch.undo()
    from flowrl_ray.cli import main as cli
    assert cli(demo_cmd[i:]) == 0
    with h5py.File(demos) as f:
        assert f["data/demo_0/obs/agentview_image"].shape[1:] == (32, 32, 3)
