"""containers/Containerfile installs only what its base image's OS has, and the forms family finds
the browser the image installs (Playwright's own Chromium) before a system one.

No image can be built here, so the Containerfile is read: its base image gives an OS (a table
below, from the images' own build files), and every package manager command must be that OS's,
with no package the OS lacks or ships only as a snap (snaps do not run in containers).
"""

from __future__ import annotations

import re
import shlex
import stat
from pathlib import Path

import pytest

from flowrl_ray.envs.forms.browser import (BrowserUnavailable, _playwright_revisions, find_chromium,
                                           playwright_browsers_dir)

from conftest import REPO

CONTAINERFILE = REPO / "containers" / "Containerfile"

# Base image (repository, or repository:tag prefix) -> its OS. rayproject/ray: Ray's
# docker/base-deps builds on ubuntu:24.04 (CPU) and nvidia/cuda:<v>-devel-ubuntu24.04 (-gpu).
BASE_OS = {"rayproject/ray": "ubuntu", "rayproject/ray-ml": "ubuntu", "anyscale/ray": "ubuntu",
           "ubuntu": "ubuntu", "debian": "debian", "python": "debian", "nvidia/cuda": "ubuntu",
           "fedora": "fedora", "rockylinux": "rhel", "almalinux": "rhel", "alpine": "alpine"}
MANAGERS = {"ubuntu": {"apt-get", "apt"}, "debian": {"apt-get", "apt"}, "fedora": {"dnf", "yum", "microdnf"},
            "rhel": {"dnf", "yum", "microdnf"}, "alpine": {"apk"}}
ALL_MANAGERS = {"apt-get", "apt", "dnf", "yum", "microdnf", "apk", "zypper", "pacman", "snap"}
INSTALL_VERBS = {"install", "add"}
# Packages an OS does not have under that name, or ships only as a snap stub.
ABSENT = {"ubuntu": {"chromium": "Ubuntu has no 'chromium' package (Debian's name)",
                     "chromium-browser": "on Ubuntu only a stub that installs the snap",
                     "firefox": "on Ubuntu (22.04 on) only a stub that installs the snap"},
          "debian": {"chromium-browser": "Debian's package is 'chromium'"}}


def base_os(text: str) -> str:
    image = re.search(r"^FROM\s+(?:--\S+\s+)*(\S+)", text, re.M).group(1)
    repo = image.split("@")[0].rsplit(":", 1)[0] if ":" in image.split("/")[-1] else image
    if repo not in BASE_OS:
        raise AssertionError(f"base image {image}: add its OS to BASE_OS in tests/unit/test_container.py")
    if repo == "nvidia/cuda":
        return "ubuntu" if "ubuntu" in image else "rhel"
    return BASE_OS[repo]


def run_commands(text: str) -> list[list[str]]:
    """Every simple command of every RUN instruction, as words (sudo and VAR=value dropped)."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        m = re.match(r"\s*RUN\s+(.*)", line)
        if not m:
            continue
        for part in re.split(r"&&|\|\||;|\|", m.group(1)):
            words = [w for w in shlex.split(part, comments=True)]
            while words and (words[0] in ("sudo", "env", "-E", "--") or re.fullmatch(r"\w+=.*", words[0])):
                words.pop(0)
            if words:
                out.append(words)
    return out


def problems(text: str) -> list[str]:
    """What in a Containerfile does not match its base image's OS (empty: nothing)."""
    os_name = base_os(text)
    found = []
    for words in run_commands(text):
        manager = words[0]
        if manager not in ALL_MANAGERS:
            continue
        if manager == "snap":
            found.append("snap: snaps do not run in a container")
            continue
        if manager not in MANAGERS[os_name]:
            found.append(f"{manager}: not a package manager of {os_name} (the base image's OS)")
            continue
        verbs = [i for i, w in enumerate(words) if w in INSTALL_VERBS]
        if verbs:
            packages = [w for w in words[verbs[0] + 1:] if not w.startswith("-")]
            for pkg in packages:
                name = re.split(r"[=<>]", pkg)[0]
                if name in ABSENT.get(os_name, {}):
                    found.append(f"{manager} install {name}: {ABSENT[os_name][name]}")
    return found


# --------------------------------------------------------------------------- the Containerfile

def test_containerfile_matches_its_base_image_os():
    text = CONTAINERFILE.read_text()
    assert base_os(text) == "ubuntu"
    assert any(w[:2] == ["apt-get", "install"] for w in run_commands(text))   # the checker sees its commands
    assert problems(text) == []


