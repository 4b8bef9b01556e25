"""Helpers shared by the benchmark scripts: machine description, CPU-load accounting, tables,
and writing ``benchmarks/results/<name>.md``. Standard library only (no psutil: /proc is read
directly, so this is Linux-only; elsewhere the load section says "unavailable")."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def portable(obj):
    """``obj`` with every path inside the repository written relative to its root, so that a
    results file names no machine's directories (``/home/me/flowrl-ray/runs/a`` -> ``runs/a``).
    Walks dicts, lists and tuples (tuples become lists, as JSON writes them); Path values become
    strings; other values are kept."""
    if isinstance(obj, Path):
        obj = str(obj)
    if isinstance(obj, str):
        root = str(REPO_ROOT) + os.sep
        return obj[len(root):] if obj.startswith(root) else ("." if obj == str(REPO_ROOT) else obj)
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [portable(v) for v in obj]
    return obj


def _json_value(value):
    """What JSON cannot hold: numpy (and torch) scalars and arrays as numbers and lists, anything
    else as its ``str``."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def write_json(path: str | Path, obj, indent: int | None = None) -> Path:
    """Write ``obj`` as JSON to ``path``: paths inside the repository relative to its root
    (:func:`portable`), numpy values as numbers and lists, other values JSON cannot hold as their
    ``str``; compact unless ``indent`` is given (results files hold per-episode outcomes, and the
    tree a GPU machine takes in is bounded; each file's ``.md`` is the one to read); through a
    temporary file and a rename, so an interrupted benchmark leaves the previous file whole.
    Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    text = json.dumps(portable(obj), indent=indent, default=_json_value,
                      separators=(",", ":") if indent is None else None) + "\n"
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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
    """What loaded the CPU while a benchmark ran: load averages before/after, machine-wide CPU
    time (split into normal, niced and hypervisor-steal time), and the CPU time used by this
    process, by its descendants (Ray's raylet, GCS, workers, ...) and by every other process on
    the machine, each as an average number of busy cores over the wall time.

    A background thread reads /proc every `poll_s` seconds, so processes that start and exit
    during the run are counted too (those living less than `poll_s` may be missed; their time
    shows as "not attributed")."""

    def __init__(self, poll_s: float = 2.0) -> None:
        import threading
        self.loadavg_before = os.getloadavg()
        self.t0 = time.monotonic()
        self.stat0 = self._stat()
        self.me = os.getpid()
        self.seen: dict[int, list] = {}        # pid -> [name, cpu baseline, cpu at last sight, ours]
        self.retired: list[list] = []
        self._poll(first=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(poll_s,), daemon=True)
        self._thread.start()

    @staticmethod
    def _stat() -> list[int] | None:
        """The first line of /proc/stat: user nice system idle iowait irq softirq steal (ticks)."""
        try:
            return [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        except (OSError, ValueError):
            return None

    @staticmethod
    def _busy_seconds() -> float | None:
        """Machine-wide busy CPU seconds (all cores), steal excluded."""
        v = LoadMonitor._stat()
        return None if v is None else (v[0] + v[1] + v[2] + v[5] + v[6]) / _TICK

    def _poll(self, first: bool = False) -> None:
        try:
            table = _proc_table()
        except OSError:
            return
        ours = _descendants(table, self.me)
        for pid, (name, _, cpu) in table.items():
            entry = self.seen.get(pid)
            if entry is not None and cpu < entry[2]:          # pid reused by a new process
                self.retired.append(entry)
                entry = None
            if entry is None:
                # Already running at the start: count from now; started since: count from zero.
                self.seen[pid] = [name, cpu if first else 0.0, cpu, pid in ours]
            else:
                entry[0], entry[2], entry[3] = name, cpu, entry[3] or pid in ours

    def _run(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            self._poll()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._poll()
        wall = time.monotonic() - self.t0
        stat1 = self._stat()
        groups: dict[str, float] = {}
        for pid, (name, base_cpu, last_cpu, ours) in [*self.seen.items(), *((-1, e) for e in self.retired)]:
            d = last_cpu - base_cpu
            if d <= 0:
                continue
            if pid == self.me:
                key = "this process (driver)"
            elif ours:
                key = f"child: {name}"
            else:
                key = f"other: {name}"
            groups[key] = groups.get(key, 0.0) + d
        machine = None
        if stat1 is not None and self.stat0 is not None:
            d = [(b - a) / _TICK / wall for a, b in zip(self.stat0, stat1)]
            machine = {"busy": d[0] + d[1] + d[2] + d[5] + d[6], "nice": d[1], "steal": d[7]}
        return {"wall_s": wall, "loadavg_before": self.loadavg_before, "loadavg_after": os.getloadavg(),
                "machine": machine,
                "cores_by_process": {k: v / wall for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}


def busy_cores(interval: float = 5.0) -> float | None:
    """Machine-wide busy cores averaged over the next `interval` seconds."""
    b0, t0 = LoadMonitor._busy_seconds(), time.monotonic()
    time.sleep(interval)
    b1 = LoadMonitor._busy_seconds()
    return None if b0 is None or b1 is None else (b1 - b0) / (time.monotonic() - t0)


def wait_for_quiet(max_wait_s: float, threshold: float = 0.3, interval: float = 5.0) -> str:
    """Wait (up to `max_wait_s`) until the machine is nearly idle: fewer than `threshold` busy
    cores over `interval` seconds. Returns a line saying what happened (for the report)."""
    if max_wait_s <= 0:
        return "did not wait for an idle machine (--wait-quiet 0)"
    start = time.monotonic()
    last = None
    while time.monotonic() - start < max_wait_s:
        last = busy_cores(interval)
        if last is None:
            return "could not read /proc/stat; did not wait"
        if last < threshold:
            return (f"waited {time.monotonic() - start:.0f} s for the machine to go idle "
                    f"({last:.2f} busy cores over {interval:.0f} s when it started)")
        print(f"[bench] machine busy ({last:.2f} cores over {interval:.0f} s); waiting up to "
              f"{max_wait_s - (time.monotonic() - start):.0f} s more for < {threshold} ...", flush=True)
    return (f"the machine did not go idle within {max_wait_s:.0f} s (last: {last:.2f} busy cores); "
            f"started anyway")


def load_lines(load: dict, top: int = 8) -> list[str]:
    """Markdown bullet lines describing a LoadMonitor.stop() result."""
    before = ", ".join(f"{x:.2f}" for x in load["loadavg_before"])
    after = ", ".join(f"{x:.2f}" for x in load["loadavg_after"])
    items = list(load["cores_by_process"].items())
    others = sum(v for k, v in items if k.startswith("other:"))
    ours = sum(v for k, v in items if not k.startswith("other:"))
    lines = [f"- load average (1, 5, 15 min) before: {before}; after: {after}",
             f"- wall time: {load['wall_s']:.1f} s",
             f"- this benchmark (driver + its Ray/worker processes): {ours:.2f} cores on average",
             f"- processes outside this benchmark: {others:.2f} cores on average"]
    m = load.get("machine")
    if m is not None:
        lines.append(f"- whole machine busy: {m['busy']:.2f} cores on average (of {os.cpu_count()}), of which "
                     f"{m['nice']:.2f} niced; not attributed to a process (kernel, very short-lived "
                     f"processes): {max(0.0, m['busy'] - ours - others):.2f}; hypervisor steal: {m['steal']:.2f}")
    shown = [f"{k} {v:.2f}" for k, v in items[:top] if v >= 0.005]
    if shown:
        lines.append("- busiest processes (average cores): " + "; ".join(shown))
    return lines


# --------------------------------------------------------------------------- statistics

def pair_cosines(vectors: list, pairs=None) -> list[float]:
    """The cosine of ``vectors[i]`` and ``vectors[j]`` (tensors, flattened) for every ``(i, j)``
    in ``pairs`` (default: every i < j), as floats: whether gradients or weight shifts of
    different batches, seeds or variants point the same way."""
    import itertools

    import torch
    pairs = itertools.combinations(range(len(vectors)), 2) if pairs is None else pairs
    return [float(torch.nn.functional.cosine_similarity(vectors[i].flatten(), vectors[j].flatten(), dim=0))
            for i, j in pairs]


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


def write_results(name: str, title: str, body: str, command: str | None = None,
                  results_dir: Path = RESULTS_DIR) -> Path:
    """Write <results_dir>/<name>.md (default benchmarks/results/; title, command, date, machine,
    body), print it, and return the path."""
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    text = (f"# {title}\n\n"
            f"Command (from the repository root):\n\n```\n{command or command_line()}\n```\n\n"
            f"Date: {now}\n\n"
            f"## Machine\n\n{machine_section()}\n\n"
            f"{body.rstrip()}\n")
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.md"
    path.write_text(text)
    print("\n" + text, flush=True)
    print(f"[bench] results written to {os.path.relpath(path, Path.cwd())}", flush=True)
    return path


def git_revision() -> str:
    """The revision this process started from (read when this module was imported): a long
    benchmark reports the code it ran, not whatever HEAD is when it ends."""
    return _REVISION_AT_START


def _read_git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "flowrl_ray", "configs"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "unknown") + (" (flowrl_ray/ or configs/ modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


_REVISION_AT_START = _read_git_revision()
