"""Helpers shared by the benchmark scripts: machine description, CPU-load accounting, tables,
and writing ``benchmarks/results/<name>.md``. Standard library only (no psutil: /proc is read
directly, so this is Linux-only; elsewhere the load section says "unavailable")."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


# --------------------------------------------------------------------------- machine

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _gpu() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except Exception:  # noqa: BLE001 - description only
        pass
    return "none"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001
        return "not installed"


def machine_info() -> dict[str, str]:
    cores = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cores
    return {
        "CPU": _cpu_model(),
        "cores": f"{cores} logical ({usable} usable by this process)",
        "RAM": _ram_gib(),
        "GPU": _gpu(),
        "OS": platform.platform(),
        "Python": platform.python_version(),
        "torch": _version("torch"),
        "ray": _version("ray"),
        "gymnasium": _version("gymnasium"),
        "mujoco": _version("mujoco"),
    }


def command_line() -> str:
    """The command that produced this run, as typed from the repository root."""
    exe = sys.executable
    try:
        exe = os.path.relpath(exe, REPO_ROOT) if Path(exe).is_relative_to(REPO_ROOT) else exe
    except ValueError:
        pass
    script = os.path.relpath(Path(sys.argv[0]).resolve(), REPO_ROOT)
    return " ".join(shlex.quote(a) for a in [exe, script, *sys.argv[1:]])


# --------------------------------------------------------------------------- CPU load

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_table() -> dict[int, tuple[str, int, float]]:
    """pid -> (name, parent pid, CPU seconds used so far: user + system)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        # The name is in parentheses and may itself contain spaces or parentheses.
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        out[int(entry.name)] = (name, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def _descendants(table: dict, root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    seen, stack = set(), [root]
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            stack.extend(children.get(pid, []))
    return seen


class LoadMonitor:
    """What loaded the CPU while a benchmark ran: load averages before/after, and the CPU time
    used by this process, by its children (Ray's raylet, GCS, workers, ...) and by every other
    process on the machine, each as an average number of busy cores over the wall time.

    Children are attributed by process tree when the monitor stops; processes that appeared
    and exited in between are not seen (their time is in "unaccounted")."""

    def __init__(self) -> None:
        self.loadavg_before = os.getloadavg()
        self.t0 = time.monotonic()
        self.busy0 = self._busy_seconds()
        self.table0 = self._table()

    @staticmethod
    def _table() -> dict:
        try:
            return _proc_table()
        except OSError:
            return {}

    @staticmethod
    def _busy_seconds() -> float | None:
        """Machine-wide busy CPU seconds (all cores) from /proc/stat."""
        try:
            vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return (sum(vals[:8]) - idle) / _TICK

    def stop(self) -> dict:
        wall = time.monotonic() - self.t0
        busy1, table1 = self._busy_seconds(), self._table()
        mine = _descendants(table1, os.getpid())
        groups: dict[str, float] = {}
        for pid, (name, _, cpu1) in table1.items():
            cpu0 = self.table0.get(pid, (name, 0, 0.0))[2] if pid in self.table0 else 0.0
            d = cpu1 - cpu0
            if d <= 0:
                continue
            if pid == os.getpid():
                key = "this process (driver / single-process baseline)"
            elif pid in mine:
                key = f"child: {name}"
            else:
                key = f"other: {name}"
            groups[key] = groups.get(key, 0.0) + d
        return {"wall_s": wall, "loadavg_before": self.loadavg_before, "loadavg_after": os.getloadavg(),
                "machine_busy_cores": None if busy1 is None or self.busy0 is None else (busy1 - self.busy0) / wall,
                "cores_by_process": {k: v / wall for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}


def load_lines(load: dict, top: int = 8) -> list[str]:
    """Markdown bullet lines describing a LoadMonitor.stop() result."""
    before = ", ".join(f"{x:.2f}" for x in load["loadavg_before"])
    after = ", ".join(f"{x:.2f}" for x in load["loadavg_after"])
    lines = [f"- load average (1, 5, 15 min) before: {before}; after: {after}",
             f"- wall time: {load['wall_s']:.1f} s"]
    if load["machine_busy_cores"] is not None:
        lines.append(f"- whole machine busy: {load['machine_busy_cores']:.2f} cores on average "
                     f"(of {os.cpu_count()})")
    items = list(load["cores_by_process"].items())
    others = sum(v for k, v in items if k.startswith("other:"))
    lines.append(f"- processes outside this benchmark: {others:.2f} cores on average")
    shown = [f"{k} {v:.2f}" for k, v in items[:top] if v >= 0.005]
    if shown:
        lines.append("- busiest processes (average cores): " + "; ".join(shown))
    return lines


# --------------------------------------------------------------------------- output

def md_table(headers: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(headers), sep, *(fmt(r) for r in cells)])


def machine_section() -> str:
    return "\n".join(f"- {k}: {v}" for k, v in machine_info().items())


def write_results(name: str, title: str, body: str, command: str | None = None) -> Path:
    """Write benchmarks/results/<name>.md (title, command, date, machine, body), print it, and
    return the path."""
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    text = (f"# {title}\n\n"
            f"Command (from the repository root):\n\n```\n{command or command_line()}\n```\n\n"
            f"Date: {now}\n\n"
            f"## Machine\n\n{machine_section()}\n\n"
            f"{body.rstrip()}\n")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.md"
    path.write_text(text)
    print("\n" + text, flush=True)
    print(f"[bench] results written to {os.path.relpath(path, Path.cwd())}", flush=True)
    return path


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "flowrl_ray", "configs"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "unknown") + (" (flowrl_ray/ or configs/ modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
