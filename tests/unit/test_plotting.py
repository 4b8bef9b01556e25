"""Learning-curve aggregation by hand: interpolation onto the shared range, mean and std."""

import numpy as np
import pytest

from flowrl_ray.plotting import mean_std_band, plot_curves


def test_mean_std_band_interpolates_onto_the_range_every_run_covers():
    a = (np.array([0.0, 10.0, 20.0]), np.array([0.0, 10.0, 20.0]))       # y = x
    b = (np.array([5.0, 15.0]), np.array([15.0, 35.0]))                   # y = 2x + 5
    grid, mean, std = mean_std_band([a, b], points=3)
    assert grid.tolist() == [5.0, 10.0, 15.0]                           # [max start, min end]
    # at x: runs give x and 2x + 5 -> mean 1.5x + 2.5, std |x + 5| / 2
    assert mean == pytest.approx([10.0, 17.5, 25.0])
    assert std == pytest.approx([5.0, 7.5, 10.0])


def test_plot_curves_writes_a_png_with_single_runs_and_bands(tmp_path):
    x = np.linspace(0, 100, 11)
    out = plot_curves({"one seed": [(x, x)], "three seeds": [(x, x + k) for k in range(3)]}, tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_plot_curves_draws_quoted_points_on_a_log_axis(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    x = np.array([1e3, 1e4, 1e5])
    seen, real_savefig = {}, plt.Figure.savefig

    def keep(fig, *a, **k):                 # what the figure holds when it is written
        ax = fig.axes[0]
        seen["xscale"] = ax.get_xscale()
        seen["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        seen["point"] = [line.get_xydata().tolist() for line in ax.lines if line.get_label() == "paper"]
        return real_savefig(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    plot_curves({"run": [(x, x / 1e5)]}, tmp_path / "c.png", xscale="log", markers=[("paper", 9.06e6, 1.0)])
    assert seen == {"xscale": "log", "legend": ["run", "paper"], "point": [[[9.06e6, 1.0]]]}


def test_plot_curves_gives_every_one_of_many_lines_its_own_look(tmp_path, monkeypatch):
    """Past matplotlib's 10 colours (13 variants of an ablation) no two lines share colour and style."""
    import matplotlib.pyplot as plt
    x = np.linspace(0, 1, 5)
    seen, real_savefig = {}, plt.Figure.savefig

    def keep(fig, *a, **k):
        seen["looks"] = [(tuple(line.get_color()) if not isinstance(line.get_color(), str) else line.get_color(),
                          line.get_linestyle()) for line in fig.axes[0].lines]
        return real_savefig(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    for n in (3, 13, 25):
        plot_curves({f"v{i:02d}": [(x, x * i), (x, x * i + 1)] for i in range(n)}, tmp_path / "c.png")
        assert len(seen["looks"]) == n and len(set(seen["looks"])) == n, n


def test_save_figure_writes_a_palette_png_that_keeps_flat_colours_exact(tmp_path):
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from flowrl_ray.plotting import save_figure
    fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
    ax.bar([0, 1], [1, 2], color=["#1f77b4", "#ff7f0e"])
    ax.fill_between([0, 1], [0.2, 0.4], [0.6, 0.9], alpha=0.2)           # a translucent band
    rgba = io.BytesIO()
    fig.savefig(rgba, format="png")
    out = save_figure(fig, tmp_path / "sub" / "f.png")
    plt.close(fig)
    assert out == tmp_path / "sub" / "f.png" and [p.name for p in out.parent.iterdir()] == ["f.png"]
    rgba.seek(0)
    with Image.open(out) as im, Image.open(rgba) as full:
        assert im.mode == "P" and im.size == full.size
        got, want = im.convert("RGB"), full.convert("RGB")
        colours = {c for _, c in want.getcolors(maxcolors=1 << 20)}
        assert (31, 119, 180) in colours and (255, 127, 14) in colours      # the bars' colours ...
        for xy in [(x, y) for x in range(0, full.size[0], 7) for y in range(0, full.size[1], 7)]:
            if want.getpixel(xy) in {(31, 119, 180), (255, 127, 14), (255, 255, 255)}:
                assert got.getpixel(xy) == want.getpixel(xy), xy           # ... exact where they are flat
    assert out.stat().st_size < len(rgba.getvalue())
