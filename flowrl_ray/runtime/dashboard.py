"""The run on the Ray dashboard: `ray_flowrl_*` gauges that stay on the node's Prometheus endpoint
(the one the dashboard's Grafana reads) for the run's whole lifetime, tagged run / algorithm / env.

Why a gauge set once per iteration disappears (Ray 2.60):
  - `ray.util.metrics.Gauge.set` records the value in this process's core worker. Every
    `metrics_report_interval_ms` (10 s by default, never under 1 s) the core worker exports the
    values set since its last export to the node's metrics agent, once: a value that is not set
    again is not exported again (measured: a gauge set once appears on the endpoint at the next
    export and leaves it 20 s later, although the core worker keeps exporting every 10 s).
  - The agent (`ray/_private/telemetry/open_telemetry_metric_recorder.py`, the scrape callback of
    `register_gauge_metric`) evicts a gauge series that was not refreshed within
    `2 * max(metrics_report_interval_ms, 1000) / 1000` s (20 s by default) on each scrape.
  So a gauge is on the endpoint for 20-30 s after each set and absent until the next one: most of
  a 75-s iteration, and all of a long evaluation. Both intervals follow
  `RAY_metrics_report_interval_ms` when it is set before Ray starts (tests: 1 s export, 2 s eviction).

`RunGauges` therefore keeps the last value of every gauge and sets it again every half report
interval from a daemon thread of the driver, so every export carries every series. Ray has no call
that deletes a series: `close()` sets `flowrl_run_active` to 0 and stops the timer, and all the
run's series then leave the endpoint within one report interval plus the agent's 20 s. The last
values are exported even when `ray.shutdown()` follows at once (measured on a `ray start --head`
cluster: `run_active 0` on the endpoint right after the driver disconnected, gone 20 s later).
"""

from __future__ import annotations

import math
import re
import sys
import threading

#: iteration-row keys shown on the dashboard (plus every eval/* key); the rest stay in jsonl/TensorBoard
DASHBOARD_KEYS = ("iteration", "episode_return_mean", "env_steps", "env_steps_per_s", "policy_version",
                  "worker_restarts", "dropped_batches", "learner/update_time_s")
TAG_KEYS = ("run", "algorithm", "env")
ACTIVE = "flowrl_run_active"      # 1 while the run lives, 0 once it has ended


def gauge_name(key: str) -> str:
    """Metric name of a row key: 'eval/return_mean' -> 'flowrl_eval_return_mean' (Ray adds 'ray_')."""
    return "flowrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def republish_period_s() -> float:
    """Half the core worker's export interval (seconds), so every export carries each series."""
    import ray
    try:
        interval_ms = ray._config.metrics_report_interval_ms()
    except Exception:  # noqa: BLE001 - a private accessor; Ray's default then
        interval_ms = 10_000
    return max(0.5, interval_ms / 2000)


def metrics_endpoint() -> str | None:
    """This node's Prometheus endpoint, where the driver's gauges appear (the port the raylet also
    writes to `metrics_export_port_<node id>` in the session directory); None if unknown."""
    import ray
    try:
        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
                return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    except Exception:  # noqa: BLE001 - only informative
        pass
    return None


class RunGauges:
    """The run's dashboard gauges, re-published on a timer until `close()`.

    update(row) takes an iteration's metrics row; values are kept and set again every `period_s`
    seconds (default: half of Ray's metrics report interval, 5 s). A failing metrics system turns
    the gauges off with one line on stderr; it never stops the run.
    """

    def __init__(self, run: str, algorithm: str, env: str, period_s: float | None = None):
        self.tags = {"run": str(run), "algorithm": str(algorithm), "env": str(env)}
        self.period_s = period_s if period_s is not None else republish_period_s()
        self._values: dict[str, float] = {ACTIVE: 1.0}      # gauge name -> last value
        self._gauges: dict = {}                               # gauge name -> ray Gauge
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._failed = False
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="flowrl-dashboard-gauges", daemon=True)
        self._thread.start()

    def update(self, row: dict) -> None:
        with self._lock:
            for k, v in row.items():
                if (k in DASHBOARD_KEYS or k.startswith("eval/")) and isinstance(v, (int, float)) \
                        and not isinstance(v, bool) and math.isfinite(v):
                    self._values[gauge_name(k)] = float(v)
        self._publish()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._publish()

    def _publish(self) -> None:
        with self._lock:
            if self._failed:
                return
            try:
                from ray.util.metrics import Gauge
                for name, value in self._values.items():
                    if name not in self._gauges:
                        about = "1 while the run lives, 0 once it has ended" if name == ACTIVE \
                            else f"flowrl_ray {name[len('flowrl_'):]}, last iteration's value"
                        self._gauges[name] = Gauge(name, description=about, tag_keys=TAG_KEYS)
                    self._gauges[name].set(value, tags=self.tags)
            except Exception as e:  # noqa: BLE001 - dashboard metrics must not fail a run
                self._failed = True
                print(f"Ray dashboard metrics are off for this run: {e}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop re-publishing and mark the run finished (flowrl_run_active 0)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self._values[ACTIVE] = 0.0
        self._publish()
