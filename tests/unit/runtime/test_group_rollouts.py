"""Group rollouts without Ray: the async mode's pacing of generations. The runs on a real local
Ray: tests/integration/test_group_rollouts.py."""

from collections import namedtuple
from types import SimpleNamespace

import pytest

from flowrl_ray.config import config_from_dict


def _config(**runtime):
    return config_from_dict({
        "name": "token-grpo", "algorithm": "flowrl_test_plugins.token_bandit:TokenGRPO",
        "env": {"family": "flowrl_test_plugins.token_bandit", "id": "tokens"},
        "train": {"iterations": 12}, "eval": {"interval": 12, "episodes": 1},
        "runtime": {"num_workers": 2, "checkpoint_interval": 0, **runtime}})


Meta = namedtuple("Meta", "worker_id generation")


class FakeParts:
    """What GroupRollouts is handed, without Ray: the learner's generate and a pool whose wait for
    the scorers returns each generation's chunks "scored" at once, tagged with the generation."""

    def __init__(self, cfg):
        self.cfg, self.counters = cfg, SimpleNamespace(iteration=0, learner_restarts=0)
        self.generated = []
        self.workers = FakePool()
        self.learner = SimpleNamespace(call=self._call)

    def _call(self, method, num_chunks, mode, snapshots=0):
        assert method == "generate"
        self.generated.append((mode, self.counters.iteration))
        return [(len(self.generated) - 1, i) for i in range(num_chunks)]

    def strategy(self):
        from flowrl_ray.runtime.rollouts import GroupRollouts
        return GroupRollouts(self.cfg, self.workers, self.learner, None, self.counters)


class FakePool(list):
    def __init__(self):
        super().__init__([SimpleNamespace(score=SimpleNamespace(remote=self._score))] * 2)

    @staticmethod
    def _score(chunk):
        return Meta(worker_id=chunk[1], generation=chunk[0]), chunk

    @staticmethod
    def collect(pending, needed):
        metas = [m for m in pending][:needed]
        return metas, [pending[m][1] for m in metas]


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_async_group_rollouts_generate_ahead_at_most_max_staleness(staleness):
    t = FakeParts(_config(mode="async", max_staleness=staleness))
    rollouts = t.strategy()
    used = []
    for it in range(12):
        metas, refs = rollouts.sample()
        assert {m.generation for m in metas} == {used[-1] + 1 if used else 0}    # oldest generation first, whole
        used.append(metas[0].generation)
        assert len(rollouts._ahead) == min(staleness, 12 - it - 1)             # paced; none past the last update
        t.counters.iteration += 1                                              # the update
    made_at = [it for _, it in t.generated]
    lags = [it - made_at[g] for it, g in enumerate(used)]                      # updates between generation and use
    assert len(t.generated) == 12 and max(lags) == staleness and lags[0] == 0  # nothing generated is thrown away
    rollouts.learner_restarted()
    assert not rollouts._ahead


def test_sync_group_rollouts_generate_each_iteration_for_its_own_update():
    t = FakeParts(_config())
    rollouts = t.strategy()
    for _ in range(3):
        rollouts.sample()
        assert not rollouts._ahead
        t.counters.iteration += 1
    assert [it for _, it in t.generated] == [0, 1, 2]


def test_samples_of_a_learner_that_died_are_sampled_again():
    """The learner dies while generating ahead (the call is made again on a new learner, which
    holds none of the old generations): the samples in hand came from the dead one, so the
    iteration is sampled again from the new learner, never prepared with another generation."""
    t = FakeParts(_config(mode="async", max_staleness=1))
    rollouts = t.strategy()
    generate = t.learner.call

    def dies_at_iteration_2(*args):
        if t.counters.iteration == 2 and t.counters.learner_restarts == 0:
            t.counters.learner_restarts = 1        # what ResumableLearner.call does on LearnerDied
            rollouts.learner_restarted()
        return generate(*args)

    t.learner.call = dies_at_iteration_2
    used = []
    for _ in range(4):
        metas, _ = rollouts.sample()
        used.append(metas[0].generation)
        t.counters.iteration += 1
    # generations: 0 (iteration 0), 1 (ahead at 0), 2 (ahead at 1), 3 (ahead at 2: the learner
    # dies and the new one makes it); iteration 2 drops generation 2 (the dead learner's) and
    # takes 3, generating 4 ahead for iteration 3
    assert used == [0, 1, 3, 4] and len(t.generated) == 6          # and 5 ahead at iteration 3
