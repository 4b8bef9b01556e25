"""The training loop's progress line: env steps with chunks, and an ETA that extrapolates the
iterations' own time, not what ran before them (the starting policy's evaluation)."""

import io

import flowrl_ray.progress as progress_mod
from flowrl_ray.progress import CountProgress, Progress


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def line(p: Progress, row: dict, stream: io.StringIO) -> str:
    p.update(row)
    return stream.getvalue().strip().splitlines()[-1]


def test_eta_extrapolates_iterations_only(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "perf_counter", clock)
    out = io.StringIO()
    p = Progress(10, "fpopp lift", stream=out)
    clock.t += 300.0                      # a 5-minute evaluation of the starting policy
    p.begin()
    clock.t += 30.0                       # one 30 s iteration
    text = line(p, {"iteration": 1, "env_steps": 10_112, "chunks": 1_280, "episode_return_mean": 0.25}, out)
    assert "it 1/10" in text and "env steps 10,112 (1,280 chunks)" in text and "return 0.2" in text
    assert "elapsed 5m30s" in text        # the whole run so far
    assert "ETA 4m30s" in text            # 9 iterations x 30 s, not 9 x 330 s


def test_eta_without_begin_counts_from_construction(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "perf_counter", clock)
    out = io.StringIO()
    p = Progress(4, "ppo pendulum", start_iteration=2, stream=out)     # a resumed run at iteration 2
    clock.t += 20.0
    text = line(p, {"iteration": 3, "env_steps": 600}, out)
    assert "it 3/4" in text and "return -" in text and "ETA 20s" in text
    assert "chunks" not in text


def test_count_progress(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "perf_counter", clock)
    out = io.StringIO()
    p = CountProgress(20, "pretrain eval", stream=out)
    clock.t += 16.0
    p.update(8, "zero sampling")
    assert out.getvalue().strip() == ("[pretrain eval] 8/20 episodes (zero sampling) | 2.0 s/episode | "
                                      "elapsed 16s | ETA 24s")
