"""The run's `ray_flowrl_*` gauges stay on the node's Prometheus endpoint for the run's whole life.

A private local Ray runs with `metrics_report_interval_ms=1000` (set as RAY_metrics_report_interval_ms
before it starts, so the core workers and the metrics agent all read it): the core worker exports
every 1 s and the agent evicts a gauge not refreshed for 2 s, so a gauge set once leaves the
endpoint about 3 s later (the same mechanics as the default 10 s / 20 s; see runtime/dashboard.py).
Each test scrapes the endpoint, found from the node table the way the dashboard's Prometheus
discovery does, every 0.5 s for longer than that expiry.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request

import pytest

from conftest import tiny_config

REPORT_INTERVAL_MS = 1000
EXPIRY_S = 3.0            # export (<= 1 s) + agent TTL (2 x 1 s)
SCRAPE_EVERY_S = 0.5

_LINE = re.compile(r"^(ray_flowrl_\w+)\{(.*)\}\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def metrics_ray():
    import ray
    old = os.environ.get("RAY_metrics_report_interval_ms")
    os.environ["RAY_metrics_report_interval_ms"] = str(REPORT_INTERVAL_MS)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        from flowrl_ray.runtime.dashboard import metrics_endpoint
        url = metrics_endpoint()
        assert url and url.startswith("http://") and url.endswith("/metrics"), url
        yield url
    finally:
        ray.shutdown()
        if old is None:
            os.environ.pop("RAY_metrics_report_interval_ms", None)
        else:
            os.environ["RAY_metrics_report_interval_ms"] = old


def scrape(url: str, run: str) -> dict[str, tuple[float, dict]]:
    """{metric name: (value, labels)} of the ray_flowrl_* series tagged run=`run`."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            labels = dict(_LABEL.findall(m.group(2)))
            if labels.get("run") == run:
                out[m.group(1)] = (float(m.group(3)), labels)
    return out


def wait_for(url: str, run: str, predicate, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        series = scrape(url, run)
        if predicate(series):
            return series
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen within {timeout} s; last scrape: {series}")
        time.sleep(SCRAPE_EVERY_S)


def test_gauges_stay_without_new_values_and_leave_after_close(metrics_ray):
    from ray.util.metrics import Gauge
    from flowrl_ray.runtime.dashboard import RunGauges

    url = metrics_ray
    # The control: a plain gauge set once, the way each iteration used to set them.
    Gauge("flowrl_probe_once", tag_keys=("run",)).set(7.0, tags={"run": "idle-run"})
    gauges = RunGauges("idle-run", "ppo", "Pendulum-v1")
    assert gauges.period_s == pytest.approx(0.5)           # half the 1 s report interval
    gauges.update({"iteration": 3, "episode_return_mean": -512.5, "eval/return_mean": -400.25,
                   "learner/update_time_s": 1.5, "episodes": 12, "env_steps_per_s": float("nan")})
    expected = {"ray_flowrl_run_active": 1.0, "ray_flowrl_iteration": 3.0,
                "ray_flowrl_episode_return_mean": -512.5, "ray_flowrl_eval_return_mean": -400.25,
                "ray_flowrl_learner_update_time_s": 1.5}
    wait_for(url, "idle-run", lambda s: "ray_flowrl_run_active" in s, timeout=EXPIRY_S + 2)

    # No new values for 3x the expiry: every scrape still shows every gauge with its tags.
    scrapes, t_end = 0, time.monotonic() + 3 * EXPIRY_S
    while time.monotonic() < t_end:
        series = scrape(url, "idle-run")
        assert {k: v for k, (v, _) in series.items() if k in expected} == expected, series
        for name in expected:
            labels = series[name][1]
            assert labels["algorithm"] == "ppo" and labels["env"] == "Pendulum-v1"
        assert "ray_flowrl_episodes" not in series            # not a dashboard key
        assert "ray_flowrl_env_steps_per_s" not in series     # NaN is not published
        scrapes += 1
        time.sleep(SCRAPE_EVERY_S)
    assert scrapes >= 12
    assert "ray_flowrl_probe_once" not in series          # the set-once gauge has expired meanwhile

    gauges.close()
    wait_for(url, "idle-run", lambda s: s.get("ray_flowrl_run_active", (None,))[0] == 0.0,
             timeout=EXPIRY_S + 2)
    wait_for(url, "idle-run", lambda s: not s, timeout=2 * EXPIRY_S + 2)    # every series gone


def test_trainer_run_with_slow_iterations_is_on_every_scrape(metrics_ray, tmp_path):
    """A real PPO Pendulum run whose learner updates take 4 s (> the 3 s expiry)."""
    from flowrl_ray.runtime.trainer import Trainer

    url = metrics_ray
    cfg = tiny_config("name=gauge-run", "train.iterations=2", "runtime.num_workers=1")
    seen, stop, errors = [], threading.Event(), []

    def scraper():
        try:
            wait_for(url, "gauge-run", lambda s: "ray_flowrl_run_active" in s, timeout=30)
            while not stop.is_set():
                seen.append(scrape(url, "gauge-run"))
                time.sleep(SCRAPE_EVERY_S)
        except Exception as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    class SlowUpdateTrainer(Trainer):
        def _learner_call(self, method, *args):
            if method == "update":
                time.sleep(EXPIRY_S + 1)
            return super()._learner_call(method, *args)

        def _finish(self):      # scraping ends as the run ends, after the last row's export
            time.sleep(REPORT_INTERVAL_MS / 1000 + 2 * SCRAPE_EVERY_S)
            stop.set()
            return super()._finish()

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    summary = _run(SlowUpdateTrainer, cfg, tmp_path / "run")
    thread.join(timeout=10)
    assert not errors, errors
    assert summary["iterations"] == 2
    assert len(seen) >= 12, len(seen)                     # >= 6 s of the run scraped
    for series in seen:
        assert series.get("ray_flowrl_run_active", (None,))[0] == 1.0, series
        labels = series["ray_flowrl_run_active"][1]
        assert (labels["algorithm"], labels["env"]) == ("ppo", "Pendulum-v1")
    iterations = [s["ray_flowrl_iteration"][0] for s in seen if "ray_flowrl_iteration" in s]
    assert iterations and iterations[-1] == 2.0 and iterations == sorted(iterations)
    # from the first iteration's row on, its gauges stay on every scrape
    first = next(i for i, s in enumerate(seen) if "ray_flowrl_iteration" in s)
    assert all("ray_flowrl_env_steps" in s and "ray_flowrl_policy_version" in s for s in seen[first:])
    # closed: the run is marked finished
    wait_for(url, "gauge-run", lambda s: s.get("ray_flowrl_run_active", (None,))[0] == 0.0,
             timeout=EXPIRY_S + 2)


def _run(trainer_cls, cfg, run_dir) -> dict:
    trainer = trainer_cls(cfg, run_dir, quiet=True)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()
