"""Run directories written before a config change still resume. Each fixture is a tiny run
(2 iterations, checkpoint at iteration 2) made from its `made_from.yaml` by the code of the
revision before the change (`flowrl-ray train made_from.yaml --run-dir RUN`):

- `flowsar_run_before_flat_config` (revision 51cac30): the saved config nests the spec's
  hyperparameters under `algo.flowsar:`; today's code reads them as the flat keys.
- `ppo_run_before_env_sections` (revision 21f31ca): a gym run whose saved `env` section holds
  every robot key at its default, from before the robot family declared its own section; today's
  code drops them. Its env snapshot pickles gymnasium's vector env whole: it resumes under the
  legacy opt-in only.

Each loads its checkpoint, trains on and saves its config in today's layout."""

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest  # noqa: E402
import yaml  # noqa: E402

from flowrl_ray.cli import main  # noqa: E402
from flowrl_ray.config import load_config  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FIXTURE = FIXTURES / "flowsar_run_before_flat_config"


@pytest.mark.slow
def test_a_flowsar_run_saved_with_nested_keys_resumes_and_extends(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run, ignore=shutil.ignore_patterns("made_from.yaml"))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["algo"]["flowsar"]["lr"] == 1e-4 and "lr" not in saved["algo"]       # the old layout
    old = load_config(run / "config.yaml")
    assert (old.algo.lr, old.algo.temperature, old.algo.n_annotation_samples) == (1e-4, 1.0, 2)

    assert main(["train", "--resume", str(run), "train.iterations=3", "--no-tensorboard"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    # it counted chunks as env steps (12 an iteration: 6 x 2 envs); from the resume on, env steps are
    # robosuite steps (2 per chunk: its episodes of 10 steps run whole chunks) and chunks are counted
    assert rows[1]["env_steps"] == 2 * 12 and "chunks" not in rows[1]
    assert (rows[2]["env_steps"], rows[2]["chunks"]) == (3 * 24, 3 * 12)
    assert "this checkpoint counted action chunks as env steps: 24 chunks, counted from here as 48 env steps" \
        in capsys.readouterr().out
    assert rows[2]["flowsar/lr"] == pytest.approx(1e-4)
    assert json.loads((run / "summary.json").read_text())["iterations"] == 3
    resaved = yaml.safe_load((run / "config.yaml").read_text())        # now in today's layout
    assert "flowsar" not in resaved["algo"] and resaved["algo"]["lr"] == 1e-4
    assert resaved["algo"]["temperature"] == 1.0 and resaved["train"]["iterations"] == 3


@pytest.mark.slow
def test_a_gym_run_saved_with_the_robot_keys_resumes_and_extends(tmp_path, capsys, monkeypatch):
    from flowrl_ray.config import ROBOT_KEYS_BEFORE_SECTIONS
    from flowrl_ray.utils import TRUST_FILES_ENV
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "ppo_run_before_env_sections", run, ignore=shutil.ignore_patterns("made_from.yaml"))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert {k: saved["env"][k] for k in ROBOT_KEYS_BEFORE_SECTIONS} == ROBOT_KEYS_BEFORE_SECTIONS   # the old layout
    assert not hasattr(load_config(run / "config.yaml").env, "obs_mode")

    # its env snapshot pickled the vector env whole (gymnasium's classes, which loading would run):
    # refused in one line naming the class and the opt-in, the run left as it was
    before = {p.name: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    assert main(["train", "--resume", str(run), "train.iterations=3", "--no-tensorboard"]) == 2
    err = capsys.readouterr().err
    # (a "Traceback" of Ray's logging into an earlier test's closed capture may precede it: not ours)
    assert "RayTaskError" not in err and "_pickle.UnpicklingError" not in err, err
    assert "gymnasium.vector.sync_vector_env.SyncVectorEnv" in err.splitlines()[-1], err
    assert f"{TRUST_FILES_ENV}=1" in err.splitlines()[-1]
    assert {p.name: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before
    monkeypatch.setenv(TRUST_FILES_ENV, "1")          # the legacy opt-in: a run you made yourself
    assert main(["train", "--resume", str(run), "train.iterations=3", "--no-tensorboard"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3] and rows[2]["env_steps"] == 3 * 32
    resaved = yaml.safe_load((run / "config.yaml").read_text())
    assert set(resaved["env"]) == {"family", "id", "kwargs", "max_episode_steps", "horizon_steps", "act_steps"}
    assert resaved["train"]["iterations"] == 3
