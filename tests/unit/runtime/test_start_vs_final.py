"""The run's start-vs-final comparison (runtime/start_vs_final.py): pairing by episode key, the
gain by hand, the printed lines, the plot."""

import pytest

from flowrl_ray.runtime import start_vs_final as svf


def _side(values_by_rule, keys=None):
    keys = keys or [[i, 0] for i in range(len(next(iter(values_by_rule.values()))))]
    return svf.record({rule: {"keys": keys, "returns": [0.0] * len(v), "successes": v}
                       for rule, v in values_by_rule.items()})


def test_gain_is_paired_by_episode_key_and_computed_by_hand():
    start = _side({"zero": [0, 1, 0, 1], "random": [1, 1, 1, 1]})
    # the final side lists its episodes in another order and lacks episode [3, 0] (a lost worker)
    final = svf.record({rule: {"keys": [[2, 0], [0, 0], [1, 0]], "returns": [0.0] * 3, "successes": v}
                        for rule, v in {"zero": [1, 1, 1], "random": [0, 1, 1]}.items()})
    out = svf.compare(start, final, deployed="zero", n_boot=2000)
    assert list(out) == ["zero", "random"]                    # the deployed rule first
    z = out["zero"]
    # common episodes 0, 1, 2: start 0, 1, 0 -> final 1, 1, 1
    assert (z["episodes"], z["start"], z["final"]) == (3, pytest.approx(1 / 3), 1.0)
    assert z["gain"] == pytest.approx(2 / 3) and z["deployed"] and 0.0 <= z["ci_low"] <= z["gain"] <= z["ci_high"] <= 1.0
    r = out["random"]                                          # start 1, 1, 1 -> final 1, 1, 0
    assert r["gain"] == pytest.approx(-1 / 3) and not r["deployed"]


def test_identical_sides_give_zero_and_a_point_interval():
    side = _side({"random": [0, 1, 1, 0, 1], "zero": [1, 1, 0, 0, 1]})
    out = svf.compare(side, side, deployed="random", n_boot=500)
    assert list(out) == ["random", "zero"]
    assert all((r["gain"], r["ci_low"], r["ci_high"]) == (0.0, 0.0, 0.0) for r in out.values())


def test_returns_are_the_outcome_where_no_success_is_reported():
    rec = svf.record({"zero": {"keys": [[0, 0], [1, 0]], "returns": [-300.0, -100.0]}})
    assert rec["zero"]["outcome"] == "return" and rec["zero"]["values"] == [-300.0, -100.0]


def test_the_line_after_each_evaluation():
    success = {"keys": [[0, 0], [1, 0], [2, 0], [3, 0]], "successes": [1, 0, 1, 1], "returns": [1, 0, 1, 1]}
    assert svf.evaluated_line("start", "zero", success, 24.4) == "  start policy, zero sampling: success 75 % (24 s)"
    returns = {"keys": [[0, 0], [1, 0]], "returns": [-300.0, -100.0]}
    assert svf.evaluated_line("final", "random", returns, 3.0) == "  final policy, random sampling: return -200.0 (3 s)"


def test_the_printed_lines_and_the_plot(tmp_path):
    start = _side({"zero": [0, 0, 1, 1], "random": [0, 1, 0, 1]})
    final = _side({"zero": [1, 1, 1, 1], "random": [0, 1, 0, 1]})
    data = {"start": start, "final": final, "episodes": 4, "outcome": "success",
            "rules": svf.compare(start, final, "zero", n_boot=500)}
    head, zero, random = svf.lines(data)
    assert head == "start vs final on the same 4 seeded episodes (flowrl-ray eval --episodes 4), success:"
    assert zero.startswith("  zero sampling (deployed): 50 % -> 100 %, +50.0 points [95 % CI +")
    assert random == "  random sampling (the other rule): 50 % -> 50 %, +0.0 points [95 % CI +0.0, +0.0]"
    png = svf.plot(data, tmp_path / "plots" / "start_vs_final.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svf.write(tmp_path, data)
    assert svf.read(tmp_path)["rules"]["zero"]["final"] == 1.0


def test_a_group_run_refuses_the_comparison_before_ray_starts(tmp_path, capsys):
    from conftest import REPO
    from flowrl_ray.cli import main
    config = REPO / "configs" / "fed_grpo" / "qm9_small.yaml"
    assert main(["train", str(config), "eval.compare_episodes=4", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "config key 'eval.compare_episodes'" in err and "env-step runs" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("rates", [(0.4, 0.52, 0.51, 0.54), (0.9, 1.0, 0.95, 0.97), (0.0, 0.05, 0.0, 0.0)])
def test_the_plot_legend_covers_no_bar_and_no_error_bar(rates):
    # the figure make_run.md showed had the legend over the random-sampling bar's CI whisker
    z0, z1, r0, r1 = rates
    n = 100
    start = _side({"zero": [1] * round(n * z0) + [0] * (n - round(n * z0)),
                   "random": [1] * round(n * r0) + [0] * (n - round(n * r0))})
    final = _side({"zero": [1] * round(n * z1) + [0] * (n - round(n * z1)),
                   "random": [1] * round(n * r1) + [0] * (n - round(n * r1))})
    data = {"start": start, "final": final, "episodes": n, "outcome": "success",
            "rules": svf.compare(start, final, "zero", n_boot=500)}
    import matplotlib.pyplot as plt
    from matplotlib.transforms import Bbox
    fig = svf.figure(data)
    try:
        renderer = fig.canvas.get_renderer()
        fig.canvas.draw()
        legend = fig.legends[0].get_window_extent(renderer)
        ax = fig.axes[0]
        boxes = [p.get_window_extent(renderer) for p in ax.patches]                        # the 4 bars
        boxes += [Bbox.from_extents(*ax.transData.transform(seg).min(0), *ax.transData.transform(seg).max(0))
                  for col in ax.collections for seg in col.get_segments()]                # the CI whiskers
        boxes += [line.get_window_extent(renderer) for line in ax.lines]                   # their caps
        assert len(ax.patches) == 4 and len(boxes) >= 6, "the bars and the error bars are drawn"
        for box in boxes:
            assert not legend.overlaps(box), box
    finally:
        plt.close(fig)
