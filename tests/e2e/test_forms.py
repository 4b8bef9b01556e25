"""`flowrl-ray forms serve` as a subprocess: it prints its URL, serves the forms and stops on Ctrl-C."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request

from unit.envs.test_forms import _post


def test_cli_serve_prints_url_and_stops_on_ctrl_c():
    import signal
    import subprocess
    import sys
    # Started with SIGINT ignored, as a shell's background job is: Ctrl-C must still stop it.
    proc = subprocess.Popen([sys.executable, "-m", "flowrl_ray.cli", "forms", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        line = proc.stdout.readline()
        url = line.split(" forms at ")[1].split()[0]
        with urllib.request.urlopen(url, timeout=10) as r:
            assert "job_application" in r.read().decode()
        status, _ = _post(url.rstrip("/") + "/forms/bug_report", {"_episode": "e"})
        assert status == 422
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "bug_report: submission rejected" in out and "stopping" in out
