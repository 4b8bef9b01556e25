"""The browser lookup with a real browser: the system Chromium placed where Playwright's installer
puts its own is found there, launched, and a gold script scores 1 (the lookup rules and the
Containerfile checks: tests/unit/test_container.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowrl_ray.envs.forms.browser import _playwright_revisions

from unit.test_container import _executable, no_browser_env  # noqa: F401 (a fixture)


def test_a_browser_found_in_playwrights_directory_runs_a_form(no_browser_env, monkeypatch):
    """The whole path with a real browser: the system Chromium placed where Playwright's
    installer puts its own, found there, launched, and a gold script scores 1."""
    import shutil as _shutil
    real = "/usr/bin/chromium" if Path("/usr/bin/chromium").is_file() else _shutil.which("chromium")
    if not real:
        pytest.skip("no Chromium on this machine")
    from flowrl_ray.envs.forms import BrowserPool, FormCatalog, FormServer, gold_actions, load_tasks
    revision = _playwright_revisions()["chromium-headless-shell"]
    shell = _executable(no_browser_env / "ms-playwright" / f"chromium_headless_shell-{revision}"
                        / "chrome-headless-shell-linux64" / "chrome-headless-shell", target=real)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))   # the system one is there too
    catalog = FormCatalog.load()
    task = load_tasks("train", per_form=1, catalog=catalog)[0]
    with FormServer(catalog) as server, BrowserPool(server, pages=1, restart_every=0) as pool:
        assert pool.executable == str(shell)
        [result] = pool.execute([(task, gold_actions(task, catalog))])
    assert result.reward == 1.0, result.to_dict()
