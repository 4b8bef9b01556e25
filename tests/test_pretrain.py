"""`flowrl-ray demos` / `flowrl-ray pretrain`: chunking demos into (observation, action chunk)
samples as the env sees them, flow-matching behaviour cloning, the base-policy checkpoint FPO++
loads, and the two CLI verbs (real robosuite for the env parts)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("robosuite")

from flowrl_ray import cli                                                   # noqa: E402
from flowrl_ray.algorithms.fpopp import (FPOPP, load_base_policy,           # noqa: E402
                                         make_flow_policy, policy_arch)
from flowrl_ray.config import ConfigError, EnvConfig, config_from_dict       # noqa: E402
from flowrl_ray.envs import robomimic_data as rd                             # noqa: E402
from flowrl_ray.envs import robot                                            # noqa: E402
from flowrl_ray.envs.robot.env import RobotEnv                               # noqa: E402
from flowrl_ray.envs.robot.experts import collect_demos                      # noqa: E402
from flowrl_ray.pretrain import chunk_dataset, pretrain                      # noqa: E402

LIFT_ARGS = {"env_name": "Lift", "env_version": "1.5.2", "type": 1, "env_kwargs": {}}


def _config(dataset, **env):
    return config_from_dict({
        "algorithm": "fpopp",
        "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2,
                "dataset": str(dataset), **env},
        "algo": {"hidden_sizes": [64, 64], "minibatch_size": 8},
        "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 4}})


def _env_observation(env_cfg: EnvConfig, norm, raw: dict):
    """RobotEnv.observation (the env's own normalisation code) without starting a simulator."""
    image = env_cfg.obs_mode == "image"
    fake = SimpleNamespace(keys=robot.env.obs_keys(env_cfg.obs_mode), norm=norm, image=image,
                           cameras=tuple(env_cfg.cameras) if image else ())
    return RobotEnv.observation(fake, raw)


def _write(path, demos: list[dict], keys) -> None:
    with rd.DemoWriter(path, LIFT_ARGS) as w:
        for obs, actions in demos:
            t = len(actions)
            w.add(obs, actions, np.eye(t)[-1], np.eye(t)[-1], np.zeros((t, 5)))
    rd.write_stats(path, rd.compute_stats(path, keys))


def _low_dim_obs(rng, t: int) -> dict:
    return {"robot0_eef_pos": rng.normal(size=(t, 3)), "robot0_eef_quat": rng.normal(size=(t, 4)),
            "robot0_gripper_qpos": rng.normal(size=(t, 2)), "object": rng.normal(size=(t, 10))}


def test_chunks_pad_with_the_last_action_and_normalise_like_the_env(tmp_path):
    rng = np.random.default_rng(0)
    # actions: demo 0 is 0, 1, 2 and demo 1 is 4, 3, 2, 1, 0 on every arm dim (range [0, 4]:
    # x -> x / 2 - 1); the gripper dim is constant (maps to -1)
    a0 = np.repeat(np.arange(3.0)[:, None], 7, 1)
    a1 = np.repeat(np.arange(4.0, -1, -1)[:, None], 7, 1)
    a0[:, 6] = a1[:, 6] = 1.0
    demos = [(_low_dim_obs(rng, 3), a0), (_low_dim_obs(rng, 5), a1)]
    path = tmp_path / "tiny.hdf5"
    _write(path, demos, robot.LOW_DIM_KEYS)
    env_cfg = EnvConfig(family="robot", id="lift", horizon_steps=4, act_steps=2, dataset=str(path))
    norm = robot.load_norm(env_cfg)
    obs, actions = chunk_dataset(path, env_cfg, norm)
    assert obs.shape == (8, 19) and obs.dtype == np.float32
    assert actions.shape == (8, 4, 7) and actions.dtype == np.float32
    # demo 0, t = 1: raw chunk [1, 2, 2, 2] (padded with the last action) -> [-0.5, 0, 0, 0]
    assert np.allclose(actions[1, :, 0], [-0.5, 0, 0, 0])
    # demo 1 (rows 3..7), t = 3: raw [1, 0, 0, 0] -> [-0.5, -1, -1, -1]; t = 0: [4, 3, 2, 1]
    assert np.allclose(actions[6, :, :6], np.array([-0.5, -1, -1, -1])[:, None])
    assert np.allclose(actions[3, :, 3], [1, 0.5, 0, -0.5])
    assert np.all(actions[7] == -1)                                      # the last step: all padding
    assert np.all(actions[..., 6] == -1)                                 # constant dim
    # observations: min/max of the two demos, by hand, and exactly what the env computes
    raw = [np.concatenate([d[0][k] for k in robot.LOW_DIM_KEYS], 1) for d in demos]
    lo, hi = np.concatenate(raw).min(0), np.concatenate(raw).max(0)
    assert np.allclose(obs[4], 2 * (raw[1][1] - lo) / (hi - lo) - 1, atol=1e-6)
    assert obs.min() == -1 and obs.max() == 1
    assert np.array_equal(obs[4], _env_observation(env_cfg, norm, {k: v[1] for k, v in demos[1][0].items()}))


def test_image_chunks_stack_cameras_in_config_order(tmp_path):
    rng = np.random.default_rng(1)
    demos = []
    for t in (3, 4):
        obs = _low_dim_obs(rng, t)
        for cam in ("agentview", "robot0_eye_in_hand"):
            obs[f"{cam}_image"] = rng.integers(0, 256, (t, 8, 8, 3), dtype=np.uint8)
        demos.append((obs, rng.uniform(-1, 1, (t, 7))))
    path = tmp_path / "img.hdf5"
    _write(path, demos, robot.LOW_DIM_KEYS)
    cfg = EnvConfig(family="robot", id="lift", obs_mode="image", cameras=["robot0_eye_in_hand", "agentview"],
                    image_size=8, horizon_steps=2, act_steps=1, dataset=str(path))
    norm = robot.load_norm(cfg)
    obs, actions = chunk_dataset(path, cfg, norm)
    assert set(obs) == {"state", "rgb"} and actions.shape == (7, 2, 7)
    assert obs["state"].shape == (7, 9) and obs["state"].dtype == np.float32
    assert obs["rgb"].shape == (7, 6, 8, 8) and obs["rgb"].dtype == np.uint8
    d = demos[1][0]
    assert np.array_equal(obs["rgb"][5, :3], d["robot0_eye_in_hand_image"][2].transpose(2, 0, 1))
    assert np.array_equal(obs["rgb"][5, 3:], d["agentview_image"][2].transpose(2, 0, 1))
    env_obs = _env_observation(cfg, norm, {k: v[2] for k, v in d.items()})
    assert np.array_equal(obs["state"][5], env_obs["state"]) and np.array_equal(obs["rgb"][5], env_obs["rgb"])
    with pytest.raises(ConfigError, match="birdview_image"):
        chunk_dataset(path, EnvConfig(family="robot", id="lift", obs_mode="image", cameras=["birdview"],
                                      image_size=8), norm)
    with pytest.raises(ConfigError, match="image_size"):
        chunk_dataset(path, EnvConfig(family="robot", id="lift", obs_mode="image", image_size=84), norm)


@pytest.fixture(scope="module")
def lift_demos(tmp_path_factory):
    path = tmp_path_factory.mktemp("demos") / "lift.hdf5"
    collect_demos("lift", episodes=2, out_path=path, seed=0, noise=0.1)
    return path


def test_pretrain_learns_and_writes_a_base_policy_fpopp_loads(lift_demos, tmp_path):
    cfg = _config(lift_demos, max_episode_steps=24)        # short eval episodes
    out = tmp_path / "base" / "lift.pt"
    summary = pretrain(cfg, out=out, epochs=100, batch_size=16, lr=1e-3, eval_episodes=1, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "base" / "lift.metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(rows) == 100 and np.mean(losses[-3:]) < 0.65 * np.mean(losses[:3])
    assert summary["final_loss"] == losses[-1] and summary["demos"] == 2
    assert (tmp_path / "base" / "lift.loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["lift.loss.png", "lift.metrics.jsonl", "lift.pt"]

    ckpt = load_base_policy(out)
    assert ckpt["arch"] == policy_arch(cfg) and ckpt["demos"] == 2 and ckpt["epochs"] == 100
    assert ckpt["samples"] == sum(len(d["actions"]) for d in rd.load_demos(lift_demos, robot.LOW_DIM_KEYS))
    assert ckpt["dataset"] == str(lift_demos) and ckpt["config"]["env"]["dataset"] == str(lift_demos)
    for mode in ("zero", "random"):
        assert 0 <= ckpt["eval"][mode]["success_rate"] <= 1
    assert summary["success_zero"] == ckpt["eval"]["zero"]["success_rate"]
    policy = make_flow_policy(cfg, robot.spec(cfg.env))
    policy.load_state_dict(ckpt["policy"])                           # strict: same architecture
    # an FPO++ config naming it passes FPO++'s checks; another architecture is refused, naming the key
    data = {"algorithm": "fpopp", "env": ckpt["config"]["env"],
            "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 4}}

    def fpopp_checks(hidden_sizes):
        cfg = config_from_dict({**data, "algo": {"hidden_sizes": hidden_sizes, "minibatch_size": 8,
                                                 "base_policy": str(out)}})
        FPOPP.preflight(cfg, robot.spec(cfg.env))

    fpopp_checks([64, 64])
    with pytest.raises(ConfigError, match=r"algo\.hidden_sizes"):
        fpopp_checks([32])


def test_pretrain_needs_a_dataset_and_an_output(lift_demos, tmp_path):
    cfg = _config(lift_demos)
    with pytest.raises(ConfigError, match=r"algo\.base_policy"):
        pretrain(cfg, progress=False)
    with pytest.raises(ConfigError, match=r"env\.dataset"):
        pretrain(cfg, dataset=tmp_path / "none.hdf5", out=tmp_path / "x.pt", progress=False)


def test_cli_demos_writes_a_dataset(tmp_path, capsys):
    out = tmp_path / "d" / "lift.hdf5"
    assert cli.main(["demos", "lift", "--episodes", "1", "--out", str(out)]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["task"] == "lift" and line["demos"] == 1 and line["out"] == str(out)
    assert 0 < line["success_rate"] <= 1 and line["steps"] > 0
    assert len(rd.load_demos(out, robot.LOW_DIM_KEYS)) == 1


def test_cli_demos_unknown_task_is_a_user_error(capsys):
    assert cli.main(["demos", "nosuchtask", "--episodes", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nosuchtask" in err and "lift" in err


def test_cli_pretrain(lift_demos, tmp_path, capsys):
    base = tmp_path / "base.pt"
    config = tmp_path / "cfg.yaml"
    # algo.base_policy names the file pretraining creates: it must not be loaded beforehand
    config.write_text(json.dumps({
        "algorithm": "fpopp", "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2,
                                      "dataset": str(tmp_path / "missing.hdf5")},
        "algo": {"hidden_sizes": [64, 64], "minibatch_size": 8, "base_policy": str(base)},
        "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 4}}))
    assert cli.main(["pretrain", str(config), "--epochs", "2"]) == 2
    assert "env.dataset" in capsys.readouterr().err
    assert cli.main(["pretrain", str(config), "--dataset", str(tmp_path / "nope.hdf5")]) == 2
    assert "--dataset" in capsys.readouterr().err
    assert cli.main(["pretrain", str(config), f"env.dataset={lift_demos}", "--epochs", "2",
                     "--batch-size", "32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["out"] == str(base) and summary["epochs"] == 2 and base.is_file()
    assert load_base_policy(base)["arch"]["hidden_sizes"] == [64, 64]


@pytest.mark.parametrize("verb", ["demos", "pretrain"])
def test_verbs_explain_themselves(verb, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([verb, "--help"])
    assert e.value.code == 0 and f"usage: flowrl-ray {verb}" in capsys.readouterr().out
