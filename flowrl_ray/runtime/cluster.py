"""Which Ray a run uses, and whether the run can fit on it.

The rule, for every verb that starts Ray (train, tune, compare, serve):

    address = --address ADDR  >  runtime.ray_address  >  $RAY_ADDRESS      (the first one set)
    address set (and not "local")  -> connect to that cluster; Ray is given no num_cpus/num_gpus.
                                      "auto" means the cluster `ray start` last started on this
                                      machine (Ray reads its record under the Ray temp dir).
    otherwise, or "local"          -> start a private local Ray for this run, even when another
                                      cluster runs on the machine.

The first line printed says which one was used. On a cluster, the run's demand (learner + rollout
workers, in CPUs and GPUs) is compared with what the cluster has and what an autoscaler could add:
  - the autoscaler publishes its node types (KubeRay, Anyscale, `ray up`): their max counts bound
    the cluster, and a run beyond that bound stops with one line;
  - no autoscaler manages the cluster (a `ray start` cluster: no autoscaler has reported to Ray,
    and every node is its own read-only node type): the nodes there now are all there is, and a
    run beyond them stops with one line;
  - otherwise the bound cannot be known: a run beyond the current nodes starts with a warning
    (an autoscaler may add the nodes it waits for).
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from dataclasses import dataclass

import ray

from flowrl_ray.config import Config, ConfigError

CONNECT_PROBE_S = 5.0     # seconds a cluster's address gets to accept a TCP connection


def required_cpus(cfg: Config) -> float:
    rt = cfg.runtime
    return rt.num_learners * rt.learner_num_cpus + rt.num_workers * rt.num_cpus_per_worker


def learner_gpus(cfg: Config, gpus_there: float) -> float:
    """GPUs the learner asks for: runtime.learner_num_gpus, or (None) 1 if the cluster has one."""
    gpus = cfg.runtime.learner_num_gpus
    if gpus is None:
        gpus = 1.0 if gpus_there >= 1 else 0.0
    return gpus


def ray_address(cfg: Config) -> tuple[str | None, str]:
    """(address, where it came from): runtime.ray_address (which --address sets), else
    $RAY_ADDRESS, else (None, "") for a private local Ray."""
    if cfg.runtime.ray_address:
        return cfg.runtime.ray_address, "runtime.ray_address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    return None, ""


# --------------------------------------------------------------------------- fitting

@dataclass(frozen=True)
class Demand:
    """One kind of actor's resources: `count` learner ranks, or `count` identical rollout workers."""
    what: str
    cpus: float
    gpus: float
    count: int = 1


def run_demand(cfg: Config, gpus_there: float) -> list[Demand]:
    rt = cfg.runtime
    return [Demand("learner", rt.learner_num_cpus, learner_gpus(cfg, gpus_there), rt.num_learners),
            Demand("rollout worker", rt.num_cpus_per_worker, rt.num_gpus_per_worker, rt.num_workers)]


@dataclass(frozen=True)
class Capacity:
    """What a cluster has and could have.

    nodes: [{"CPU": c, "GPU": g}] of the alive nodes now.
    node_types: None when no autoscaler can add nodes; else the node types it may add
        ([{"CPU": c, "GPU": g, "max_count": n}], n = -1 unbounded), or [] when it exists but
        does not say (then nothing beyond the current nodes can be known).
    """
    nodes: list
    node_types: list | None

    def now(self, key: str) -> float:
        return sum(n.get(key, 0.0) for n in self.nodes)

    def at_most(self, key: str) -> float:
        """Upper bound on the cluster's `key`; inf when an autoscaler gives none."""
        if self.node_types is None:
            return self.now(key)
        if not self.node_types:
            return math.inf
        # Counted generously (the nodes now, plus every node type at its max count, though the
        # types may include the nodes running now): never refuse what an autoscaler could hold.
        added = 0.0
        for t in self.node_types:
            if t.get(key, 0.0) > 0 and t["max_count"] < 0:
                return math.inf
            added += t.get(key, 0.0) * max(t["max_count"], 0)
        return self.now(key) + added


