"""Anyscale job YAMLs: they load with the anyscale SDK's own model (offline), their entrypoints
are valid `flowrl-ray` commands on existing configs, and the Containerfile matches pyproject."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from conftest import REPO

JOBS = sorted((REPO / "jobs").glob("*.yaml"))
CLI_PREFIXES = (["flowrl-ray"], ["python", "-m", "flowrl_ray.cli"])
SHELL_WORDS = {";", "if", "then", "else", "fi", "[", "]", "&&", "||"}


def _commands(entrypoint: str) -> list[list[str]]:
    """Every flowrl-ray command in a (possibly compound) shell entrypoint, as argument lists
    after the verb's program name, with `$RUN_DIR`-style variables substituted."""
    vars_ = dict(re.findall(r"\b([A-Z_]+)=(\S+?);", entrypoint))
    text = re.sub(r"\$([A-Z_]+)", lambda m: vars_.get(m.group(1), m.group(0)), entrypoint)
    tokens = shlex.split(text.replace(";", " ; "))
    found = []
    for i in range(len(tokens)):
        for prefix in CLI_PREFIXES:
            if tokens[i:i + len(prefix)] == prefix:
                args = []
                for tok in tokens[i + len(prefix):]:
                    if tok in SHELL_WORDS:
                        break
                    args.append(tok)
                found.append(args)
    return found


def _load(path: Path):
    from anyscale.job.models import JobConfig
    return JobConfig.from_yaml(str(path))


def test_every_config_has_train_and_eval_jobs():
    names = {p.name for p in JOBS}
    configs = sorted((REPO / "configs").glob("*/*.yaml"))
    assert configs
    for cfg in configs:
        stem = f"{cfg.parent.name}_{cfg.stem}"
        assert {f"{stem}_train.yaml", f"{stem}_eval.yaml"} <= names, stem


@pytest.mark.parametrize("path", JOBS, ids=[p.name for p in JOBS])
def test_job_yaml(path):
    from anyscale.compute_config.models import ComputeConfig

    from flowrl_ray.cli import build_parser
    from flowrl_ray.config import load_config

    job = _load(path)
    assert job.name and job.name.startswith("flowrl-")
    assert job.working_dir == "."
    assert (REPO / job.containerfile).is_file()
    assert {".venv", "runs", ".git", "benchmarks/results"} <= set(job.excludes)
    assert job.env_vars and all(isinstance(v, str) for v in job.env_vars.values())
    assert isinstance(job.max_retries, int) and job.max_retries >= 0
    assert isinstance(job.timeout_s, int) and job.timeout_s > 0

    cc = job.compute_config
    assert isinstance(cc, ComputeConfig)
    assert cc.head_node.instance_type
    gpu_groups = [g for g in cc.worker_nodes if re.match(r"(g4dn|g5|g6|p3|p4d|p5)\.", g.instance_type)]
    assert gpu_groups, "a GPU worker group"
    assert all(0 <= g.min_nodes <= g.max_nodes for g in cc.worker_nodes)

    # The entrypoint is valid shell, and every flowrl-ray command in it parses with the real CLI
    subprocess.run(["sh", "-n", "-c", job.entrypoint], check=True)
    # A re-launch runs the same command (`--resume-if-exists` decides): no shell `if` around it
    assert not {"if", "then", "else", "fi"} & set(shlex.split(job.entrypoint.replace(";", " ; "))), job.entrypoint
    commands = _commands(job.entrypoint)
    assert commands, f"no flowrl-ray command in {job.entrypoint!r}"
    parser = build_parser()
    verb = "train" if path.stem.endswith("_train") else "eval"
    # a train job may first make its demonstrations and pretrained policy (FPO++)
    allowed = {"train", "demos", "pretrain"} if verb == "train" else {"eval"}
    assert verb in [args[0] for args in commands]
    for args in commands:
        assert args[0] in allowed, args
        parsed, extra = parser.parse_known_args(args)
        assert not [x for x in extra if "=" not in x], extra
        if args[0] == "pretrain":
            assert (REPO / parsed.config).is_file(), parsed.config
            load_config(REPO / parsed.config, parsed.overrides)
            assert parsed.out.startswith("/mnt/user_storage/")
        if args[0] == "demos":
            assert parsed.out.startswith("/mnt/user_storage/") and parsed.episodes > 0
        if args[0] != verb:
            continue
        if verb == "train":
            # the config exists (relative to working_dir) and is valid; the run is resumed when
            # it exists (a retry after a preemption, a second submit) and started otherwise
            assert parsed.config and (REPO / parsed.config).is_file(), parsed.config
            load_config(REPO / parsed.config, parsed.overrides)
            assert parsed.run_dir and parsed.run_dir.startswith("/mnt/user_storage/")
            assert parsed.resume_if_exists and not parsed.resume, args
        if verb == "eval":
            assert parsed.episodes > 0 and parsed.run_dir.startswith("/mnt/user_storage/")


@pytest.mark.parametrize("train", [p for p in JOBS if p.stem.endswith("_train")],
                         ids=[p.name for p in JOBS if p.stem.endswith("_train")])
