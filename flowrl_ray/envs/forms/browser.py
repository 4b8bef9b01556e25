"""Browser rollouts: action scripts executed in a real headless Chromium through Playwright.

:class:`BrowserPool` keeps one browser with ``pages`` pages (each in its own context) and runs up
to ``pages`` episodes at once. Playwright's async API runs on an event loop in a background
thread that the pool owns, so the pool is called from ordinary synchronous code (a Ray actor
method, a CLI verb, a test) and the browser stays alive between calls.

One episode: parse the script; load ``/forms/<id>?episode=<uuid>`` in a free page; read the page's
element map (every label, legend and button, with the element it names: :mod:`.page`); execute the
actions one by one (each bounded by ``action_timeout_s``; a failed action is counted, not fatal); for an
episode asked to be pictured, take a screenshot of the whole page just before the submit click (after the
last action when the script never submits); collect what the server recorded under the episode's key;
score (:mod:`flowrl_ray.envs.forms.reward`); reset the page to ``about:blank``. The whole episode
is bounded by ``rollout_timeout_s`` (past it: reward 0, reason ``timeout``, and the page is replaced).

Failures: when the browser dies (killed, out of memory) the episodes in flight score 0 with reason
``browser_crash`` and the next episode relaunches it; a crashed page is replaced the same way. The
browser is also restarted every ``restart_every`` episodes (between episodes, never under one), so
that a leak in a long run cannot grow without bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from flowrl_ray.envs.forms.actions import ParsedScript, parse_actions
from flowrl_ray.envs.forms.page import ELEMENT_MAP_JS, ElementMap, run_action
from flowrl_ray.envs.forms.reward import EpisodeResult, RewardWeights, score_episode
from flowrl_ray.envs.forms.server import FormServer
from flowrl_ray.envs.forms.tasks import FormTask

CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage")
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MAX_ERRORS_KEPT = 10
CLOSE_TIMEOUT_S = 10.0


class BrowserUnavailable(RuntimeError):
    """Playwright or a Chromium executable is missing, or the browser cannot start."""


def playwright_browsers_dir() -> Path:
    """Where Playwright keeps the browsers that `playwright install` downloads (Linux):
    $PLAYWRIGHT_BROWSERS_PATH, else $XDG_CACHE_HOME/ms-playwright, else ~/.cache/ms-playwright."""
    env = os.environ.get("PLAYWRIGHT_BROWSERS_PATH")
    if env and env != "0":
        return Path(env).expanduser()
    if env == "0":                                   # installed inside the package
        try:
            import playwright
            return Path(playwright.__file__).parent / "driver" / "package" / ".local-browsers"
        except ImportError:
            pass
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ms-playwright"


def _playwright_revisions() -> dict[str, str]:
    """{"chromium": rev, "chromium-headless-shell": rev} that the installed playwright package
    drives (its browsers.json); {} when playwright is not installed."""
    try:
        import playwright
    except ImportError:
        return {}
    spec = Path(playwright.__file__).parent / "driver" / "package" / "browsers.json"
    try:
        browsers = json.loads(spec.read_text())["browsers"]
    except (OSError, ValueError, KeyError):
        return {}
    return {b["name"]: b["revision"] for b in browsers if b.get("name") in ("chromium", "chromium-headless-shell")}


# Executables inside a Playwright browser directory, newest layout first (1.49+ Chrome for
# Testing builds; older releases unpacked to chrome-linux/).
PLAYWRIGHT_EXECUTABLES = {
    "chromium": ("chrome-linux64/chrome", "chrome-linux-arm64/chrome", "chrome-linux/chrome"),
    "chromium-headless-shell": ("chrome-headless-shell-linux64/chrome-headless-shell",
                                "chrome-headless-shell-linux-arm64/chrome-headless-shell",
                                "chrome-linux/headless_shell"),
}


def playwright_chromium() -> tuple[str | None, list[str]]:
    """(Playwright's own Chromium for the installed playwright package, or None; the paths
    looked at)."""
    root, looked = playwright_browsers_dir(), []
    for name, revision in _playwright_revisions().items():
        directory = root / f"{name.replace('-', '_')}-{revision}"
        for rel in PLAYWRIGHT_EXECUTABLES[name]:
            path = directory / rel
            looked.append(str(path))
            if path.is_file() and os.access(path, os.X_OK):
                return str(path), looked
    return None, looked


def find_chromium(explicit: str | None = None) -> str:
    """The Chromium executable, the first of: ``explicit`` (env.kwargs.chromium), $FLOWRL_CHROMIUM,
    Playwright's own Chromium (``python -m playwright install chromium``; the build the installed
    playwright package expects), chromium / chromium-browser / google-chrome on PATH."""
    for cand, key in ((explicit, "env.kwargs.chromium"), (os.environ.get("FLOWRL_CHROMIUM"), "FLOWRL_CHROMIUM")):
        if cand:
            path = shutil.which(cand) or (cand if Path(cand).is_file() else None)
            if path is None:
                raise BrowserUnavailable(f"{key}: Chromium executable {cand!r} not found")
            return path
    path, looked = playwright_chromium()
    if path:
        return path
    for name in CHROMIUM_CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    own = (f"Playwright's Chromium at {' or '.join(looked)}" if looked else
           "Playwright's Chromium (the playwright package is not installed)")
    raise BrowserUnavailable(f"no Chromium found: looked for {own}, then for {', '.join(CHROMIUM_CANDIDATES)} "
                             f"on PATH; install one with `python -m playwright install --with-deps chromium`, "
                             f"or point FLOWRL_CHROMIUM (or env.kwargs.chromium) at a Chromium executable")


def _submits(emap: ElementMap, action) -> bool:
    """Whether ``action`` clicks the page's submit button."""
    if action.verb != "click":
        return False
    el, _ = emap.find(action.label, ("button",))
    return el is not None and el.type == "submit"


