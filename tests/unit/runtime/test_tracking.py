"""W&B and MLflow tracking settings: bad settings, an unreachable store and a missing API key stop
before Ray starts."""

from __future__ import annotations

import pytest

from conftest import PENDULUM, TINY, tiny_config
from flowrl_ray.config import ConfigError, load_config


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, its files in tmp; no network is needed by any test here."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    return tmp_path / "wandb_dir"


# --------------------------------------------------------------------------- bad settings

@pytest.mark.parametrize("overrides,key", [
    (["logging.wandb.project=p", "logging.wandb.mode=offlne"], "logging.wandb.mode"),
    (["logging.wandb.mode=offline"], "logging.wandb.project"),
    (["logging.wandb={}"], "logging.wandb.project"),
    (["logging.wandb.projet=p"], "logging.wandb.projet"),
    (["logging.wandb.project=p", "logging.wandb.tags=tiny"], "logging.wandb.tags"),
    (["logging.mlflow.tracking_uri="], "logging.mlflow.tracking_uri"),
    (["logging.mlflow.experimnt=x"], "logging.mlflow.experimnt"),
])
def test_bad_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(PENDULUM, TINY + overrides)


def test_unreachable_or_unusable_store_stops_before_ray(tmp_path):
    import socket

    import ray

    from flowrl_ray.runtime.trainer import Trainer
    with socket.socket() as s:                      # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "a_file").write_text("not a directory")
    for uri, reason in [(f"http://127.0.0.1:{port}", "cannot reach"),
                        (str(tmp_path / "a_file" / "mlruns"), "cannot open the MLflow store")]:
        cfg = tiny_config(f"logging.mlflow.tracking_uri={uri}")
        with pytest.raises(ConfigError, match=f"'logging.mlflow.tracking_uri': {reason}"):
            Trainer(cfg, tmp_path / "run")
    assert not ray.is_initialized()
    assert not (tmp_path / "run").exists()


def test_online_without_api_key_stops_before_ray(tmp_path, monkeypatch):
    import wandb

    from flowrl_ray.runtime.trainer import Trainer
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    if wandb.api.api_key:
        pytest.skip("this machine is logged in to W&B")
    cfg = tiny_config("logging.wandb.project=p", "logging.wandb.mode=online")
    with pytest.raises(ConfigError, match="'logging.wandb.mode': 'online' needs a W&B API key"):
        Trainer(cfg, tmp_path / "run")
