"""Ray Serve deployment of a trained policy.

    POST /act      {"observation": [...]}            one observation of shape obs_shape
                   {"observation": [[...], ...]}     or a batch [N, *obs_shape]
                   optional "deterministic": bool    (default true: the policy's mean action)
               -> 200 {"action": ..., "normalized_action": ..., "policy_version": ..., ...}
    GET  /healthz  -> 200 {"status": "ok", ...}

`action` is in the env's own action bounds; `normalized_action` is the policy's output in
[-1, 1]. A flow policy (FPO++) answers with an action chunk [horizon_steps, A] per observation
(deterministic: integrated from eps = 0); the robot env executes its first ``act_steps`` rows
(both reported by /healthz). Bad input (malformed JSON, missing key, wrong shape, non-numbers, NaN/inf) gets a 4xx
answer with {"error": "..."}, never a 500.

The policy is loaded on the driver (a bad run directory fails before Serve starts) and shipped
to the replica with the deployment, so the replica needs no access to the run directory.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` class in the
# handler signature, and it is imported inside _make_deployment.
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

APP_NAME = "flowrl-policy"
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_BATCH = 4096
REQUEST_KEYS = ("observation", "deterministic")


class BadRequest(ValueError):
    """A client mistake; answered with `status` and {"error": message}."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------- request parsing

def _check_nesting(value: Any, depth: int, max_depth: int) -> None:
    """Lists nested at most `max_depth` deep, non-empty, with numbers (not bools) as leaves.
    Checked by hand: numpy would turn "1.5" into 1.5 and ragged lists into object arrays."""
    if isinstance(value, list):
        if depth >= max_depth:
            raise BadRequest(f"observation is nested too deep (at most {max_depth} levels of lists)")
        if not value:
            raise BadRequest("observation contains an empty list")
        for item in value:
            _check_nesting(item, depth + 1, max_depth)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"observation values must be numbers, got {type(value).__name__} {value!r:.40}")


def parse_request(body: bytes, obs_shape: tuple[int, ...]) -> tuple[np.ndarray, bool, bool]:
    """Request body -> (observations float32 [N, *obs_shape], is_batch, deterministic).
    Raises BadRequest with a message for the client."""
    if len(body) > MAX_BODY_BYTES:
        raise BadRequest(f"request body is larger than {MAX_BODY_BYTES} bytes", status=413)
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:     # JSONDecodeError is a ValueError
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deep") from None
    if not isinstance(payload, dict):
        raise BadRequest('request body must be a JSON object like {"observation": [...]}')
    if "observation" not in payload:
        raise BadRequest('missing key "observation" (expected {"observation": [...]})')
    unknown = sorted(set(payload) - set(REQUEST_KEYS))
    if unknown:
        raise BadRequest(f"unknown key(s) {unknown}; allowed: {list(REQUEST_KEYS)}")
    deterministic = payload.get("deterministic", True)
    if not isinstance(deterministic, bool):
        raise BadRequest(f'"deterministic" must be true or false, got {deterministic!r:.40}')

    obs = payload["observation"]
    if not isinstance(obs, list):
        raise BadRequest(f"observation must be a list of numbers of shape {list(obs_shape)} "
                         f"or a batch of them, got {type(obs).__name__}")
    _check_nesting(obs, 0, len(obs_shape) + 1)
    try:
        arr = np.asarray(obs, dtype=np.float64)
    except (ValueError, OverflowError) as e:     # ragged lists; ints too large for a float
        raise BadRequest(f"observation is not a rectangular array of numbers: {e}") from None
    with np.errstate(over="ignore"):
        arr = arr.astype(np.float32)             # what the policy runs in
    if not np.all(np.isfinite(arr)):
        raise BadRequest("observation contains NaN, infinite or too large (beyond float32) values")
    if arr.shape == tuple(obs_shape):
        return arr[None], False, deterministic
    if arr.ndim == len(obs_shape) + 1 and arr.shape[1:] == tuple(obs_shape):
        if arr.shape[0] > MAX_BATCH:
            raise BadRequest(f"batch of {arr.shape[0]} observations is larger than {MAX_BATCH}", status=413)
        return arr, True, deterministic
    raise BadRequest(f"observation has shape {list(arr.shape)}; expected {list(obs_shape)} "
                     f"or a batch [N, {', '.join(map(str, obs_shape))}]")


