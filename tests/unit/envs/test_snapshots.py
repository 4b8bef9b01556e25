"""Pictures of evaluation behaviour (eval.snapshots) for the scoring families: the composed forms
picture against a known screenshot and episode, the molecule grid against hand-made molecules,
the config errors. Real Chromium and the tiny runs on a local Ray: tests/integration/test_snapshots.py."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from flowrl_ray.config import ConfigError, config_from_dict, load_config
from flowrl_ray.envs.forms import FormCatalog, load_tasks
from flowrl_ray.envs.forms.reward import EpisodeResult, RewardWeights, score_episode
from flowrl_ray.envs.forms.snapshots import PANEL_W, compose_snapshot, panel_text, save_snapshots, snapshot_item
from flowrl_ray.envs.molecules import snapshots as molpics
from flowrl_ray.envs.molecules.chemistry import canonical_smiles, check_stability
from conftest import REPO

WATER = (np.array([[0.0, 0.0, 0.119262], [0.0, 0.763239, -0.477047], [0.0, -0.763239, -0.477047]]),
         np.array([3, 0, 0]))
METHANE = (np.array([[0.0, 0.0, 0.0], [0.629, 0.629, 0.629], [-0.629, -0.629, 0.629],
                     [-0.629, 0.629, -0.629], [0.629, -0.629, -0.629]]), np.array([1, 0, 0, 0, 0]))
LONE_CARBON = (np.zeros((1, 3)), np.array([1]))
CRUSHED_C2 = (np.array([[0.0, 0.0, 0.0], [0.3, 0.0, 0.0]]), np.array([1, 1]))   # 0.3 Å apart


def _png(data: bytes) -> Image.Image:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return Image.open(io.BytesIO(data)).convert("RGB")


# ---------------------------------------------------------------------- forms: the composed picture

def _episode(catalog):
    """A held-out task, its gold script with the first field's value changed, and the result as
    the scorer would have it (submitted, accepted, that one field wrong)."""
    task = load_tasks("heldout", catalog=catalog)[0]
    form = catalog[task.form_id]
    names = list(task.ground_truth_fields)
    wrong = names[0]
    submitted = dict(task.ground_truth_fields)
    submitted[wrong] = "Zebulon Quux"
    result = EpisodeResult(task_id=task.task_id, form_id=task.form_id, actions=len(names) + 1,
                           executed=len(names) + 1, submitted=True, accepted=True, submitted_values=submitted)
    score_episode(result, form, task.ground_truth_fields, RewardWeights())
    return task, form, result, wrong


def _screenshot() -> bytes:
    """A 500 x 300 'page': white, with a 200 x 100 blue block at (50, 40)."""
    img = Image.new("RGB", (500, 300), "white")
    img.paste((0, 0, 255), (50, 40, 250, 140))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_forms_picture_puts_the_cropped_page_left_and_the_task_and_reward_right(tmp_path):
    catalog = FormCatalog.load()
    task, form, result, wrong = _episode(catalog)
    n = len(task.ground_truth_fields)
    assert result.field_accuracy == pytest.approx((n - 1) / n)
    script = 'fill "Patient name" "Zebulon Quux"\nclick "Submit"'

    lines = [text for text, _, _ in panel_text(task, script, result, form)]
    assert task.instruction in lines and script.splitlines()[0] in lines
    label = form.field(wrong).label
    wrong_lines = [s for s in lines if s.startswith("[x] ")]
    assert wrong_lines == [f"[x] {label}: Zebulon Quux  (gold: {task.ground_truth_fields[wrong]})"]
    assert sum(s.startswith("[ok] ") for s in lines) == n - 1
    assert f"Reward {result.reward:.3f}" in lines and "accepted by the server" in lines
    assert f"field_accuracy {result.field_accuracy:.3f} x 0.4" in lines

    picture = _png(compose_snapshot(_screenshot(), task, script, result, form))
    # the page is cropped to its content (the block) plus a 12-pixel margin: 224 x 124
    assert picture.width == 224 + PANEL_W and picture.height >= 124
    assert picture.getpixel((112, 62)) == (0, 0, 255)                         # the block
    panel = np.asarray(picture)[:, 224:]                                        # [H, PANEL_W, 3]
    red = (panel[..., 0] > 150) & (panel[..., 1] < 80) & (panel[..., 2] < 80)   # the wrong field
    green = (panel[..., 1] > 100) & (panel[..., 0] < 60) & (panel[..., 2] < 80)  # the right ones
    assert red.sum() > 50 and green.sum() > red.sum()
    # more fields right -> more green ink, the same picture otherwise
    result_right = EpisodeResult(**{**result.to_dict(), "submitted_values": dict(task.ground_truth_fields)})
    score_episode(result_right, form, task.ground_truth_fields, RewardWeights())
    right = np.asarray(_png(compose_snapshot(_screenshot(), task, script, result_right, form)))[:, 224:]
    assert ((right[..., 0] > 150) & (right[..., 1] < 80) & (right[..., 2] < 80)).sum() < red.sum()

    # no screenshot (a gated episode): a grey box saying why, the panel all the same
    gated = EpisodeResult(task_id=task.task_id, form_id=task.form_id, reason="no_actions")
    score_episode(gated, form, task.ground_truth_fields, RewardWeights())
    assert "gated: no_actions (reward 0)" in [t for t, _, _ in panel_text(task, "", gated, form)]
    assert _png(compose_snapshot(None, task, "", gated, form)).width > PANEL_W

    item = snapshot_item(3, _screenshot(), task, script, result, form)
    written = save_snapshots([item], tmp_path / "media", "iter_0007")
    path = tmp_path / "media" / "forms" / f"iter_0007_3_{task.task_id.replace('/', '-')}.png"
    assert written == [(path, item["caption"])] and path.read_bytes() == item["png"]
    assert task.task_id in item["caption"] and f"reward {result.reward:.3f}" in item["caption"]


# ---------------------------------------------------------------------- molecules: the grid

def _item(index, molecule):
    stable = check_stability(*molecule)[0]
    valid = canonical_smiles(*molecule) is not None          # the scorer's two checks
    return molpics.snapshot_item(index, *molecule, stable, valid, energy_per_atom_eV=-1.25)


def test_molecule_grid_marks_each_molecule_stable_and_valid_in_its_legend(tmp_path):
    items = [_item(i, m) for i, m in enumerate((WATER, METHANE, LONE_CARBON, CRUSHED_C2))]
    legends = [it["legend"] for it in items]
    assert legends[0] == "#0 H2O: stable, valid, -1.25 eV/atom"
    assert legends[1] == "#1 CH4: stable, valid, -1.25 eV/atom"
    # a lone carbon has no bonds: unstable by EDM's table (RDKit still accepts a bare C atom)
    assert legends[2].startswith("#2 C: unstable, ")
    assert legends[3] == "#3 C2: unstable, invalid, -1.25 eV/atom"
    assert [(it["stable"], it["valid"]) for it in items] == [(True, True), (True, True), (False, True),
                                                            (False, False)]

    # RDKit rejects the crushed pair: drawn from the stability check's table, a triple bond
    drawn = molpics.depiction(*CRUSHED_C2)
    assert drawn.GetNumAtoms() == 2 and str(drawn.GetBondWithIdx(0).GetBondType()) == "TRIPLE"
    # valid ones: RDKit's perception, the sampled hydrogens folded into their atom, none invented
    water, methane, carbon = (molpics.depiction(*m) for m in (WATER, METHANE, LONE_CARBON))
    assert water.GetNumAtoms() == 1 and water.GetAtomWithIdx(0).GetTotalNumHs() == 2
    assert methane.GetAtomWithIdx(0).GetTotalNumHs() == 4 and carbon.GetAtomWithIdx(0).GetTotalNumHs() == 0

    grid = _png(molpics.grid_png(items[::-1]))         # any order in: drawn by index
    assert grid.size == (4 * molpics.CELL_PX, molpics.CELL_PX)                # one cell per molecule
    ink = [(np.asarray(grid.crop((k * molpics.CELL_PX, 0, (k + 1) * molpics.CELL_PX, molpics.CELL_PX))) < 200).any(-1)
           .sum() for k in range(4)]
    assert all(v > 100 for v in ink)                                          # every cell drawn on

    five = _png(molpics.grid_png(items + [dict(items[0], index=4, mol=b"")]))
    assert five.size == (4 * molpics.CELL_PX, 2 * molpics.CELL_PX)            # 5 cells: two rows

    written = molpics.save_snapshots(items, tmp_path / "media", "iter_0002")
    path = tmp_path / "media" / "molecules" / "iter_0002.png"
    assert written == [(path, "4 sampled molecules: 2 stable, 3 valid")] and _png(path.read_bytes()).size == grid.size
    assert molpics.save_snapshots([], tmp_path / "media", "iter_0003") == []


# ---------------------------------------------------------------------- config

def test_snapshots_on_an_env_step_task_or_beyond_the_eval_set_is_a_config_error():
    for config in ("fpopp/lift_state.yaml", "ppo/pendulum.yaml"):
        with pytest.raises(ConfigError, match=r"'eval\.snapshots\.episodes'.*eval\.video"):
            load_config(REPO / "configs" / config, ["eval.snapshots.episodes=2"])
        load_config(REPO / "configs" / config, ["eval.snapshots.episodes=0"])           # off: fine
    with pytest.raises(ConfigError, match=r"'eval\.snapshots\.episodes': 5 pictures of 4"):
        load_config(REPO / "configs" / "fed_grpo" / "qm9_small.yaml", ["eval.episodes=4", "eval.snapshots.episodes=5"])
    with pytest.raises(ConfigError, match=r"'eval\.snapshots\.every'"):
        load_config(REPO / "configs" / "fed_grpo" / "qm9_small.yaml", ["eval.snapshots.every=0"])


def test_pictures_are_taken_at_every_kth_evaluation_and_the_last():
    from flowrl_ray.runtime.handles import snapshots_due
    from unit.algorithms.test_fed_grpo import _config
    data = _config()
    data["train"]["iterations"] = 25
    data["eval"] = {"interval": 5, "episodes": 4, "at_start": True, "snapshots": {"episodes": 2, "every": 2}}
    cfg = config_from_dict(data)
    evaluations = (0, 5, 10, 15, 20, 25)          # at start, then every 5 iterations: the 0th .. 5th
    assert [i for i in evaluations if snapshots_due(cfg, i)] == [0, 10, 20, 25]    # even ones, the last
    cfg.train.iterations = 17                      # the last evaluation, an odd one (17 // 5 = 3): pictured too
    assert [i for i in (0, 5, 10, 15, 17) if snapshots_due(cfg, i)] == [0, 10, 17]
    cfg.eval.snapshots.every = 1
    assert [i for i in evaluations if snapshots_due(cfg, i)] == list(evaluations)
    cfg.eval.snapshots.episodes = 0
    assert not any(snapshots_due(cfg, i) for i in evaluations)


def test_a_scoring_family_that_makes_no_pictures_is_a_config_error(tmp_path):
    from flowrl_ray.runtime.trainer import Trainer
    data = {"name": "token-grpo", "algorithm": "flowrl_test_plugins.token_bandit:TokenGRPO",
            "env": {"family": "flowrl_test_plugins.token_bandit", "id": "tokens"},
            "eval": {"episodes": 2, "snapshots": {"episodes": 1}}}
    with pytest.raises(ConfigError, match=r"'eval\.snapshots\.episodes'.*no save_snapshots"):
        Trainer(config_from_dict(data), tmp_path / "run")        # before any Ray starts
    assert not (tmp_path / "run").exists()
