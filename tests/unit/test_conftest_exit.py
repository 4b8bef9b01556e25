"""The suite's exit (tests/conftest.py ``pytest_unconfigure``): pytest's status is kept, Python's
exit handlers run, and the interpreter's teardown is skipped unless asked for; also in the
pytest-xdist worker processes that `make test` runs the suite in."""

import os
import subprocess
import sys

import pytest

from conftest import TESTS

INNER = '''
import atexit, pathlib
OUT = pathlib.Path(r"{out}")
atexit.register(lambda: (OUT / "atexit").write_text("ran"))

class Teardown:   # its __del__ runs when the interpreter tears the module down
    def __init__(self, path):
        self.path = path

    def __del__(self, write=pathlib.Path.write_text):
        write(self.path, "ran")

KEEP = Teardown(OUT / "teardown")

def test_one():
    assert {ok}
'''


def run_inner(tmp_path, ok: bool, native: bool, workers: int = 0):
    (tmp_path / "test_inner.py").write_text(INNER.format(out=tmp_path, ok=ok))
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    env.pop("FLOWRL_TEST_NATIVE_TEARDOWN", None)
    if native:
        env["FLOWRL_TEST_NATIVE_TEARDOWN"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_inner.py"),
                           *(["-n", str(workers), "--dist", "loadfile"] if workers else [])],
                          env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, (tmp_path / "atexit").exists(), (tmp_path / "teardown").exists()


def test_status_kept_exit_handlers_run_and_teardown_skipped(tmp_path):
    assert run_inner(tmp_path, ok=True, native=False) == (0, True, False)


def test_a_failing_test_still_fails_the_process(tmp_path):
    assert run_inner(tmp_path, ok=False, native=False) == (1, True, False)


def test_native_teardown_kept_on_request(tmp_path):
    assert run_inner(tmp_path, ok=True, native=True) == (0, True, True)


@pytest.mark.parametrize("ok,status", [(True, 0), (False, 1)])
def test_in_xdist_workers_the_status_reaches_the_controller(tmp_path, ok, status):
    """A worker ends by the same exit after it has sent its results: a pass passes, a failure fails
    (the test module, and its exit handler, run in the worker)."""
    assert run_inner(tmp_path, ok=ok, native=False, workers=2) == (status, True, False)