def rescale(normalized: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """[-1, 1] -> [low, high]: the env adapter's own map, so served actions equal trained ones."""
    from flowrl_ray.envs.gym import rescale_action
    return rescale_action(normalized, low, high)


# --------------------------------------------------------------------------- the deployment

def _make_deployment():
    """Build the Serve deployment class (imports Serve and FastAPI only when serving)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from ray import serve

    api = FastAPI(title="flowrl_ray policy", description="POST /act, GET /healthz")

    # One CPU: a small MLP answers in well under a millisecond per observation.
    @serve.deployment(ray_actor_options={"num_cpus": 1})
    @serve.ingress(api)
    class PolicyServer:
        def __init__(self, policy, info: dict):
            import torch
            torch.set_num_threads(1)
            self.policy = policy.eval()
            self.info = info
            self.obs_shape = tuple(info["obs_shape"])
            self.low = np.asarray(info["action_low"], np.float64)
            self.high = np.asarray(info["action_high"], np.float64)

        @api.get("/healthz")
        def healthz(self) -> dict:
            return {"status": "ok", **self.info}

        @api.post("/act")
        async def act(self, request: Request):
            import torch
            try:
                obs, is_batch, deterministic = parse_request(await request.body(), self.obs_shape)
            except BadRequest as e:
                return JSONResponse({"error": str(e)}, status_code=e.status)
            normalized, _ = self.policy.act(torch.as_tensor(obs), deterministic=deterministic,
                                            record=False)
            normalized = normalized.double().numpy()
            if not np.all(np.isfinite(normalized)):
                return JSONResponse({"error": "the policy produced non-finite actions"}, status_code=500)
            action = rescale(normalized, self.low, self.high)
            if not is_batch:
                normalized, action = normalized[0], action[0]
            return {"action": action.tolist(), "normalized_action": normalized.tolist(),
                    "deterministic": deterministic, "policy_version": self.info["policy_version"],
                    "checkpoint": self.info["checkpoint"], "iteration": self.info["iteration"]}

    return PolicyServer


def action_bounds(cfg) -> tuple[np.ndarray, np.ndarray]:
    """The env's own action bounds (low, high), read from one env built from the run's config.
    An env whose policy acts in normalised chunks (the robot family) names the per-step bounds
    it maps [-1, 1] to as ``action_low``/``action_high``; a chunk [Ta, A] is rescaled row by row."""
    from flowrl_ray.envs import env_family
    env = env_family(cfg.env.family).make_env(cfg.env)
    try:
        raw = env.unwrapped
        if hasattr(raw, "action_low"):
            return np.asarray(raw.action_low, np.float64), np.asarray(raw.action_high, np.float64)
        space = raw.action_space
        return np.asarray(space.low, np.float64), np.asarray(space.high, np.float64)
    finally:
        env.close()


def policy_info(run_dir: str | Path) -> tuple[Any, dict]:
    """(policy, facts the server reports) from a run directory's latest checkpoint."""
    from flowrl_ray.checkpoint import load_latest
    from flowrl_ray.runtime.policy import load_policy
    run_dir = Path(run_dir)
    cfg, spec, policy = load_policy(run_dir)
    # Version and iteration of that checkpoint (a run still training may add a newer one
    # between the two reads; the name reported is the one these numbers come from).
    path, ckpt = load_latest(run_dir, log=None)    # load_policy named any damaged one it skipped
    low, high = action_bounds(cfg)
    info = {"run_dir": str(run_dir.resolve()), "name": cfg.name, "algorithm": cfg.algorithm,
            "env": cfg.env.id, "obs_shape": list(spec.obs_shape), "action_dim": spec.action_dim,
            "action_low": low.tolist(), "action_high": high.tolist(), "checkpoint": path.name,
            # action chunks (flow policies): the client executes the first act_steps rows
            "horizon_steps": cfg.env.horizon_steps, "act_steps": cfg.env.act_steps,
            "iteration": ckpt.get("trainer", {}).get("iteration"),
            "policy_version": ckpt.get("learner", {}).get("version")}
    return cfg, policy, info


_started_ray = False


def _wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.25)
    raise RuntimeError(f"Serve does not answer at {url}/healthz ({last}); if Serve was already running "
                       f"on this cluster with other HTTP options, stop it first (serve.shutdown())")


def _deploy(run_dir: str | Path, host: str, port: int, name: str,
            address: str | None = None) -> tuple[str, dict]:
    global _started_ray
    from ray import serve

    from flowrl_ray.runtime.cluster import init_ray, with_address

    cfg, policy, info = policy_info(run_dir)        # errors about the run dir come first
    _started_ray = init_ray(with_address(cfg, address)) or _started_ray
    serve.start(http_options={"host": host, "port": port})
    serve.run(_make_deployment().bind(policy, info), name=name, route_prefix="/", blocking=False)
    url = f"http://{host}:{port}"
    _wait_healthy(url)
    return url, info


def deploy(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, name: str = APP_NAME,
           address: str | None = None) -> str:
    """Deploy the run's latest checkpoint and return the base URL once /healthz answers.
    Uses the Ray already running in this process, else the cluster `address` (or the run's
    runtime.ray_address, or $RAY_ADDRESS) names, else a private local Ray. Non-blocking."""
    return _deploy(run_dir, host, port, name, address)[0]


def shutdown() -> None:
    """Remove Serve from the cluster; stop the local Ray if `deploy` started it."""
    global _started_ray
    import ray
    from ray import serve
    if ray.is_initialized():
        serve.shutdown()
    if _started_ray:
        ray.shutdown()
        _started_ray = False


def serve_policy(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, block: bool = True,
                 address: str | None = None) -> str:
    """Deploy; with block=True print how to call it and wait until Ctrl-C, then shut down."""
    url, info = _deploy(run_dir, host, port, APP_NAME, address)
    if not block:
        return url
    example = json.dumps({"observation": np.zeros(info["obs_shape"]).tolist()})
    print(f"[flowrl_ray] serving {run_dir} at {url}", flush=True)
    print(f"[flowrl_ray] try: curl -s -X POST {url}/act -H 'Content-Type: application/json' "
          f"-d '{example}'", flush=True)
    print(f"[flowrl_ray] health: curl -s {url}/healthz   (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("[flowrl_ray] stopping", flush=True)
    finally:
        shutdown()
    return url