def test_containerfile_installs_playwrights_chromium_where_the_lookup_finds_it():
    text = CONTAINERFILE.read_text()
    words = run_commands(text)
    install = [w for w in words if w[:4] == ["python", "-m", "playwright", "install"]]
    assert install and "--with-deps" in install[0] and "chromium" in install[0]
    # after the playwright package is installed, and into the directory set for run time too
    assert text.index('"playwright>=') < text.index("playwright install --with-deps")
    env = re.search(r"^ENV PLAYWRIGHT_BROWSERS_PATH=(\S+)", text, re.M)
    assert env and text.index(env.group(0)) < text.index("playwright install --with-deps")


@pytest.mark.parametrize("line, expected", [
    ("RUN sudo apt-get install -y --no-install-recommends swig chromium", "apt-get install chromium: Ubuntu has no"),
    ("RUN apt-get update && apt-get install -y chromium-browser", "apt-get install chromium-browser: on Ubuntu only"),
    ("RUN sudo dnf install -y chromium", "dnf: not a package manager of ubuntu"),
    ("RUN apk add --no-cache chromium", "apk: not a package manager of ubuntu"),
    ("RUN sudo snap install chromium", "snap: snaps do not run"),
])
def test_checker_refuses_what_ubuntu_lacks(line, expected):
    text = "FROM rayproject/ray:2.60.0-py311-gpu\n" + line + "\n"
    found = problems(text)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_checker_knows_other_bases():
    assert problems("FROM debian:bookworm\nRUN apt-get install -y chromium\n") == []
    assert problems("FROM alpine:3.20\nRUN apk add chromium\n") == []
    assert problems("FROM nvidia/cuda:12.8.1-devel-ubuntu24.04\nRUN apt-get install -y \\\n  chromium\n") != []
    with pytest.raises(AssertionError, match="add its OS"):
        problems("FROM quay.io/someone/unknown:1\nRUN true\n")


# --------------------------------------------------------------------------- the browser lookup

def _executable(path: Path, target: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if target:
        path.symlink_to(target)
    else:
        path.write_text("#!/bin/sh\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def no_browser_env(tmp_path, monkeypatch):
    """No FLOWRL_CHROMIUM, an empty Playwright directory, a PATH without browsers."""
    pytest.importorskip("playwright")
    monkeypatch.delenv("FLOWRL_CHROMIUM", raising=False)
    monkeypatch.setenv("PLAYWRIGHT_BROWSERS_PATH", str(tmp_path / "ms-playwright"))
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    return tmp_path


def test_playwrights_own_chromium_comes_before_the_system_one(no_browser_env, monkeypatch):
    tmp = no_browser_env
    assert playwright_browsers_dir() == tmp / "ms-playwright"
    revision = _playwright_revisions()["chromium"]             # the build this playwright drives
    system = _executable(tmp / "bin" / "chromium")
    assert find_chromium() == str(system)                      # nothing of Playwright's yet
    stale = _executable(tmp / "ms-playwright" / "chromium-1" / "chrome-linux64" / "chrome")
    assert find_chromium() == str(system)                      # another release's build is not used
    own = _executable(tmp / "ms-playwright" / f"chromium-{revision}" / "chrome-linux64" / "chrome")
    assert find_chromium() == str(own)
    monkeypatch.setenv("FLOWRL_CHROMIUM", str(stale))          # the env var points anywhere
    assert find_chromium() == str(stale)
    assert find_chromium(str(system)) == str(system)           # env.kwargs.chromium first of all


def test_no_browser_error_says_where_it_looked(no_browser_env, monkeypatch):
    tmp = no_browser_env
    with pytest.raises(BrowserUnavailable) as e:
        find_chromium()
    msg = str(e.value)
    revision = _playwright_revisions()["chromium"]
    assert str(tmp / "ms-playwright" / f"chromium-{revision}" / "chrome-linux64" / "chrome") in msg
    assert "chromium, chromium-browser, google-chrome" in msg and "on PATH" in msg
    assert "playwright install --with-deps chromium" in msg and "FLOWRL_CHROMIUM" in msg
    monkeypatch.setenv("FLOWRL_CHROMIUM", "/nowhere/chrome")
    with pytest.raises(BrowserUnavailable, match="FLOWRL_CHROMIUM: Chromium executable '/nowhere/chrome'"):
        find_chromium()