def fit(demand: list[Demand], cap: Capacity) -> tuple[str, str]:
    """("ok" | "wait" | "never", why). "wait": fits only if an autoscaler adds nodes whose limits
    are unknown; "never": exceeds every bound the cluster has."""
    need = {"CPU": sum(d.cpus * d.count for d in demand), "GPU": sum(d.gpus * d.count for d in demand)}
    shapes = list(cap.nodes) + list(cap.node_types or [])
    for d in demand:
        if d.count == 0 or (d.cpus == 0 and d.gpus == 0):
            continue
        if not any(s.get("CPU", 0.0) >= d.cpus and s.get("GPU", 0.0) >= d.gpus for s in shapes):
            if cap.node_types == []:
                return "wait", f"no node now has room for one {d.what} ({_res(d.cpus, d.gpus)})"
            return "never", (f"no node{' type' if cap.node_types else ''} has room for one {d.what} "
                             f"({_res(d.cpus, d.gpus)})")
    notes = []
    for key, unit in (("CPU", "CPUs"), ("GPU", "GPUs")):
        if need[key] > cap.now(key) + 1e-9:
            bound = cap.at_most(key)
            if bound == math.inf and not cap.node_types:
                return "wait", f"it has {cap.now(key):g} {unit} now and the run asks for {need[key]:g}"
            if bound == math.inf:
                notes.append(f"the autoscaler can add {unit} without a limit")
                continue
            if need[key] > bound + 1e-9:
                return "never", f"the run asks for {need[key]:g} {unit}; the cluster has at most {bound:g}"
            notes.append(f"the autoscaler can grow it to {bound:g} {unit}")
    return "ok", "; ".join(notes)


def _res(cpus: float, gpus: float) -> str:
    return f"{cpus:g} CPU" + (f" + {gpus:g} GPU" if gpus else "")


def _cluster_capacity() -> Capacity:
    """The connected cluster's nodes and what its autoscaler could add (see the module doc)."""
    nodes = [{"CPU": n["Resources"].get("CPU", 0.0), "GPU": n["Resources"].get("GPU", 0.0)}
             for n in ray.nodes() if n.get("Alive")]
    try:
        from ray._private.state import state
        config = state.get_cluster_config()           # the node types an autoscaler publishes
    except Exception:  # noqa: BLE001 - not exposed by this Ray or this connection (ray://)
        config = None
    if config is not None and config.node_group_configs:
        types = [{"CPU": float(g.resources.get("CPU", 0)), "GPU": float(g.resources.get("GPU", 0)),
                  "max_count": int(g.max_count)} for g in config.node_group_configs]
        return Capacity(nodes, types)
    return Capacity(nodes, None if _no_autoscaler() else [])


def _no_autoscaler() -> bool:
    """True only when nothing can add nodes: no autoscaler ever reported its state to Ray, and Ray
    names every node's type after the node itself (its read-only view of a `ray start` cluster).
    Anyscale (ANYSCALE_* in the environment) scales by itself: never "no autoscaler"."""
    if any(k.startswith("ANYSCALE_") for k in os.environ):
        return False
    try:
        from ray.autoscaler.v2.sdk import get_cluster_status
        status = get_cluster_status(ray.get_runtime_context().gcs_address)
    except Exception:  # noqa: BLE001 - unknown: an autoscaler may exist
        return False
    infos = status.active_nodes + status.idle_nodes + status.pending_nodes
    reported = str(getattr(status.stats, "autoscaler_version", "0") or "0") != "0"
    return bool(infos) and not reported and all(i.ray_node_type_name == f"node_{i.node_id}" for i in infos)


def cluster_gpus(cap: Capacity | None = None) -> float:
    """GPUs a learner with runtime.learner_num_gpus = None counts on: those the cluster has now,
    or, when its autoscaler publishes node types with GPUs (a GPU group with min_nodes 0), those
    it can add. Needs a connected Ray."""
    cap = cap or _cluster_capacity()
    bound = cap.at_most("GPU")
    return bound if bound != math.inf else cap.now("GPU")


# --------------------------------------------------------------------------- starting Ray

def _log(msg: str) -> None:
    print(f"[flowrl_ray] {msg}", flush=True)


