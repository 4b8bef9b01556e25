"""Experiment trackers: a Weights & Biases run and an MLflow run of a training, written with their
own libraries (`wandb`, `mlflow`), both optional (the config's `logging` section).

What a tracked run holds:
    config          W&B: the resolved config (nested); MLflow: its flattened keys as params
    metrics         every row of metrics.jsonl, at step = env_steps (as TensorBoard)
    media           plots/*.png, videos/*.mp4, media/**.png, as they are written
    final           the summary and the path of the final checkpoint

The run's ids are kept in `<run_dir>/tracking.json`, so a resumed training (`--resume`) continues
the same W&B run (`resume="allow"`) and the same MLflow run. The libraries are imported only when a
backend is configured. `preflight` checks what can be checked before Ray starts; a backend that
fails later is dropped by MetricsLogger with one line, and training goes on.
Inside a Tune sweep each trial is one tracked run made by Tune's own callbacks (`tune_callbacks`),
and the trials' Trainers open none.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from flowrl_ray.config import Config, ConfigError, LoggingConfig
from flowrl_ray.runtime.metrics import report_tracker_failure
from flowrl_ray.utils import atomic_write_text

TRACKING_FILE = "tracking.json"          # run_dir/tracking.json: {"wandb_run_id", "mlflow_run_id"}
MLFLOW_PARAM_CHARS = 6000                # MLflow's limit on a param value
MLFLOW_BATCH = 100                       # params per log_batch call (MLflow's limit; metrics: 1000)
REACH_TIMEOUT_S = 5.0


def flatten(data: dict, prefix: str = "") -> dict:
    """{"algo": {"lr": 3e-4}} -> {"algo.lr": 3e-4}; lists and scalars are leaves."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def numeric_metrics(row: dict) -> dict:
    """The finite numbers of a metrics row (bools, None, NaN and text left out)."""
    return {k: v for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def mlflow_store_uri(tracking_uri: str) -> str:
    """The URI MLflow is given: a plain path becomes absolute (trials and resumed runs may start
    in another working directory). MLflow 3 refuses its file store unless
    MLFLOW_ALLOW_FILE_STORE is set; a local store is what this section offers for use without a
    server, so it is set for this process."""
    scheme = urllib.parse.urlparse(tracking_uri).scheme
    if scheme in ("", "file"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if scheme == "":
        return str(Path(tracking_uri).expanduser().resolve())
    return tracking_uri


def wandb_mode(cfg: LoggingConfig) -> str:
    return cfg.wandb.mode or os.environ.get("WANDB_MODE") or "online"


# --------------------------------------------------------------------------- before Ray starts

def preflight(cfg: LoggingConfig) -> None:
    """ConfigError naming the key for what only the environment can tell: a backend whose library
    is missing, W&B online without an API key, an MLflow tracking URI that cannot be reached."""
    if cfg.wandb is not None and wandb_mode(cfg) != "disabled":
        try:
            import wandb
        except ImportError:
            raise ConfigError("config key 'logging.wandb': needs the wandb package "
                              "(pip install 'flowrl-ray[tracking]')") from None
        if wandb_mode(cfg) == "online" and not (os.environ.get("WANDB_API_KEY") or wandb.api.api_key):
            raise ConfigError("config key 'logging.wandb.mode': 'online' needs a W&B API key "
                              "(`wandb login` or WANDB_API_KEY); mode: offline logs without one")
    if cfg.mlflow is not None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError("config key 'logging.mlflow': needs the mlflow package "
                              "(pip install 'flowrl-ray[tracking]')") from None
        uri = cfg.mlflow.tracking_uri
        key = "config key 'logging.mlflow.tracking_uri'"
        scheme = urllib.parse.urlparse(uri).scheme
        if scheme in ("http", "https"):
            try:        # any HTTP answer (even 404) means a server is there
                urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=REACH_TIMEOUT_S).close()
            except urllib.error.HTTPError:
                pass
            except (urllib.error.URLError, OSError) as e:
                reason = getattr(e, "reason", e)
                raise ConfigError(f"{key}: cannot reach {uri} ({reason})") from None
            return
        try:            # a local store is created here; other schemes must at least open
            MlflowClient(tracking_uri=mlflow_store_uri(uri)).search_experiments(max_results=1)
        except Exception as e:  # noqa: BLE001 - any failure to open the store is the user's URI
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{key}: cannot open the MLflow store {uri!r} ({first})") from None


# --------------------------------------------------------------------------- the backends

class WandbTracker:
    """One W&B run; offline runs are written under $WANDB_DIR or the run directory."""
    label = "W&B"

    def __init__(self, cfg: Config, run_dir: Path, run_id: str | None):
        import wandb
        self._wandb = wandb
        w = cfg.logging.wandb
        self.run = wandb.init(
            project=w.project, entity=w.entity, mode=wandb_mode(cfg.logging),
            tags=list(w.tags) or None, name=w.name or cfg.name, group=w.group,
            id=run_id, resume="allow", allow_val_change=True,
            config=cfg.to_dict(), dir=os.environ.get("WANDB_DIR") or str(run_dir))
        self.run_id = self.run.id
        if self.run.settings.mode == "offline":
            offline_dir = Path(self.run.dir).parent        # <dir>/wandb/offline-run-<time>-<id>
            self.where = f"W&B run {self.run_id}, offline in {offline_dir} (upload: wandb sync {offline_dir})"
        else:
            self.where = f"W&B run {self.run_id}: {self.run.url}"
        self.run.define_metric("env_steps")
        self.run.define_metric("iteration")          # an x-axis to choose in the W&B UI

    def log(self, row: dict, step: int) -> None:
        self.run.log(numeric_metrics(row), step=step)

    def log_media(self, path: Path, key: str, step: int, caption: str) -> None:
        suffix = path.suffix.lower()
        if suffix in (".mp4", ".gif", ".webm"):
            media = self._wandb.Video(str(path), caption=caption or None, format=suffix[1:])
        else:
            media = self._wandb.Image(str(path), caption=caption or None)
        self.run.log({key: media}, step=step)

    def log_final(self, summary: dict, checkpoint: str | None) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})
        if checkpoint:
            self.run.config.update({"final_checkpoint": checkpoint}, allow_val_change=True)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """One MLflow run in experiment `logging.mlflow.experiment` (default: the config's name)."""
    label = "MLflow"

    def __init__(self, cfg: Config, run_dir: Path, run_id: str | None):
        from mlflow.tracking import MlflowClient
        m = cfg.logging.mlflow
        self.run_dir = run_dir
        self.client = MlflowClient(tracking_uri=mlflow_store_uri(m.tracking_uri))
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            existing = self.client.get_run(run_id).data.params
        else:
            name = m.experiment or cfg.name
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run_id = self.client.create_run(experiment_id, run_name=m.run_name or cfg.name, tags={
                "algorithm": cfg.algorithm, "env": cfg.env.id, "run_dir": str(run_dir.resolve())}).info.run_id
            existing = {}
        self.run_id = run_id
        self.where = f"MLflow run {run_id} at {m.tracking_uri} (experiment '{m.experiment or cfg.name}')"
        self._log_params(flatten(cfg.to_dict()), existing)

    def _log_params(self, params: dict, existing: dict) -> None:
        """Params are write-once in MLflow: on resume, new keys are added and a changed value
        (e.g. a longer train.iterations) is recorded as tag `resumed.<key>`."""
        from mlflow.entities import Param, RunTag
        new, changed = [], []
        for key, value in params.items():
            text = str(value)[:MLFLOW_PARAM_CHARS]
            if key not in existing:
                new.append(Param(key, text))
            elif existing[key] != text:
                changed.append(RunTag(f"resumed.{key}", text))
        for i in range(0, len(new), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + MLFLOW_BATCH])
        if changed:
            self.client.log_batch(self.run_id, tags=changed)

    def log(self, row: dict, step: int) -> None:
        from mlflow.entities import Metric
        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now_ms, step) for k, v in numeric_metrics(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_media(self, path: Path, key: str, step: int, caption: str) -> None:
        """The file as an artifact under its folder in the run directory (plots/, videos/,
        media/forms/); a PNG also as an image at `step` (MLflow's image slider)."""
        try:
            folder = str(path.resolve().parent.relative_to(self.run_dir.resolve()))
        except ValueError:
            folder = path.parent.name
        self.client.log_artifact(self.run_id, str(path), None if folder == "." else folder)
        if path.suffix.lower() == ".png":
            from PIL import Image
            with Image.open(path) as image:
                self.client.log_image(self.run_id, image.convert("RGB"), key=key, step=step)

    def log_final(self, summary: dict, checkpoint: str | None) -> None:
        if checkpoint:
            self.client.set_tag(self.run_id, "final_checkpoint", checkpoint)
        summary_file = self.run_dir / "summary.json"
        if summary_file.is_file():
            self.client.log_artifact(self.run_id, str(summary_file))

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def open_trackers(cfg: Config, run_dir: Path, resume: bool) -> list:
    """Open (or, on resume, reopen) the configured runs and record their ids in tracking.json.
    A backend that fails to open is reported in one line and left out."""
    path = Path(run_dir) / TRACKING_FILE
    ids = json.loads(path.read_text()) if resume and path.is_file() else {}
    trackers = []
    for section, cls in (("wandb", WandbTracker), ("mlflow", MlflowTracker)):
        sub = getattr(cfg.logging, section)
        if sub is None or (section == "wandb" and wandb_mode(cfg.logging) == "disabled"):
            continue
        try:
            tracker = cls(cfg, Path(run_dir), ids.get(f"{section}_run_id"))
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            report_tracker_failure(cls.label, e)
            continue
        ids[f"{section}_run_id"] = tracker.run_id
        trackers.append(tracker)
    if trackers:
        atomic_write_text(path, json.dumps(ids, indent=2) + "\n")
    return trackers


# --------------------------------------------------------------------------- Tune

def tune_callbacks(cfg: Config, out_dir: Path) -> tuple[list, dict]:
    """Ray Tune's own W&B and MLflow callbacks for a sweep: each trial one tracked run (steps are
    Tune's training iterations). Returns (callbacks, environment variables the sweep's driver
    needs while it runs: Ray's W&B callback reads the mode from WANDB_MODE).

    W&B files go to $WANDB_DIR or `out_dir` (out_dir/wandb/offline-run-*): by default Ray's
    logging actor writes them into the trial's staging directory, which Tune copies to its
    storage when the trial ends, sometimes before the actor has written the last records."""
    callbacks, env = [], {}
    w, m = cfg.logging.wandb, cfg.logging.mlflow
    if w is not None and wandb_mode(cfg.logging) != "disabled":
        from ray.air.integrations.wandb import WandbLoggerCallback
        env["WANDB_MODE"] = wandb_mode(cfg.logging)
        callbacks.append(WandbLoggerCallback(project=w.project or os.environ.get("WANDB_PROJECT"),
                                             group=w.group, entity=w.entity, mode=env["WANDB_MODE"],
                                             tags=list(w.tags) or None,
                                             dir=os.environ.get("WANDB_DIR") or str(out_dir)))
    if m is not None:
        from ray.air.integrations.mlflow import MLflowLoggerCallback
        callbacks.append(MLflowLoggerCallback(tracking_uri=mlflow_store_uri(m.tracking_uri),
                                              experiment_name=m.experiment or cfg.name))
    return callbacks, env
