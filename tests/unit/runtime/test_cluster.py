"""Which Ray a run uses (flowrl_ray.runtime.cluster): the address rule and the fit check, without
Ray. `flowrl-ray train` against a real `ray start --head` cluster: tests/e2e/test_cluster.py."""

from __future__ import annotations

import pytest

from flowrl_ray.cli import main
from flowrl_ray.config import ConfigError
from flowrl_ray.runtime.cluster import Capacity, Demand, fit, ray_address, run_demand
from conftest import PENDULUM, tiny_config

# --------------------------------------------------------------------------- the address rule

def test_address_precedence_config_over_env(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(tiny_config()) == (None, "")                           # a private local Ray
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert ray_address(tiny_config()) == ("10.0.0.5:6379", "RAY_ADDRESS")
    assert ray_address(tiny_config("runtime.ray_address=auto")) == ("auto", "runtime.ray_address")
    # "local" beats RAY_ADDRESS: a private Ray even inside a shell that points at a cluster
    assert ray_address(tiny_config("runtime.ray_address=local")) == ("local", "runtime.ray_address")


def test_bad_address_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match="runtime.ray_address.*'10.0.0.5'"):
        tiny_config("runtime.ray_address=10.0.0.5")                           # no port


def test_address_flag_wins_over_the_config_key(capsys):
    # The flag is applied after the config's keys: its (bad) value is the one reported, and
    # the run stops before Ray starts.
    rc = main(["train", str(PENDULUM), "runtime.ray_address=10.0.0.5:6379", "--address", "nowhere"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "runtime.ray_address" in err[0] and "'nowhere'" in err[0], err


def test_every_verb_that_starts_ray_takes_address():
    from flowrl_ray.cli import build_parser
    from flowrl_ray.runtime.cluster import with_address
    parser = build_parser()
    for argv in (["train", "c.yaml"], ["tune", "c.yaml"], ["compare", "c.yaml"], ["serve", "runs/x"]):
        assert parser.parse_args(argv + ["--address", "auto"]).address == "auto", argv
    cfg = tiny_config()
    assert with_address(cfg, None) is cfg                                   # serve: the run's own setting
    assert with_address(cfg, "ray://head:10001").runtime.ray_address == "ray://head:10001"
    with pytest.raises(ConfigError, match="runtime.ray_address"):
        with_address(cfg, "head")


# --------------------------------------------------------------------------- the fit check

def _ppo(workers: int, learner_gpus: float | None):
    cfg = tiny_config(f"runtime.num_workers={workers}")
    cfg.runtime.learner_num_gpus = learner_gpus
    return cfg


def test_fixed_cluster_refuses_what_it_can_never_hold():
    fixed = Capacity([{"CPU": 3.0, "GPU": 0.0}], node_types=None)            # `ray start --num-cpus 3`
    # learner 1 + 2 workers x 1 = 3 CPUs: fits exactly
    assert fit(run_demand(_ppo(2, None), 0.0), fixed) == ("ok", "")
    # learner 1 + 4 workers x 1 = 5 CPUs > 3
    verdict, why = fit(run_demand(_ppo(4, None), 0.0), fixed)
    assert verdict == "never" and "5 CPUs" in why and "at most 3" in why
    # a GPU learner on a cluster without GPUs: no node can ever hold it
    verdict, why = fit(run_demand(_ppo(1, 1.0), 0.0), fixed)
    assert verdict == "never" and "learner" in why
    # two nodes of 2 CPUs: 4 CPUs in all, but no single node holds a 3-CPU worker
    two = Capacity([{"CPU": 2.0}, {"CPU": 2.0}], node_types=None)
    verdict, why = fit([Demand("rollout worker", 3.0, 0.0, 1)], two)
    assert verdict == "never" and "rollout worker (3 CPU)" in why


def test_published_autoscaler_limits_decide():
    # An Anyscale job's shape: a 16-CPU head running now, a GPU group with min_nodes 0, max_nodes 1.
    head_only = [{"CPU": 16.0, "GPU": 0.0}]
    types = [{"CPU": 16.0, "GPU": 0.0, "max_count": 1}, {"CPU": 4.0, "GPU": 1.0, "max_count": 1}]
    cap = Capacity(head_only, types)
    # counted generously: the head now (16) + both types at their max (16 + 4)
    assert cap.at_most("GPU") == 1.0 and cap.at_most("CPU") == 36.0
    verdict, why = fit(run_demand(_ppo(10, None), cap.at_most("GPU")), cap)   # learner counts on the GPU
    assert verdict == "ok" and "grow it to 1 GPUs" in why
    verdict, why = fit(run_demand(_ppo(2, 2.0), 1.0), cap)                  # 2 GPUs > 1 node x 1
    assert verdict == "never" and "no node type has room for one learner (1 CPU + 2 GPU)" in why
    verdict, why = fit(run_demand(_ppo(40, 0.0), 0.0), cap)                 # 41 CPUs > 36
    assert verdict == "never" and "41 CPUs" in why and "at most 36" in why
    unbounded = Capacity(head_only, [{"CPU": 4.0, "GPU": 1.0, "max_count": -1}])
    assert fit(run_demand(_ppo(2, 4.0), 0.0), unbounded)[0] == "never"      # no node type has 4 GPUs
    assert fit([Demand("learner", 1.0, 1.0)] * 3, unbounded)[0] == "ok"


def test_unknown_autoscaler_warns_instead_of_refusing():
    cap = Capacity([{"CPU": 16.0, "GPU": 0.0}], node_types=[])   # an autoscaler that does not say
    verdict, why = fit(run_demand(_ppo(2, 1.0), 0.0), cap)
    assert verdict == "wait" and "learner" in why


def test_an_anyscale_cluster_is_never_taken_for_a_fixed_one(monkeypatch):
    from flowrl_ray.runtime import cluster
    monkeypatch.setenv("ANYSCALE_ARTIFACT_STORAGE", "s3://bucket/artifacts")
    assert cluster._no_autoscaler() is False            # decided before asking Ray anything


def test_a_learner_group_asks_for_every_rank():
    from flowrl_ray.runtime.cluster import required_cpus
    cfg = tiny_config("runtime.num_learners=4", "runtime.learner_num_gpus=1", "runtime.learner_num_cpus=2")
    assert required_cpus(cfg) == 4 * 2 + 2 * 1                      # 4 ranks, 2 rollout workers
    learner = run_demand(cfg, gpus_there=0)[0]
    assert (learner.count, learner.cpus, learner.gpus) == (4, 2, 1)
    one_4gpu_node = Capacity([{"CPU": 16.0, "GPU": 0.0}], [{"CPU": 48.0, "GPU": 4.0, "max_count": 1}])
    assert fit(run_demand(cfg, 0), one_4gpu_node)[0] == "ok"
    verdict, why = fit(run_demand(tiny_config("runtime.num_learners=5", "runtime.learner_num_gpus=1"), 0), one_4gpu_node)
    assert verdict == "never" and "asks for 5 GPUs; the cluster has at most 4" in why
