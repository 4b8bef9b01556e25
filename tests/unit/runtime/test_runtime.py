"""What init_ray hands the local Ray it starts (ray.init replaced: no Ray starts)."""

import os

from conftest import tiny_config


def test_worker_niceness_reaches_the_local_ray_that_init_ray_starts(monkeypatch):
    # What the raylet reads when ray.init starts it; that Ray honours it is measured by
    # benchmarks/forms_rollout.py (it records the actors' nice value).
    from flowrl_ray.runtime import trainer
    seen = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_worker_niceness", "15")      # so that teardown restores the original
    monkeypatch.delenv("RAY_worker_niceness")
    monkeypatch.setattr(trainer.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(trainer.ray, "init", lambda **kw: seen.append(os.environ.get("RAY_worker_niceness")))
    monkeypatch.setattr(trainer.ray, "cluster_resources", lambda: {"CPU": 4.0})   # what the started Ray reports
    assert trainer.init_ray(tiny_config()) and seen == [None]          # Ray's own default
    assert trainer.init_ray(tiny_config("runtime.worker_niceness=0")) and seen == [None, "0"]
