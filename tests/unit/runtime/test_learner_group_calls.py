"""LearnerGroup.call without Ray: which ranks a call goes to, how a group algorithm's training
generations are gathered, and when a failure is a dead rank (LearnerDied: the Trainer rebuilds
the group) or the algorithm's own error (raised as it is). The group on a real local Ray:
tests/integration/test_learner_group.py."""

from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError, RayTaskError

from flowrl_ray.runtime import learner_group as lg


class FakeRank:
    """A rank's actor handle: ``<method>.remote(*args)`` records the call and returns its result."""

    def __init__(self, rank, calls):
        self.rank, self.calls = rank, calls

    def __getattr__(self, method):
        def remote(*args):
            self.calls.append((self.rank, method, args))
            return [f"r{self.rank}-chunk{i}" for i in range(args[0])] if method == "generate" else (self.rank, method)
        return SimpleNamespace(remote=remote)


def _group(monkeypatch, size=2, get_all=None, dead=()):
    group = lg.LearnerGroup.__new__(lg.LearnerGroup)
    calls = []
    group.size, group.actors = size, [FakeRank(r, calls) for r in range(size)]
    monkeypatch.setattr(lg, "get_all", get_all or (lambda refs: list(refs)))
    monkeypatch.setattr(group, "dead_ranks", lambda: list(dead))
    return group, calls


def test_state_changes_go_to_every_rank_and_reads_to_rank_0(monkeypatch):
    group, calls = _group(monkeypatch)
    assert group.call("update", ["batch"]) == (0, "update")
    assert group.call("publish") == (0, "publish")
    assert [(r, m) for r, m, _ in calls] == [(0, "update"), (1, "update"), (0, "publish")]


def test_training_generations_are_gathered_from_every_rank_evaluation_from_rank_0(monkeypatch):
    group, calls = _group(monkeypatch)
    # 4 scoring chunks asked of the group: 2 from each rank, all returned
    assert group.call("generate", 4, "train") == ["r0-chunk0", "r0-chunk1", "r1-chunk0", "r1-chunk1"]
    assert group.call("generate", 4, "eval") == ["r0-chunk0", "r0-chunk1", "r0-chunk2", "r0-chunk3"]


def _raises(error):
    def get_all(refs):
        raise error
    return get_all


def test_a_dead_actor_or_a_collective_that_lost_a_peer_is_learner_died(monkeypatch):
    group, _ = _group(monkeypatch, get_all=_raises(RayActorError()))
    with pytest.raises(lg.LearnerDied):
        group.call("update", [])
    # rank 0's collective failed (a RayTaskError, not an actor error) because rank 1 is gone
    task_error = RayTaskError("update", "gloo: connection closed by peer", RuntimeError("peer"))
    group, _ = _group(monkeypatch, get_all=_raises(task_error), dead=[1])
    with pytest.raises(lg.LearnerDied):
        group.call("update", [])


def test_an_error_of_the_algorithm_on_live_ranks_is_raised_as_it_is(monkeypatch):
    task_error = RayTaskError("update", "ValueError: bad batch", ValueError("bad batch"))
    group, _ = _group(monkeypatch, get_all=_raises(task_error), dead=[])
    with pytest.raises(RayTaskError):
        group.call("update", [])
    group, _ = _group(monkeypatch, size=1, get_all=_raises(task_error))    # one learner: never a peer's death
    with pytest.raises(RayTaskError):
        group.call("update", [])