def _resolve(address: str, source: str) -> str:
    """`address`, with `auto` resolved ($RAY_ADDRESS, else the record of the last `ray start`
    under the Ray temp dir, else, as Ray does, a cluster found running here), once something
    answers there: a missing or uncleanly stopped cluster is one clear line, not a long wait
    and a traceback. (Ray itself prefers a lone running cluster to the record.)"""
    from ray._private import services, utils
    where, record = address, None
    if address == "auto":
        record = None if os.environ.get("RAY_ADDRESS") else utils.read_ray_address()
        try:
            address = os.environ.get("RAY_ADDRESS") or record or services.canonicalize_bootstrap_address("auto")
        except ConnectionError:
            raise ConfigError(f"{source}=auto: no running Ray cluster found on this machine "
                              f"(start one with `ray start --head`, or give no address for a private "
                              f"local Ray)") from None
        where = f"auto -> {address}"
    host_port = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, _, port = host_port.rpartition(":")
    if not port.isdigit():
        return address                          # a form Ray resolves itself
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_PROBE_S).close()
    except OSError as e:
        hint = " (the record Ray keeps of the last `ray start` points at a stopped cluster)" if record else ""
        raise ConfigError(f"{source}={where}: no Ray cluster answers there ({e.strerror or e}){hint}; "
                          f"start one with `ray start --head`, or give no address for a private local Ray") from None
    return address


def init_ray(cfg: Config, **kwargs) -> bool:
    """Connect to the cluster the rule names, else start a private local Ray (module doc).
    Returns True if this call started Ray (the caller shuts it down). Raises ConfigError, before
    any actor starts, when the cluster cannot be reached or can never fit the run.

    A private Ray gets at least as many logical CPUs as the run's actors ask for (learner +
    workers), so a 2-core laptop runs 2 workers + a learner, oversubscribed, instead of waiting.
    """
    if ray.is_initialized():
        return False
    address, source = ray_address(cfg)
    if address and address != "local":
        shown = _resolve(address, source)
        if address == "auto":
            # As ray.init(address="auto") does for the cluster it finds on this machine (and only
            # then): a token in ~/.ray/auth_token switches token authentication on, as `ray start`
            # did for the cluster. _resolve passed an explicit address on, which would not.
            from ray._private.authentication.authentication_token_setup import \
                maybe_enable_token_auth_if_token_available
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        try:
            ray.init(address=shown, log_to_driver=True, **kwargs)
        except ConnectionError as e:
            text = f"{e}\n{e.__cause__ or ''}"
            why = ("it uses token authentication: run with RAY_AUTH_MODE=token and the cluster's token in "
                   "~/.ray/auth_token or $RAY_AUTH_TOKEN" if "AuthToken" in text
                   else str(e).strip().splitlines()[0])
            raise ConfigError(f"{source}={address}: cannot connect to the Ray cluster at {shown}: {why}") from None
        now = ray.cluster_resources()
        cap = _cluster_capacity()
        verdict, why = fit(run_demand(cfg, cluster_gpus(cap)), cap)
        _log(f"Ray: connected to {shown} ({source}; {now.get('CPU', 0):g} CPUs, {now.get('GPU', 0):g} GPUs"
             f"{', ' + why if verdict == 'ok' and why else ''})")
        if verdict == "never":
            ray.shutdown()
            raise ConfigError(f"runtime: the run cannot fit on the cluster at {shown}: {why}; lower "
                              f"runtime.num_workers / runtime.num_cpus_per_worker / runtime.num_learners / "
                              f"runtime.learner_num_gpus or add nodes")
        if verdict == "wait":
            _log(f"warning: {why}; the run waits until an autoscaler adds nodes (their limits are not "
                 f"known here)")
        return True
    num_cpus = cfg.runtime.num_cpus or max(os.cpu_count() or 1, math.ceil(required_cpus(cfg)))
    if cfg.runtime.worker_niceness is not None:      # read by the raylet that ray.init starts
        os.environ["RAY_worker_niceness"] = str(cfg.runtime.worker_niceness)
    ray.init(address="local", num_cpus=num_cpus, log_to_driver=True, **kwargs)
    gpus = float(ray.cluster_resources().get("GPU", 0.0))
    _log(f"Ray: started a private local Ray ({num_cpus} CPUs, {gpus:g} GPUs)")
    verdict, why = fit(run_demand(cfg, gpus), Capacity([{"CPU": float(num_cpus), "GPU": gpus}], None))
    if verdict != "ok":
        ray.shutdown()
        raise ConfigError(f"runtime: the run cannot fit on this machine: {why}; lower runtime.num_workers / "
                          f"runtime.num_learners / runtime.learner_num_gpus or raise runtime.num_cpus")
    return True


def with_address(cfg: Config, address: str | None) -> Config:
    """`cfg` with runtime.ray_address = address (unchanged when None): the --address flag."""
    if address is None:
        return cfg
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, ray_address=address))