class _Crash(Exception):
    """The browser or the page died under an episode."""


@dataclass
class _Slot:
    context: object
    page: object
    generation: int
    broken: bool = False


@dataclass
class PoolStats:
    episodes: int = 0
    launches: int = 0
    crashes: int = 0              # episodes that ended in browser_crash
    timeouts: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------- the pool

class BrowserPool:
    """One Chromium, ``pages`` pages, episodes run concurrently; see the module docstring.

    ``execute([(task, action_text), ...], screenshots=(i, ...))`` returns one
    :class:`EpisodeResult` per episode, in order; the episodes at the positions in
    ``screenshots`` carry a PNG of the filled page in ``result.screenshot``. ``task`` is a
    :class:`FormTask` (scored against its gold fields) or a form id (a free run: field accuracy
    None). Use as a context manager or call :meth:`close`.
    """

    def __init__(self, server: FormServer, pages: int = 4, action_timeout_s: float = 5.0,
                 rollout_timeout_s: float = 30.0, restart_every: int = 200,
                 weights: RewardWeights | None = None, chromium: str | None = None):
        if pages < 1 or action_timeout_s <= 0 or rollout_timeout_s <= 0 or restart_every < 0:
            raise ValueError("pages >= 1, action_timeout_s > 0, rollout_timeout_s > 0, restart_every >= 0")
        self.server = server
        self.pages = pages
        self.action_timeout_s = action_timeout_s
        self.rollout_timeout_s = rollout_timeout_s
        self.restart_every = restart_every
        self.weights = weights or RewardWeights()
        self.executable = find_chromium(chromium)
        self.stats = PoolStats()
        self._marker = f"--flowrl-browser-pool={uuid.uuid4().hex}"   # finds our browser's pid
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pw = None
        self._browser = None
        self._generation = 0
        self._since_launch = 0
        self._slots: asyncio.Queue | None = None
        self._launch_lock: asyncio.Lock | None = None
        self._execute_lock = threading.Lock()

    # -- lifecycle (caller's thread)

    def start(self) -> "BrowserPool":
        if self._loop is not None:
            return self
        try:
            import playwright.async_api  # noqa: F401
        except ImportError:
            raise BrowserUnavailable("the Python package 'playwright' is not installed "
                                     "(pip install 'flowrl-ray[forms]')") from None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flowrl-browser-pool", daemon=True)
        self._thread.start()
        try:
            self._call(self._startup())
        except BaseException:
            self.close()
            raise
        return self

    def execute(self, episodes: Sequence[tuple[FormTask | str, str]],
                screenshots: Sequence[int] = ()) -> list[EpisodeResult]:
        # One batch at a time: a periodic restart must never fall under another caller's episodes.
        with self._execute_lock:
            if self._loop is None:
                self.start()
            return self._call(self._run_batch(list(episodes), set(screenshots)))

    def close(self) -> None:
        if self._loop is None:
            return
        try:
            if self._thread is not None and self._thread.is_alive():
                self._call(self._shutdown(), timeout=2 * CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - best effort: the browser may already be gone
            pass
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=CLOSE_TIMEOUT_S)
            self._loop.close()
            self._loop = self._thread = None

    def __enter__(self) -> "BrowserPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def episodes_since_launch(self) -> int:
        """Episodes run by the current browser (a restart is due at ``restart_every``)."""
        return self._since_launch

    def browser_pid(self) -> int | None:
        """The pid of the browser's main process (Linux; None when not running)."""
        marker = self._marker.encode()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in argv and not any(a.startswith(b"--type=") for a in argv):
                return int(d.name)
        return None

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- browser management (loop thread)

    async def _startup(self) -> None:
        from playwright.async_api import async_playwright
        self._slots = asyncio.Queue()
        self._launch_lock = asyncio.Lock()
        self._pw = await async_playwright().start()
        await self._launch()

    async def _launch(self) -> None:
        from playwright.async_api import async_playwright
        for attempt in range(2):
            try:
                self._browser = await self._pw.chromium.launch(
                    executable_path=self.executable, headless=True, args=[*CHROMIUM_ARGS, self._marker])
                break
            except Exception as e:  # noqa: BLE001 - reported with the executable's path
                if attempt == 1:
                    raise BrowserUnavailable(f"cannot launch {self.executable}: {str(e).splitlines()[0]}") from None
                # The Playwright driver itself may have died with the browser: start a fresh one.
                try:
                    await asyncio.wait_for(self._pw.stop(), CLOSE_TIMEOUT_S)
                except Exception:  # noqa: BLE001
                    pass
                self._pw = await async_playwright().start()
        self._generation += 1
        self._since_launch = 0
        self.stats.launches += 1
        while not self._slots.empty():                 # slots of the previous browser
            self._slots.get_nowait()
        for _ in range(self.pages):
            self._slots.put_nowait(await self._new_slot())

    async def _new_slot(self) -> _Slot:
        context = await self._browser.new_context()
        page = await context.new_page()
        page.set_default_timeout(self.action_timeout_s * 1000)
        return _Slot(context, page, self._generation)

    async def _close_browser(self) -> None:
        browser, self._browser = self._browser, None
        if browser is not None:
            try:
                await asyncio.wait_for(browser.close(), CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - it may be dead already
                pass

    async def _ensure_browser(self, restart: bool = False) -> None:
        async with self._launch_lock:
            if restart or self._browser is None or not self._browser.is_connected():
                await self._close_browser()
                await self._launch()

    async def _release(self, slot: _Slot) -> None:
        """Reset the slot's page and give it back, or replace it if it broke."""
        current = slot.generation == self._generation and self._browser is not None and self._browser.is_connected()
        if current and not slot.broken:
            try:
                await asyncio.wait_for(slot.page.goto("about:blank"), self.action_timeout_s)
                self._slots.put_nowait(slot)
                return
            except Exception:  # noqa: BLE001 - a page that cannot even go blank is replaced
                pass
        try:
            await asyncio.wait_for(slot.context.close(), CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            pass
        if current:
            try:
                self._slots.put_nowait(await self._new_slot())
            except Exception:  # noqa: BLE001 - the browser died meanwhile: the relaunch refills
                pass

    async def _shutdown(self) -> None:
        await self._close_browser()
        if self._pw is not None:
            try:
                await asyncio.wait_for(self._pw.stop(), CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001
                pass
            self._pw = None

    # -- episodes (loop thread)

    async def _run_batch(self, items: list, screenshots: set[int]) -> list[EpisodeResult]:
        results: list[EpisodeResult | None] = [None] * len(items)

        async def one(i: int) -> None:
            results[i] = await self._episode(*items[i], screenshot=i in screenshots)

        pos = 0
        while pos < len(items):
            if self.restart_every and self._since_launch >= self.restart_every:
                await self._ensure_browser(restart=True)      # nothing is in flight here
            n = len(items) - pos
            if self.restart_every:
                n = min(n, max(1, self.restart_every - self._since_launch))
            await asyncio.gather(*(one(i) for i in range(pos, pos + n)))
            pos += n
        return results

    async def _episode(self, task: FormTask | str, text: str, screenshot: bool = False) -> EpisodeResult:
        gold_task = task if isinstance(task, FormTask) else None
        form_id = gold_task.form_id if gold_task else str(task)
        form = self.server.catalog.forms.get(form_id)
        result = EpisodeResult(task_id=gold_task.task_id if gold_task else None, form_id=form_id)
        parsed = parse_actions(text)
        result.actions, result.unparseable_lines = len(parsed.actions), parsed.unparseable
        if form is None:
            result.reason = "unknown_task"
            result.errors.append(f"unknown form {form_id!r}")
        elif not parsed.actions:
            result.reason = "no_actions"
        else:
            await self._play_guarded(form, parsed, result, screenshot)
        score_episode(result, form, gold_task.ground_truth_fields if gold_task else None, self.weights)
        self._since_launch += 1
        self.stats.episodes += 1
        if result.reason:
            self.stats.reasons[result.reason] = self.stats.reasons.get(result.reason, 0) + 1
        return result

    async def _play_guarded(self, form, parsed: ParsedScript, result: EpisodeResult, screenshot: bool) -> None:
        await self._ensure_browser()
        slot: _Slot = await self._slots.get()
        while slot.generation != self._generation:          # left over from a dead browser
            slot = await self._slots.get()
        key = uuid.uuid4().hex
        t0 = time.perf_counter()                    # from here: waiting for a free page is not counted
        try:
            await asyncio.wait_for(self._play(slot, form, parsed, key, result, screenshot), self.rollout_timeout_s)
        except asyncio.TimeoutError:
            slot.broken = True
            result.reason = "timeout"
            self.stats.timeouts += 1
        except _Crash as e:
            slot.broken = True
            result.reason = "browser_crash"
            result.errors.append(str(e))
            self.stats.crashes += 1
        except Exception as e:  # noqa: BLE001 - anything else the browser throws: gated, never raised
            slot.broken = True
            result.reason = "browser_crash" if self._is_crash(slot, e) else "page_error"
            result.errors.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            self.stats.crashes += result.reason == "browser_crash"
        finally:
            result.duration_s = time.perf_counter() - t0
            submissions = self.server.store.take(key)
            await self._release(slot)
        if not result.reason and submissions:
            last = submissions[-1]
            result.submitted, result.accepted = True, last.accepted
            result.submitted_values, result.submission_errors = last.values, list(last.errors)

    def _is_crash(self, slot: _Slot, err: Exception) -> bool:
        msg = str(err).lower()
        return (self._browser is None or not self._browser.is_connected() or slot.page.is_closed()
                or type(err).__name__ == "TargetClosedError" or "has been closed" in msg or "crash" in msg)

    async def _play(self, slot: _Slot, form, parsed: ParsedScript, key: str, result: EpisodeResult,
                    screenshot: bool = False) -> None:
        from playwright.async_api import Error as PlaywrightError
        page = slot.page
        try:
            response = await page.goto(self.server.form_url(form.id, key), wait_until="load")
        except PlaywrightError as e:
            if self._is_crash(slot, e):
                raise _Crash(f"browser died loading the form: {str(e).splitlines()[0]}") from None
            result.reason = "load_error"
            result.errors.append(str(e).splitlines()[0])
            return
        if response is None or not response.ok:
            result.reason = "load_error"
            result.errors.append(f"GET {form.path}: HTTP {response.status if response else '?'}")
            return
        emap = await self._element_map(slot)
        for action in parsed.actions:
            if screenshot and _submits(emap, action):        # the filled form, as about to be sent
                result.screenshot = await self._screenshot(page)
            try:
                error, navigated = await run_action(page, emap, action, self.action_timeout_s)
            except PlaywrightError as e:
                if self._is_crash(slot, e):
                    raise _Crash(f"line {action.line}: {str(e).splitlines()[0]}") from None
                error, navigated = str(e).splitlines()[0] if str(e) else type(e).__name__, False
            if error:
                if len(result.errors) < MAX_ERRORS_KEPT:
                    result.errors.append(f"line {action.line}: {error}")
            else:
                result.executed += 1
            if navigated:
                emap = await self._element_map(slot)
        if screenshot and result.screenshot is None:          # never submitted: the page as left
            result.screenshot = await self._screenshot(page)

    async def _screenshot(self, page) -> bytes | None:
        """A PNG of the whole page, or None if the browser cannot take one (never fails the episode)."""
        try:
            return await asyncio.wait_for(page.screenshot(full_page=True), self.action_timeout_s)
        except Exception:  # noqa: BLE001 - a missing picture is not an episode error
            return None

    async def _element_map(self, slot: _Slot) -> ElementMap:
        from playwright.async_api import Error as PlaywrightError
        try:
            entries = await asyncio.wait_for(slot.page.evaluate(ELEMENT_MAP_JS), self.action_timeout_s)
        except PlaywrightError as e:
            if self._is_crash(slot, e):
                raise _Crash(f"reading the page: {str(e).splitlines()[0]}") from None
            entries = []                      # e.g. evaluated during a navigation: an empty map
        return ElementMap(entries)