def test_eval_job_reads_the_train_jobs_run(train):
    from flowrl_ray.cli import build_parser
    parser = build_parser()
    eval_path = train.with_name(train.name.replace("_train", "_eval"))
    train_cmds = [parser.parse_known_args(a)[0] for a in _commands(_load(train).entrypoint) if a[0] == "train"]
    (eval_cmd,) = [parser.parse_known_args(a)[0] for a in _commands(_load(eval_path).entrypoint)]
    (train_cmd,) = train_cmds          # one command starts the run and resumes it when it exists
    assert train_cmd.resume_if_exists and train_cmd.run_dir == eval_cmd.run_dir


def test_every_train_job_relaunches_with_resume_if_exists():
    """All of them (23 when this was written), each with exactly one train command."""
    trains = [p for p in JOBS if p.stem.endswith("_train")]
    assert len(trains) >= 23
    for path in trains:
        commands = [a for a in _commands(_load(path).entrypoint) if a[0] == "train"]
        assert len(commands) == 1 and "--resume-if-exists" in commands[0] and "--resume" not in commands[0], path.name


def test_containerfile_matches_pyproject():
    text = (REPO / "containers" / "Containerfile").read_text()
    assert re.search(r"^FROM rayproject/ray:2\.60\.0-py311-gpu\s*$", text, re.M)
    assert re.search(r"apt-get install .*\bswig\b", text)
    assert "libosmesa6" in text and "libegl1" in text        # robosuite cameras rendered on the CPU
    # the forms family's browser: Playwright's own Chromium (tests/unit/test_container.py: not apt's)
    assert re.search(r"^RUN python -m playwright install --with-deps chromium\b", text, re.M)
    pins = set(re.findall(r'"([A-Za-z0-9_.\-\[\],]+(?:[<>=!]=?[^"]*)?)"', text))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    deps = project["dependencies"] + extras["robot"] + extras["forms"] + extras["text"] + extras["mol"] + extras["tracking"]
    missing = [d for d in deps if d not in pins]
    assert not missing, f"Containerfile lacks pyproject pins: {missing}"
    assert re.search(r"^WORKDIR ", text, re.M)


def test_readme_documents_both_ways():
    readme = (REPO / "jobs" / "README.md").read_text()
    assert "anyscale job submit -f jobs/" in readme
    assert "ray job submit" in readme and "--working-dir ." in readme
    assert "RAY_AUTH_MODE=token" in readme and "~/.ray/auth_token" in readme
    for path in JOBS:
        assert path.name in readme, path.name


def test_job_files_are_what_the_generator_writes(tmp_path, capsys):
    """jobs/*.yaml are written by jobs/generate.py from the configs: the committed files are its
    output, and its check catches a hand edit and a job whose config is gone."""
    import sys
    sys.path.insert(0, str(REPO / "jobs"))
    import generate
    assert generate.main(["--check"]) == 0, capsys.readouterr().err
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.yaml")) == [p.name for p in JOBS]
    assert all((tmp_path / p.name).read_text() == p.read_text() for p in JOBS)
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    edited = tmp_path / "ppo_pendulum_train.yaml"
    edited.write_text(edited.read_text().replace("timeout_s: 3600", "timeout_s: 60"))
    (tmp_path / "gone_config_train.yaml").write_text("name: flowrl-gone\n")
    capsys.readouterr()
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "ppo_pendulum_train.yaml" in err and "gone_config_train.yaml" in err and "ppo_hopper" not in err
    assert generate.main(["--out", str(tmp_path)]) == 0                  # rewrites one, removes the stray
    assert not (tmp_path / "gone_config_train.yaml").exists() and "timeout_s: 3600" in edited.read_text()


def test_each_env_family_says_what_its_jobs_need_and_the_jobs_carry_it():
    from flowrl_ray.config import EnvConfig
    from flowrl_ray.envs import env_family
    gym_family, robot = env_family("gym"), env_family("robot")
    assert gym_family.job_env_vars(EnvConfig(id="HalfCheetah-v5")) == {"MUJOCO_GL": "egl"}    # a MuJoCo entry point
    assert gym_family.job_env_vars(EnvConfig(id="InvertedDoublePendulum-v5")) == {"MUJOCO_GL": "egl"}
    assert gym_family.job_env_vars(EnvConfig(id="Pendulum-v1")) == {}                           # classic control
    assert gym_family.job_env_vars(EnvConfig(id="BipedalWalker-v3")) == {}                      # Box2D
    assert gym_family.job_env_vars(EnvConfig(id="NotRegistered-v0")) == {}
    assert robot.job_env_vars(robot.RobotEnvConfig(id="lift")) == {"MUJOCO_GL": "egl"}
    assert not hasattr(env_family("forms"), "job_env_vars")                                      # a browser: nothing
    jobs = REPO / "jobs"
    assert "MUJOCO_GL" in (jobs / "ppo_halfcheetah_train.yaml").read_text()
    assert "MUJOCO_GL" in (jobs / "fpopp_lift_state_train.yaml").read_text()
    assert "MUJOCO_GL" not in (jobs / "ppo_pendulum_train.yaml").read_text()
