"""The run's own before-and-after: the starting policy and the final one on the same seeded
episodes (``eval.compare_episodes``), by the rule the config deploys (``eval.sampling``) and by
the other one, with the paired gain and its 95 % bootstrap CI.

Both evaluations play the episodes of ``flowrl-ray eval RUN --episodes N --sampling RULE`` (the
run's evaluation seed and layout), so episode e is the same initial state for the start and the
final policy: the gain is paired by episode (:func:`flowrl_ray.stats.paired_bootstrap_gain`).
The outcome is success (0/1) where the env family reports it, else the episode return.

Files: ``start_vs_final.json`` in the run directory ({"episodes", "outcome", "rules": {rule:
{"deployed", "start", "final", "gain", "ci_low", "ci_high"}}, plus each evaluation's per-episode
outcomes and keys) and ``plots/start_vs_final.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flowrl_ray.stats import paired_bootstrap_gain
from flowrl_ray.utils import atomic_write_text

FILE = "start_vs_final.json"


def rules(deployed: str) -> list[str]:
    """The deployed rule first, then the other one."""
    return [deployed] + [r for r in ("zero", "random") if r != deployed]


def outcomes(result: dict) -> tuple[str, list[float]]:
    """An evaluation's per-episode outcome: success where reported, else the return."""
    if "successes" in result:
        return "success", [float(s) for s in result["successes"]]
    return "return", [float(r) for r in result["returns"]]


def record(evaluations: dict[str, dict]) -> dict:
    """{rule: evaluate_episodes' result} -> what the file keeps of one side: keys and outcomes."""
    out = {}
    for rule, result in evaluations.items():
        kind, values = outcomes(result)
        out[rule] = {"keys": result["keys"], "outcome": kind, "values": values}
    return out


def compare(start: dict, final: dict, deployed: str, n_boot: int = 10_000) -> dict:
    """start, final: :func:`record` of the two sides -> per rule the means, the paired gain
    (final - start, over the episodes both played) and its 95 % CI."""
    out = {}
    for rule in rules(deployed):
        a, b = (dict(zip(map(tuple, side[rule]["keys"]), side[rule]["values"])) for side in (start, final))
        common = [k for k in a if k in b]                     # a lost worker's episodes drop out
        s, f = np.array([a[k] for k in common]), np.array([b[k] for k in common])
        g = paired_bootstrap_gain(f[None], s, n_boot=n_boot)
        out[rule] = {"deployed": rule == deployed, "episodes": len(common), "start": float(s.mean()),
                     "final": float(f.mean()), "gain": g["gain"], "ci_low": g["ci_low"], "ci_high": g["ci_high"]}
    return out


def _level(outcome: str):
    """How a mean outcome prints: success as a percentage, a return as it is."""
    return (lambda x: f"{100 * x:.0f} %") if outcome == "success" else (lambda x: f"{x:.1f}")   # noqa: E731


def evaluated_line(side: str, rule: str, result: dict, seconds: float) -> str:
    """The line printed as each of a side's evaluations ends (they take minutes on a laptop)."""
    kind, values = outcomes(result)
    return f"  {side} policy, {rule} sampling: {kind} {_level(kind)(float(np.mean(values)))} ({seconds:.0f} s)"


def lines(result: dict) -> list[str]:
    """What the run prints: one line per rule."""
    success = result["outcome"] == "success"
    fmt = _level(result["outcome"])
    diff = (lambda x: f"{100 * x:+.1f}") if success else (lambda x: f"{x:+.2f}")     # noqa: E731
    unit = " points" if success else ""
    out = [f"start vs final on the same {result['episodes']} seeded episodes "
           f"(flowrl-ray eval --episodes {result['episodes']}), {result['outcome']}:"]
    for rule, r in result["rules"].items():
        tag = "deployed" if r["deployed"] else "the other rule"
        out.append(f"  {rule} sampling ({tag}): {fmt(r['start'])} -> {fmt(r['final'])}, "
                   f"{diff(r['gain'])}{unit} [95 % CI {diff(r['ci_low'])}, {diff(r['ci_high'])}]")
    return out


def write(run_dir: Path, data: dict) -> None:
    atomic_write_text(run_dir / FILE, json.dumps(data, indent=1) + "\n")


def read(run_dir: Path) -> dict | None:
    path = run_dir / FILE
    return json.loads(path.read_text()) if path.is_file() else None


def plot(result: dict, out_png: Path) -> Path:
    """Start and final per rule, bars with the final's paired 95 % CI on the gain (:func:`figure`),
    written to ``out_png``."""
    import matplotlib.pyplot as plt

    from flowrl_ray.plotting import save_figure
    fig = figure(result)
    save_figure(fig, out_png, dpi=110)
    plt.close(fig)
    return out_png


def figure(result: dict):
    """The comparison's matplotlib figure: per rule, the start bar and the final bar with the
    paired gain's 95 % CI as its error bar; the legend sits below the axes, clear of every bar and
    error bar whatever the rates."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(result["rules"])
    scale = 100.0 if result["outcome"] == "success" else 1.0
    start = [scale * result["rules"][n]["start"] for n in names]
    final = [scale * result["rules"][n]["final"] for n in names]
    err = np.array([[scale * (result["rules"][n]["gain"] - result["rules"][n]["ci_low"]),
                     scale * (result["rules"][n]["ci_high"] - result["rules"][n]["gain"])] for n in names]).T
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(x - 0.2, start, 0.4, label="start")
    ax.bar(x + 0.2, final, 0.4, yerr=err, capsize=4, label="final (bar: 95 % CI of the paired gain)")
    ax.set_xticks(x, [f"{n} sampling" + (" (deployed)" if result["rules"][n]["deployed"] else "") for n in names])
    ax.set_ylabel("success rate (%)" if scale == 100.0 else "episode return")
    ax.set_title(f"start vs final, {result['episodes']} paired episodes", fontsize=10)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))                      # room for the legend under the axes
    return fig
