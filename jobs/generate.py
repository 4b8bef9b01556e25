"""Writes the Anyscale job YAMLs: for every config ``configs/<algorithm>/<name>.yaml`` a train job
``jobs/<algorithm>_<name>_train.yaml`` and an eval job ``jobs/<algorithm>_<name>_eval.yaml``.

    python jobs/generate.py            # (re)write every job file
    python jobs/generate.py --check    # exit 1 naming the job files that differ from what it writes

What a job runs comes from its config (the env family decides the steps before training: robot
demos and a pretrained base, an EDM, an SFT adapter; the paths are the config's file names on
/mnt/user_storage); what a config cannot say is in ``JOBS`` below: the cluster, the time limit, the
demonstrations' size and the pretraining's arguments. Edit the table or the config, never the YAMLs.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STORAGE = "/mnt/user_storage"        # Anyscale's per-user storage: it outlives the job's cluster
CLI = "python -m flowrl_ray.cli"     # the image has the dependencies; the code comes with working_dir


@dataclass(frozen=True)
class Cluster:
    head: str                        # head node: the driver and the rollout / scoring actors
    gpu_min_nodes: int               # 1: the GPU node is up at start, where the learner takes its GPU
    comment: str = ""                # why, for the YAML
    gpu_node: str = "g5.xlarge"      # the GPU node's instance type ...
    gpu_about: str = "1 x A10G"      # ... and what it holds


CLUSTERS = {
    # a CPU learner (runtime.learner_num_gpus=0): the GPU group stays at 0 nodes
    "cpu": Cluster("m5.2xlarge", 0, "8 vCPUs: the driver, the rollout workers and a CPU learner"),
    # gym on a GPU learner (runtime.learner_num_gpus=1)
    "gpu": Cluster("m5.2xlarge", 1, "8 vCPUs: the driver and the rollout workers; the learner on the GPU node"),
    # robosuite: 10 rollout workers on the CPUs, the learner on the GPU
    "robot": Cluster("c5.4xlarge", 1, "16 vCPUs: the driver and 10 rollout workers (robosuite on the CPU)"),
    # scoring actors (GFN2-xTB, Chromium) on the CPUs
    "scoring": Cluster("c5.4xlarge", 0, "16 vCPUs: the driver and the scoring actors"),
    "scoring_gpu": Cluster("c5.4xlarge", 1, "16 vCPUs: the driver and the scoring actors; the learner on the GPU node"),
    # robosuite on the CPUs, a learner group of 4 ranks on one 4-GPU node (runtime.num_learners=4)
    "robot_learner_group": Cluster("c5.4xlarge", 1, "16 vCPUs: the driver and 10 rollout workers (robosuite on the CPU)",
                                   "g5.12xlarge", "4 x A10G, one per learner rank"),
    "eval": Cluster("m5.2xlarge", 0, "evaluation runs in the driver"),
    "eval_scoring": Cluster("c5.4xlarge", 0, "evaluation scores in the driver's process pool"),
    "eval_gpu": Cluster("m5.2xlarge", 1, "evaluation samples from the model on the GPU node"),
}


@dataclass(frozen=True)
class Job:
    about: str                       # what the train job runs, one line
    cluster: str = "robot"           # CLUSTERS key of the train job
    eval_cluster: str = "eval"
    hours: float = 12                # train job's time limit
    eval_hours: float = 1
    learner_gpus: int | None = None  # runtime.learner_num_gpus on the train command (None: the config's)
    demos: int = 0                   # robot: scripted demonstrations made when the hdf5 is missing
    pretrain: str = ""               # arguments of the pretrain step (robot, molecules, forms SFT)
    copy_base: bool = False          # molecules: start the pretraining from the committed base
    eval_episodes: int = 50
    env_vars: dict = field(default_factory=dict)
    submit: str = ""                 # flags every `anyscale job submit` needs (a token)
    notes: tuple = ()                # extra header lines of the train job


HF = {"HF_HOME": f"{STORAGE}/huggingface"}
JOBS = {
    "ppo/pendulum": Job("train Gaussian PPO on Pendulum-v1", "cpu", hours=1, learner_gpus=0, eval_episodes=20,
                        eval_hours=0.5),
    "ppo/halfcheetah": Job("train Gaussian PPO on HalfCheetah-v5 (MuJoCo)", "gpu", hours=4, learner_gpus=1,
                           eval_episodes=20, eval_hours=0.5),
    "ppo/hopper": Job("train Gaussian PPO on Hopper-v5 (MuJoCo)", "gpu", hours=4, learner_gpus=1, eval_episodes=20,
                      eval_hours=0.5),
    "ppo/bipedalwalker": Job("train Gaussian PPO on BipedalWalker-v3 (Box2D)", "gpu", hours=6, learner_gpus=1,
                             eval_episodes=20, eval_hours=0.5),
    "cma_ppo/pendulum": Job("train CMA-PPO on Pendulum-v1", "cpu", hours=1, learner_gpus=0, eval_episodes=20,
                            eval_hours=0.5),
    "cma_ppo/halfcheetah": Job("train CMA-PPO on HalfCheetah-v5 (MuJoCo)", "gpu", hours=4, learner_gpus=1,
                               eval_episodes=20, eval_hours=0.5),
    "cma_ppo/bipedalwalker": Job("train CMA-PPO on BipedalWalker-v3 (Box2D)", "gpu", hours=6, learner_gpus=1,
                                 eval_episodes=20, eval_hours=0.5),
    "fpopp/lift_state": Job("FPO++ fine-tuning on robosuite Lift (low-dim state)", demos=100),
    "fpopp/can_state": Job("FPO++ fine-tuning on robosuite Can (low-dim state)", demos=200),
    "fpopp/square_state": Job("FPO++ fine-tuning on robosuite Square (low-dim state)", demos=200),
    "fpopp/lift_state_learner_group": Job("FPO++ fine-tuning on robosuite Lift (low-dim state) with its update on a "
                                          "learner group of 4 GPU ranks", "robot_learner_group", demos=100),
    "fpopp/lift_image": Job("FPO++ fine-tuning on robosuite Lift (agentview images)", demos=100),
    "fpopp/can_image": Job("FPO++ fine-tuning on robosuite Can (agentview images)", demos=200),
    "fpopp/square_image": Job("FPO++ fine-tuning on robosuite Square (agentview images)", demos=200),
    "fpopp/lift_state_quickstart": Job("the laptop-sized FPO++ Lift run (low-dim state, CPU only)",
                                       "cpu", hours=2, learner_gpus=0, demos=50, pretrain="--epochs 20"),
    "fpopp/can_state_quickstart": Job("the laptop-sized FPO++ Can run of `make run` (low-dim state, CPU only)", "cpu",
                                      hours=2, learner_gpus=0, demos=100, pretrain="--epochs 20"),
    "fpopp/can_state_long": Job("the FPO++ Can quickstart run for 300 iterations (low-dim state, CPU only)", "cpu",
                                hours=12, learner_gpus=0, demos=100, pretrain="--epochs 20"),
    "fpopp/square_state_quickstart": Job("the laptop-sized FPO++ Square run (low-dim state, CPU only)", "cpu",
                                         hours=2, learner_gpus=0, demos=100, pretrain="--epochs 20"),
    "fpopp/lift_image_quickstart": Job("the laptop-sized FPO++ Lift run from pixels (agentview 84 px, CPU only)",
                                       "cpu", hours=2, learner_gpus=0, demos=50, pretrain="--epochs 40"),
    "reinflow/lift_state": Job("ReinFlow fine-tuning on robosuite Lift (low-dim state)", demos=100),
    "reinflow/can_state": Job("ReinFlow fine-tuning on robosuite Can (low-dim state)", demos=200),
    "reinflow/can_state_grpo": Job("πRL's GRPO for flow policies on robosuite Can (the ReinFlow chain, start "
                                   "groups of 8, no critic)", demos=200),
    "reinflow/square_state": Job("ReinFlow fine-tuning on robosuite Square (low-dim state)", demos=200),
    "reinflow/lift_state_quickstart": Job("the laptop-sized ReinFlow Lift run on the FPO++ Lift quickstart's base (low-dim state, "
                                          "CPU only)", "cpu", hours=2, learner_gpus=0, demos=50, pretrain="--epochs 20"),
    "reinflow/can_state_quickstart": Job("the laptop-sized ReinFlow Can run on the FPO++ Can quickstart's base "
                                         "(low-dim state, CPU only)", "cpu", hours=2, learner_gpus=0, demos=100,
                                         pretrain="--epochs 20"),
    "flowsar/lift_state": Job("FlowSAR fine-tuning on robosuite Lift (low-dim state)", demos=100),
    "flowsar/can_state": Job("FlowSAR fine-tuning on robosuite Can (low-dim state)", demos=200),
    "flowsar/square_state": Job("FlowSAR fine-tuning on robosuite Square (low-dim state)", demos=200),
    "flowsar/lift_image": Job("FlowSAR fine-tuning on robosuite Lift (agentview images)", demos=100),
    "flowsar/lift_state_quickstart": Job("the laptop-sized FlowSAR Lift run (low-dim state, CPU only), from the same "
                                         "demos and base policy as FPO++'s quickstart", "cpu", hours=2,
                                         learner_gpus=0, demos=50, pretrain="--epochs 20"),
    "flowsar/can_state_quickstart": Job("the laptop-sized FlowSAR Can run (low-dim state, CPU only), on the FPO++ Can "
                                        "quickstart's base and at its env-step budget", "cpu", hours=2,
                                        learner_gpus=0, demos=100, pretrain="--epochs 20"),
    "flow_grpo/forms_small": Job(
        "Flow-GRPO on the browser forms benchmark with the small offline masked-diffusion model (CPU learner)",
        "scoring", learner_gpus=0, eval_episodes=64,
        notes=("Flow-GRPO starts from the committed SFT base pretrained/forms_small_sft (it travels with the",
               "working directory; the command that made it is in docs/results.md).")),
    "flow_grpo/forms_refusion": Job(
        "Flow-GRPO for ReFusion 8B with 4-bit QLoRA on the browser forms benchmark (learner on an A10G)",
        "scoring_gpu", eval_cluster="eval_gpu", pretrain="--epochs 2", eval_episodes=64, env_vars=HF,
        submit="--env HF_TOKEN=$HF_TOKEN",
        notes=("The weights come from the Hugging Face hub (algo.model.path: GSAI-ML/ReFusion), cached on",
               f"{STORAGE} (HF_HOME) so that a retry does not download them again; the token goes in at",
               "submission, never into this file. A local copy instead: append",
               f"algo.model.path={STORAGE}/models/ReFusion-8B to both commands.")),
    "fed_grpo/qm9_small": Job(
        "FED-GRPO on QM9 with the CPU-sized EDM (4 x 64 EGNN, 100 diffusion steps) and GFN2-xTB force-field actors",
        "scoring", hours=24, eval_cluster="eval_scoring", eval_hours=2, learner_gpus=0, eval_episodes=1000,
        pretrain="--steps 20000 --lr 3e-4 --curve-every 1000 --resume --eval-samples 1000",
        env_vars={"OMP_NUM_THREADS": "1"}),
    "fed_grpo/qm9_mid": Job(
        "FED-GRPO on QM9 with the mid-size EDM (6 x 128, 1000 diffusion steps) and ELIGN's QM9 paper settings",
        "scoring", hours=24, eval_cluster="eval_scoring", eval_hours=2, eval_episodes=1000, copy_base=True,
        pretrain="--steps 200000 --checkpoint-every 2000 --curve-every 10000 --resume --eval-samples 1000",
        env_vars={"OMP_NUM_THREADS": "1"}),
    "fed_grpo/qm9_edm_small": Job(
        "FED-GRPO on QM9 from a base trained by EDM's own code (5 x 128 EGNN with charges, 200 diffusion steps)",
        "scoring", hours=24, eval_cluster="eval_scoring", eval_hours=2, eval_episodes=1000, copy_base=True,
        env_vars={"OMP_NUM_THREADS": "1"}),
    "fed_grpo/qm9_mid_cpu": Job(
        "FED-GRPO on QM9 from the GPU base (6 x 128 EGNN, 1000 diffusion steps), sized for a laptop (2 x 8 molecules)",
        "scoring", hours=24, eval_cluster="eval_scoring", eval_hours=2, eval_episodes=1000, copy_base=True,
        env_vars={"OMP_NUM_THREADS": "1"}),
    "fed_grpo/qm9_edm": Job(
        "FED-GRPO on QM9 at EDM's full size (9 x 256, 1000 diffusion steps) with ELIGN's QM9 paper settings",
        "scoring", hours=24, eval_cluster="eval_scoring", eval_hours=2, eval_episodes=1000,
        pretrain="--steps 500000 --curve-every 10000 --resume --eval-samples 1000",
        env_vars={"OMP_NUM_THREADS": "1"}),
}

def _stem(key: str) -> str:
    return key.replace("/", "_")


def _dashed(key: str) -> str:
    return key.replace("/", "-").replace("_", "-")


def _env_tag(cfg) -> str:
    if cfg.env.family == "gym":
        return cfg.env.id.split("-v")[0].lower()
    return cfg.env.id if cfg.env.family == "robot" else cfg.env.family


def _env_vars(cfg, job: Job) -> dict:
    from flowrl_ray.envs import env_family
    family = env_family(cfg.env.family)          # what its envs need (MuJoCo's EGL renderer)
    out = {"PYTHONUNBUFFERED": "1", **getattr(family, "job_env_vars", lambda env_cfg: {})(cfg.env)}
    return {**out, **job.env_vars}


def _storage(path: str, kind: str) -> str:
    return f"{STORAGE}/{kind}/{Path(path).name}"


def train_steps(key: str, cfg, job: Job) -> tuple[list[str], list[str], list[str]]:
    """(shell lines, train overrides, header lines): what runs before training, and the overrides
    that point training at what those steps made."""
    config = f"configs/{key}.yaml"
    family, lines, overrides, header = cfg.env.family, [], [], []
    if family == "robot":
        cams = f" --cameras {' '.join(cfg.env.cameras)} --image-size {cfg.env.image_size}" \
            if cfg.env.obs_mode == "image" else ""
        lines += [f"DATA={_storage(cfg.env.dataset, 'demos')}", f"BASE={_storage(cfg.algo.base_policy, 'pretrained')}",
                  f'[ -f "$DATA" ] || {CLI} demos {cfg.env.id} --episodes {job.demos}{cams} --out "$DATA"',
                  (f'[ -f "$BASE" ] || {CLI} pretrain {config} env.dataset=$DATA '
                   f'{job.pretrain + " " if job.pretrain else ""}--out "$BASE"')]
        overrides += ["env.dataset=$DATA", "algo.base_policy=$BASE"]
        header += ["First run: scripted demonstrations and the pretrained flow policy are made once on",
                   f"{STORAGE} (skipped when they exist; put a real robomimic hdf5 at DATA to use it), then",
                   "the run fine-tunes. A retry (or a second submit) resumes it from its last checkpoint."]
    elif family == "molecules":
        lines.append(f"BASE={_storage(cfg.algo.base_model, 'pretrained')}")
        if job.copy_base:
            lines += ['mkdir -p "$(dirname "$BASE")"', f'test -f "$BASE" || cp {cfg.algo.base_model} "$BASE"']
        if job.pretrain:
            lines.append(f'{CLI} pretrain {config} {job.pretrain} --out "$BASE"')
        overrides.append("algo.base_model=$BASE")
        if not job.pretrain:
            header += [f"First run: the committed base ({cfg.algo.base_model}; where it comes from: docs/results.md,",
                       f"Molecules) is copied to {STORAGE}, then FED-GRPO post-trains it. A retry resumes the run."]
        else:
            start = (f"the committed base ({cfg.algo.base_model}, with its training state) is copied to {STORAGE} "
                     "and its pretraining continues" if job.copy_base else
                     f"the EDM is pretrained on QM9 on {STORAGE} (QM9 comes from the qm9pack package)")
            header += [f"First run: {start} ({job.pretrain}; a retry continues it and keeps a finished one),",
                       "then FED-GRPO post-trains it. A retry resumes the run."]
    elif family == "forms" and job.pretrain:
        lines += [f"SFT={_storage(cfg.algo.sft_checkpoint, 'pretrained')}",
                  f'[ -d "$SFT" ] || {CLI} pretrain {config} {job.pretrain} --out "$SFT"']
        overrides.append("algo.sft_checkpoint=$SFT")
        header += [f"First run: the masked-diffusion SFT adapter is made once on {STORAGE} (skipped when it",
                   "exists), then Flow-GRPO trains with headless Chromium scoring actors. A retry resumes the run."]
    else:
        header += [f"The run directory is on {STORAGE}, which outlives the job's cluster; a retry (or a",
                   "second submit) resumes it from its last checkpoint instead of starting over."]
    if job.learner_gpus is not None:
        overrides.append(f"runtime.learner_num_gpus={job.learner_gpus}")
    return lines, overrides, header


def _text(header: list[str], name: str, statements: list[str], cfg, job: Job, cluster: str, retries: int,
          hours: float, key: str) -> str:
    """The job YAML: a comment header, then Anyscale's JobConfig fields. The entrypoint is a folded
    block, one shell statement per line (read back as one line)."""
    c = CLUSTERS[cluster]
    head = "".join(f"# {line}\n" for h in header for line in textwrap.wrap(h, 100, break_on_hyphens=False,
                                                                            break_long_words=False))
    entry = statements[0] if len(statements) == 1 else \
        ">-\n" + ";\n".join(f"  {s}" for s in statements)
    env = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in _env_vars(cfg, job).items())
    return (head + f"name: {name}\nentrypoint: {entry}\n"
            "containerfile: containers/Containerfile\nworking_dir: .\nexcludes:\n"
            + "".join(f"  - {x}\n" for x in (".venv", "runs", ".git", "benchmarks/results", "__pycache__"))
            + f"env_vars:\n{env}"
            f"compute_config:\n  head_node:\n    instance_type: {c.head:<14} # {c.comment}\n"
            f"  worker_nodes:\n    - name: gpu\n      instance_type: {c.gpu_node:<13} # {c.gpu_about}"
            f"{'; up from the start' if c.gpu_min_nodes else ''}\n"
            f"      min_nodes: {c.gpu_min_nodes}\n      max_nodes: 1\n"
            f"max_retries: {retries}\ntimeout_s: {int(hours * 3600)}\n"
            f"tags:\n  project: flowrl-ray\n  algorithm: {key.split('/')[0]}\n  env: {_env_tag(cfg)}\n")


def render(key: str) -> dict[str, str]:
    """{file name: text} of the train and eval jobs of ``configs/<key>.yaml``."""
    from flowrl_ray.config import load_config
    cfg, job = load_config(REPO / "configs" / f"{key}.yaml"), JOBS[key]
    stem, run_dir = _stem(key), f"{STORAGE}/runs/{_dashed(key)}"
    lines, overrides, header = train_steps(key, cfg, job)
    train_cmd = (f'{CLI} train configs/{key}.yaml --run-dir "$RUN_DIR" --resume-if-exists'
                 + "".join(f" {o}" for o in overrides))
    statements = ([] if not lines else ["set -e"]) + [f"RUN_DIR={run_dir}", *lines, train_cmd]
    submit = f"  anyscale job submit -f jobs/{stem}_{{}}.yaml{' ' + job.submit if job.submit else ''}"
    gen = f"Written by `python jobs/generate.py` from configs/{key}.yaml and its JOBS entry: edit those."
    train_header = [f"Anyscale job: {job.about}.", submit.format("train"), *header, *job.notes, gen]
    what = {"robot": f"{job.eval_episodes} episodes, {cfg.eval.sampling}-sampling; success rate as JSON",
            "gym": f"{job.eval_episodes} episodes, the deterministic policy; return statistics as JSON",
            "forms": "held-out tasks, new values on training forms and forms never trained on; task "
                     "completion, field accuracy and mean reward as JSON",
            "molecules": f"{job.eval_episodes} sampled molecules: GFN2-xTB energy and RMS force, atom and molecule "
                         "stability, RDKit validity and uniqueness as JSON"}[cfg.env.family]
    sampling = f" --sampling {cfg.eval.sampling}" if cfg.env.family == "robot" else ""
    eval_cmd = f"{CLI} eval {run_dir} --episodes {job.eval_episodes}{sampling}"
    eval_header = [f"Anyscale job: evaluate the latest checkpoint of jobs/{stem}_train.yaml's run ({what}).",
                   submit.format("eval"), gen]
    train = _text(train_header, f"flowrl-{_dashed(key)}-train", statements, cfg, job, job.cluster, 2, job.hours, key)
    eval_ = _text(eval_header, f"flowrl-{_dashed(key)}-eval", [eval_cmd], cfg, job, job.eval_cluster, 1,
                  job.eval_hours, key)
    return {f"{stem}_train.yaml": train, f"{stem}_eval.yaml": eval_}


def config_keys() -> list[str]:
    return sorted(f"{p.parent.name}/{p.stem}" for p in (REPO / "configs").glob("*/*.yaml"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a job file would change")
    p.add_argument("--out", default=str(REPO / "jobs"), help="where the job files go")
    args = p.parse_args(argv)
    missing = [k for k in config_keys() if k not in JOBS]
    unknown = [k for k in JOBS if k not in config_keys()]
    if missing or unknown:
        print(f"error: configs without a JOBS entry: {missing}; JOBS entries without a config: {unknown}",
              file=sys.stderr)
        return 2
    out, stale = Path(args.out), []
    wanted = {name: text for key in config_keys() for name, text in render(key).items()}
    for name, text in wanted.items():
        path = out / name
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(text)
    extra = sorted(p.name for p in out.glob("*_train.yaml") if p.name not in wanted) + \
        sorted(p.name for p in out.glob("*_eval.yaml") if p.name not in wanted)
    if args.check:
        if stale or extra:
            print(f"job files out of date (run `python jobs/generate.py`): {', '.join(stale + extra)}",
                  file=sys.stderr)
            return 1
        return 0
    for name in extra:
        (out / name).unlink()
    print(f"{len(wanted)} job files; {len(stale)} written, {len(extra)} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
