"""Checkpoints a user can trust (no Ray): the newest checkpoint that loads whole is taken and each
damaged newer one is named; a write that fails leaves the previous checkpoint and `latest` as they
were; a torn last metrics line loses nothing before it. The same through a real run (resume, eval,
a failing disk mid-run): tests/integration/test_runtime.py."""

import errno
import json

import numpy as np
import pytest
import torch

from flowrl_ray import checkpoint as ck
from flowrl_ray.errors import UserError
from flowrl_ray.metrics import read_metrics


def _save(run, iteration):
    return ck.save_checkpoint(run, iteration, {"trainer": {"iteration": iteration}, "learner": {"w": torch.ones(3)},
                                               "policy": {"w": torch.full((2,), float(iteration))}}, keep=5)


@pytest.fixture()
def run(tmp_path):
    for i in (1, 2, 3):
        _save(tmp_path, i)
    return tmp_path


@pytest.mark.parametrize("damage,reason", [
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "RuntimeError"),    # cut
    (lambda p: p.write_bytes(b""), "EOFError|RuntimeError"),                                # empty
    (lambda p: p.write_text("not a checkpoint\n"), "UnpicklingError|RuntimeError"),          # foreign bytes
    (lambda p: torch.save({"w": torch.zeros(1)}, p), "not a checkpoint of a run"),           # foreign torch file
])
def test_the_newest_whole_checkpoint_is_taken_and_the_damaged_one_named(run, damage, reason):
    damage(run / "checkpoints" / "iter_000003.pt")
    lines = []
    path, payload = ck.load_latest(run, lines.append)
    assert path.name == "iter_000002.pt" and payload["trainer"]["iteration"] == 2
    assert len(lines) == 1 and "iter_000003.pt skipped: it does not load whole" in lines[0]
    assert __import__("re").search(reason, lines[0]), lines[0]


def test_a_latest_pointer_to_a_missing_file_falls_back_to_the_newest_file(run):
    (run / "checkpoints" / "latest").write_text("iter_000009.pt\n")
    path, payload = ck.load_latest(run, None)
    assert path.name == "iter_000003.pt"
    (run / "checkpoints" / "latest").write_text("iter_000001.pt\n")        # a stale pointer: newer files first
    assert ck.load_latest(run, None)[0].name == "iter_000003.pt"


def test_no_whole_checkpoint_is_one_line_naming_each_file(run, tmp_path):
    for p in (run / "checkpoints").glob("iter_*.pt"):
        p.write_bytes(b"")
    with pytest.raises(UserError) as e:
        ck.load_latest(run, None)
    text = str(e.value)
    assert "no checkpoint loads whole" in text and "\n" not in text
    assert all(f"iter_00000{i}.pt" in text for i in (1, 2, 3))
    assert ck.load_latest(tmp_path / "empty", None) is None             # no checkpoint at all: None


def test_a_failed_write_leaves_the_previous_checkpoint_and_latest(run, monkeypatch):
    before = (run / "checkpoints" / "iter_000003.pt").read_bytes()

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ck, "atomic_write_bytes", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _save(run, 4)
    assert not (run / "checkpoints" / "iter_000004.pt").exists()
    assert (run / "checkpoints" / "latest").read_text().strip() == "iter_000003.pt"
    assert (run / "checkpoints" / "iter_000003.pt").read_bytes() == before
    assert ck.load_latest(run, None)[1]["trainer"]["iteration"] == 3


def test_a_torn_last_metrics_line_loses_no_row_before_it(tmp_path):
    rows = [{"iteration": i, "return": float(i)} for i in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text + '{"iteration": 4, "ret')       # a crash mid-write
    assert read_metrics(tmp_path) == rows


class Planted:
    """What a hostile file holds: unpickling it would call ``Path.touch`` on ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        from pathlib import Path
        return (Path.touch, (Path(self.marker),))


def test_a_planted_payload_is_refused_by_name_and_never_runs(tmp_path, monkeypatch):
    from flowrl_ray.config import ConfigError
    from flowrl_ray.models.edm import load_base_model
    from flowrl_ray.models.flow_policy import load_base_policy
    from flowrl_ray.utils import TRUST_FILES_ENV
    marker = tmp_path / "ran"
    ck.save_checkpoint(tmp_path / "run", 1, {"trainer": {"iteration": 1}, "learner": {"x": Planted(marker)},
                                            "policy": {}})
    torch.save({"policy": {"w": torch.ones(1)}, "arch": Planted(marker)}, tmp_path / "base.pt")
    torch.save({"state_dict": {}, "model_config": {}, "node_histogram": Planted(marker)}, tmp_path / "edm.pt")
    with pytest.raises(UserError, match=r"no checkpoint loads whole.*refused: it names "):
        ck.load_latest(tmp_path / "run", None)
    with pytest.raises(ConfigError, match=r"algo.base_policy.*refused: it names "):
        load_base_policy(tmp_path / "base.pt")
    with pytest.raises(ConfigError, match=r"algo.base_model.*refused: it names "):
        load_base_model(tmp_path / "edm.pt")
    assert not marker.exists()                                        # nothing in the files ran
    # numpy arrays (histograms, episode tails) and their dtypes load without the opt-in
    torch.save({"trainer": {}, "learner": {"h": np.arange(3.0), "t": np.zeros(2, np.int8)}}, tmp_path / "np.pt")
    assert ck.load_checkpoint(tmp_path / "np.pt")["learner"]["h"].tolist() == [0.0, 1.0, 2.0]
    # the legacy opt-in: the full unpickler, for a file the user made (it runs what the file names)
    monkeypatch.setenv(TRUST_FILES_ENV, "1")
    ck.load_checkpoint(tmp_path / "run" / "checkpoints" / "iter_000001.pt")
    assert marker.exists()


def test_a_base_checkpoint_that_is_missing_unreadable_or_foreign_names_the_config_key(tmp_path):
    from flowrl_ray.errors import ConfigError
    from flowrl_ray.models.edm import load_base_model
    from flowrl_ray.models.flow_policy import load_base_policy

    with pytest.raises(ConfigError, match=r"^config key 'algo\.base_model': no such file .*none\.pt.*flowrl-ray pretrain"):
        load_base_model(tmp_path / "none.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"^config key 'algo\.base_policy': cannot read .*junk\.pt"):
        load_base_policy(tmp_path / "junk.pt")
    torch.save({"policy": {}, "arch": {}}, tmp_path / "flow.pt")          # a flow policy's base, not an EDM's
    with pytest.raises(ConfigError, match=r"'algo\.base_model': .*flow\.pt' is not an EDM pretraining checkpoint"):
        load_base_model(tmp_path / "flow.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match=r"is not a flowrl-ray pretraining checkpoint"):
        load_base_policy(tmp_path / "list.pt")
    ckpt = load_base_policy(tmp_path / "flow.pt")
    assert ckpt == {"policy": {}, "arch": {}}
