"""Pictures of evaluation behaviour with the real parts: the forms scorer's screenshots in real
Chromium, and tiny Flow-GRPO (real Chromium) and FED-GRPO (real force field) runs on a real local
Ray that write the PNGs and log them to TensorBoard."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from flowrl_ray.config import config_from_dict
from flowrl_ray.envs.forms import FormCatalog, load_tasks
from flowrl_ray.envs.forms.snapshots import PANEL_W
from flowrl_ray.envs.molecules import snapshots as molpics
from conftest import run_trainer
from unit.envs.test_snapshots import _png


def _chromium_or_skip():
    pytest.importorskip("playwright.async_api")
    from flowrl_ray.envs.forms import BrowserUnavailable, find_chromium
    try:
        find_chromium()
    except BrowserUnavailable as e:                                # pragma: no cover - depends on the machine
        pytest.skip(str(e))


def test_the_scorer_screenshots_the_filled_form_before_submitting_only_when_asked():
    _chromium_or_skip()
    from flowrl_ray.envs.forms import FormsScorer, FormsSettings, gold_actions
    catalog = FormCatalog.load()
    task = load_tasks("heldout", catalog=catalog)[0]
    gold = gold_actions(task, catalog)
    unsent = "\n".join(ln for ln in gold.splitlines() if not ln.startswith("click"))
    texts = [gold, unsent, 'click "No such button"']
    samples = {"ids": np.arange(3), "task_ids": [task.task_id] * 3, "texts": texts}
    with FormsScorer(FormsSettings(pages=2), worker_id=0, catalog=catalog) as scorer:
        plain = scorer.score(samples)
        pictured = scorer.score(samples, snapshots=3)
        two = scorer.score(samples, snapshots=2)
    assert "snapshots" not in plain.meta.extra and [len(two.meta.extra["snapshots"])] == [2]
    assert np.array_equal(plain["rewards"], pictured["rewards"]) and pictured["rewards"][0] == 1.0   # same scores
    items = pictured.meta.extra["snapshots"]
    assert [it["index"] for it in items] == [0, 1, 2] and {it["task_id"] for it in items} == {task.task_id}
    pages = [np.asarray(_png(it["png"]))[:, :-PANEL_W] for it in items]       # the screenshot side
    # the submitted script was pictured on the form page before its click (not on the result
    # page): the same picture as the filled form that was never sent; the untouched form differs
    assert pages[0].shape == pages[1].shape and np.abs(pages[0].astype(int) - pages[1]).mean() < 1.0
    assert pages[0].shape[0] > 300 and (pages[0].shape != pages[2].shape or (pages[0] != pages[2]).any())


# ---------------------------------------------------------------------- end to end

def _tb_text(run: Path) -> bytes:
    return b"".join(p.read_bytes() for p in (run / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_flow_grpo_run_writes_a_picture_per_evaluation_task(tmp_path, local_ray):
    _chromium_or_skip()
    from unit.algorithms.test_flow_grpo import TINY_MODEL, _config
    from flowrl_ray.models.masked_diffusion import build_masked_lm
    from flowrl_ray.models.text_tokenizer import train_tokenizer
    from flowrl_ray.pretrain.text_sft import sft_pairs
    data = _config(tmp_path, str(tmp_path / "sft"), epochs=1, num_generation_steps=4)
    data["train"]["iterations"] = 1
    data["eval"] = {"interval": 1, "episodes": 2, "snapshots": {"episodes": 2}}
    cfg = config_from_dict(data)
    texts = [t for pair in sft_pairs(cfg.env)[:40] for t in pair]
    build_masked_lm(TINY_MODEL, tokenizer=train_tokenizer(texts, TINY_MODEL["vocab_size"]), seed=0).save(tmp_path / "sft")

    run = tmp_path / "run"
    run_trainer(cfg, run)
    pictures = sorted((run / "media" / "forms").glob("*.png"))
    assert [p.name.split("_heldout")[0] for p in pictures] == ["iter_0001_0", "iter_0001_1"]
    tasks = load_tasks("heldout", catalog=FormCatalog.load())
    wanted = {tasks[0].task_id, tasks[-1].task_id}          # eval tasks: spread over the held-out set
    assert {p.stem.split("_", 3)[3] for p in pictures} == {t.replace("/", "-") for t in wanted}
    for p in pictures:
        img = _png(p.read_bytes())
        assert img.width > PANEL_W + 100 and img.height >= 200 and p.stat().st_size > 20_000
    events = _tb_text(run)
    assert b"forms/iter_0001_0" in events and b"forms/iter_0001_1" in events


@pytest.mark.slow
def test_fed_grpo_run_writes_one_grid_cell_per_requested_molecule(tmp_path, local_ray, capsys):
    from unit.algorithms.test_fed_grpo import _config
    data = _config()
    data["train"]["iterations"] = 1
    data["eval"] = {"interval": 1, "episodes": 4, "at_start": True, "snapshots": {"episodes": 3}}
    run = tmp_path / "run"
    run_trainer(config_from_dict(data), run)
    for it in (0, 1):                              # at start and after the iteration
        grid = _png((run / "media" / "molecules" / f"iter_{it:04d}.png").read_bytes())
        # 3 molecules from two scoring workers (ids 0-1 and 2-3): one grid of 3 cells
        assert grid.size == (3 * molpics.CELL_PX, molpics.CELL_PX)
    assert b"molecules/iter_0000" in _tb_text(run) and b"molecules/iter_0001" in _tb_text(run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and math.isfinite(rows[-1]["eval/validity"])

    from flowrl_ray.cli import main
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "2", "--snapshots", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["snapshots"] == [str(run / "media" / "molecules" / "eval_iter_000001.png")]
    assert _png(Path(out["snapshots"][0]).read_bytes()).size == (2 * molpics.CELL_PX, molpics.CELL_PX)
    assert main(["eval", str(run), "--episodes", "2", "--snapshots", "3"]) == 2          # more than evaluated
    assert "--snapshots 3" in capsys.readouterr().err
