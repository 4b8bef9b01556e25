"""The forms family in a real headless Chromium (Playwright): gold scripts score 1, failures are
counted, a killed browser is recovered, timeouts and periodic restarts, the scorer contract and
`flowrl-ray forms run`. Skipped when Playwright or Chromium is missing."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("playwright.async_api")

from flowrl_ray.envs.forms import (BrowserPool, BrowserUnavailable, FormCatalog, FormServer, find_chromium,  # noqa: E402
                                   gold_actions, load_tasks, make_scorer)

try:
    find_chromium()
except BrowserUnavailable as e:                                    # pragma: no cover - depends on the machine
    pytest.skip(str(e), allow_module_level=True)


@pytest.fixture(scope="module")
def catalog():
    return FormCatalog.load()


@pytest.fixture(scope="module")
def server(catalog):
    with FormServer(catalog) as srv:
        yield srv


@pytest.fixture(scope="module")
def pool(server):
    with BrowserPool(server, pages=3, action_timeout_s=5, rollout_timeout_s=30, restart_every=0) as p:
        yield p


def _one_per_domain(catalog, split="train"):
    """One task per domain (every field type among them), plus a held-out form."""
    seen, out = set(), []
    for t in load_tasks(split, per_form=1, catalog=catalog) + load_tasks("heldout_forms", per_form=1, catalog=catalog):
        d = catalog[t.form_id].domain
        if d not in seen:
            seen.add(d)
            out.append(t)
    return out + [t for t in load_tasks("heldout_forms", per_form=1, catalog=catalog)[:1]]


def test_gold_scripts_score_one_in_chromium(pool, catalog):
    tasks = _one_per_domain(catalog)
    assert {f.type for t in tasks for f in catalog[t.form_id].fields} >= {"text", "email", "tel", "number", "date",
                                                                          "select", "radio", "checkbox", "textarea"}
    results = pool.execute([(t, gold_actions(t, catalog)) for t in tasks])
    for t, r in zip(tasks, results):
        assert (r.reward, r.task_completion, r.field_accuracy, r.execution_completeness) == (1.0, 1.0, 1.0, 1.0), \
            r.to_dict()
        assert r.reason == "" and r.accepted and r.executed == r.actions and r.task_id == t.task_id


def _task(catalog, form_id, split="train"):
    return next(t for t in load_tasks(split, per_form=1, catalog=catalog) if t.form_id == form_id)


def test_failed_actions_are_counted_not_fatal(pool, catalog):
    task = _task(catalog, "course_enrollment")
    gold = gold_actions(task, catalog).splitlines()
    script = "\n".join([
        'fill "no such field" "x"',                    # unknown label
        'fill "Term" "Fall"',                          # wrong kind (a radio group)
        'select "Course" "Underwater Basketry"',       # no such option
        'fill "Start date" "next tuesday"',            # a date input refuses this
        'fill "Credits" "many"',                       # a number input refuses this
        "this line is not an action",
        *gold,
    ])
    [r] = pool.execute([(task, script)])
    assert r.reason == "" and r.unparseable_lines == 1
    assert r.actions == len(gold) + 5 and r.executed == len(gold)
    assert r.accepted and r.field_accuracy == 1.0
    assert r.execution_completeness == pytest.approx(len(gold) / (len(gold) + 6))
    assert r.reward == pytest.approx(0.8 + 0.2 * len(gold) / (len(gold) + 6))
    assert any("no element labelled 'no such field'" in e for e in r.errors)
    assert any("has no option 'Underwater Basketry'" in e for e in r.errors)


def test_labels_match_ignoring_case_and_whitespace(pool, catalog):
    task = _task(catalog, "bug_report")
    lines = []
    for line in gold_actions(task, catalog).splitlines():      # upper-case the verb and label, pad the label
        verb, rest = line.split(" ", 1)
        end = rest.index('"', 1)
        lines.append(f'{verb.upper()}   "  {rest[1:end].upper()}   "{rest[end + 1:]}')
    [r] = pool.execute([(task, "\n".join(lines))])
    assert r.executed == r.actions and r.reward == 1.0, r.to_dict()


def test_submission_without_task_reports_null_accuracy(pool, catalog):
    task = load_tasks("train", per_form=1, catalog=catalog)[3]
    [r] = pool.execute([(task.form_id, gold_actions(task, catalog))])
    assert r.field_accuracy is None and r.task_completion == 1.0 and r.reward == pytest.approx(0.6)


def test_killed_browser_mid_episode_is_recovered(pool, server, catalog):
    task = load_tasks("train", per_form=1, catalog=catalog)[5]
    script = gold_actions(task, catalog)
    launches, posts = pool.stats.launches, server.posts_received
    server.submit_delay_s = 3.0                      # the submission hangs: kill the browser meanwhile
    out: list = []
    runner = threading.Thread(target=lambda: out.extend(pool.execute([(task, script)])))
    try:
        runner.start()
        deadline = time.monotonic() + 30
        while server.posts_received == posts and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.posts_received > posts, "the episode never submitted"
        pid = pool.browser_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        runner.join(timeout=30)
    finally:
        server.submit_delay_s = 0.0
    [r] = out
    assert r.reason == "browser_crash" and r.reward == 0.0 and r.task_completion == 0.0
    [again] = pool.execute([(task, script)])
    assert again.reward == 1.0 and again.reason == ""
    assert pool.stats.launches == launches + 1 and pool.browser_pid() not in (None, pid)


def test_rollout_timeout_and_periodic_restart(pool, server, catalog):
    tasks = load_tasks("train", per_form=1, catalog=catalog)[6:9]
    scripts = [gold_actions(t, catalog) for t in tasks]
    server.submit_delay_s, pool.rollout_timeout_s = 3.0, 1.0
    try:
        [r] = pool.execute([(tasks[0], scripts[0])])
    finally:
        server.submit_delay_s, pool.rollout_timeout_s = 0.0, 30.0
    assert r.reason == "timeout" and r.reward == 0.0
    launches, since = pool.stats.launches, pool.episodes_since_launch
    pool.restart_every = 2
    try:
        results = pool.execute(list(zip(tasks, scripts)))
    finally:
        pool.restart_every = 0
    # a restart is due at once if the browser already ran 2 episodes, and again after 2 more;
    # restarts happen between episodes and lose none
    assert [x.reward for x in results] == [1.0] * 3
    assert pool.stats.launches == launches + (since >= 2) + 1


def test_scorer_contract(catalog):
    cfg = SimpleNamespace(family="forms", id="train", kwargs={"pages": 2, "restart_every": 50})
    scorer = make_scorer(cfg, seed=0, worker_id=7)
    try:
        tasks = load_tasks("train", per_form=1, catalog=catalog)[:2]
        samples = {"ids": np.array([10, 11, 12, 13]),
                   "task_ids": [tasks[0].task_id, tasks[1].task_id, tasks[1].task_id, "nonsense"],
                   "texts": [gold_actions(tasks[0], catalog), "I'd rather not", 'click "nothing here"',
                             gold_actions(tasks[0], catalog)]}
        batch = scorer.score(samples)
    finally:
        scorer.close()
    d = batch.data
    assert set(d) == {"ids", "rewards", "task_completion", "field_accuracy", "execution_completeness",
                      "unparseable_lines", "reason", "valid"}
    assert all(len(v) == 4 for v in d.values())
    np.testing.assert_array_equal(d["ids"], [10, 11, 12, 13])
    assert d["rewards"].dtype == np.float32 and d["unparseable_lines"].dtype.kind == "i"
    assert d["rewards"][0] == 1.0 and d["field_accuracy"][0] == 1.0
    assert list(d["reason"]) == ["", "no_actions", "", "unknown_task"]
    assert d["valid"].dtype == bool and d["valid"].all()      # no crash or timeout here
    assert d["rewards"][1] == 0.0 and d["unparseable_lines"][1] == 1
    assert d["task_completion"][2] == 0.0 and d["execution_completeness"][2] == 0.0
    m = batch.meta
    assert (m.policy_version, m.worker_id, m.env_steps) == (-1, 7, 4)
    assert m.episode_returns == d["rewards"].tolist() and m.episode_lengths[:3] == [len(samples["texts"][0].splitlines()), 0, 1]
    assert m.extra["reasons"] == {"no_actions": 1, "unknown_task": 1}
    assert m.extra["successes"] == [True, False, False, False]
    assert scorer.server._httpd is None                           # close() stopped the server


def test_cli_run_prints_the_breakdown(tmp_path, capsys, catalog):
    from flowrl_ray.cli import main
    task = load_tasks("heldout_forms", per_form=1, catalog=catalog)[0]
    script = tmp_path / "actions.txt"
    script.write_text(gold_actions(task, catalog))
    assert main(["forms", "run", task.form_id, "--actions", str(script), "--task", task.task_id]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reward"] == 1.0 and out["field_accuracy"] == 1.0 and out["task_id"] == task.task_id
