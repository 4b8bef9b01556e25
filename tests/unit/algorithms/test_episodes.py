"""EpisodeAssembler and pad_episodes: complete episodes out of time-major [T, N, ...] rollout
fragments, carried per (worker, env column) across batches. Pure numpy, no Ray."""

import copy

import numpy as np

from flowrl_ray.algorithms.episodes import EpisodeAssembler, pad_episodes
from flowrl_ray.batch import Batch, BatchMeta


def tag(worker: int, batch: int, t: int, j: int) -> float:
    """An observation value that says where a step came from."""
    return 1000.0 * worker + 100.0 * batch + 10.0 * t + j


def make_batch(worker: int, batch: int, ends=None, rewards=None, t: int = 4, n: int = 2,
               dict_obs: bool = False) -> Batch:
    """obs[t, j] = tag(worker, batch, t, j) (a [2]-vector), actions[t, j] = -obs, final_obs = obs + .5.
    ``ends`` {(t, j): "term" | "trunc" | "both"}, ``rewards`` {(t, j): r}."""
    obs = np.array([[[tag(worker, batch, i, j)] * 2 for j in range(n)] for i in range(t)], np.float32)
    term, trunc = np.zeros((t, n), bool), np.zeros((t, n), bool)
    for (i, j), kind in (ends or {}).items():
        term[i, j] = kind in ("term", "both")
        trunc[i, j] = kind in ("trunc", "both")
    r = np.zeros((t, n), np.float32)
    for (i, j), value in (rewards or {}).items():
        r[i, j] = value
    data = {"rewards": r, "terminated": term, "truncated": trunc, "actions": -obs,
            "taus": np.zeros((t, n, 3), np.float32),                  # a record key not asked for
            "last_obs": obs[-1] + 7.0}
    if dict_obs:
        data.update({"obs/state": obs, "obs/rgb": obs.astype(np.uint8), "final_obs/state": obs + 0.5,
                     "final_obs/rgb": (obs + 1).astype(np.uint8)})
    else:
        data.update(obs=obs, final_obs=obs + 0.5)
    return Batch(data, BatchMeta(policy_version=0, worker_id=worker, env_steps=t * n))


def tags(ep) -> list[float]:
    return ep["obs"][:, 0].tolist()


def test_episodes_are_cut_at_terminated_and_at_truncated():
    asm = EpisodeAssembler()
    eps = asm.add([make_batch(0, 0, ends={(1, 0): "term", (3, 0): "trunc"}, n=1)])
    assert [len(ep["rewards"]) for ep in eps] == [2, 2]
    assert tags(eps[0]) == [tag(0, 0, 0, 0), tag(0, 0, 1, 0)]
    assert tags(eps[1]) == [tag(0, 0, 2, 0), tag(0, 0, 3, 0)]
    assert (eps[0]["terminated"], eps[0]["truncated"]) == (True, False)
    assert (eps[1]["terminated"], eps[1]["truncated"]) == (False, True)
    assert asm.pending_steps == 0


def test_episode_keys_are_obs_rewards_and_the_requested_record_keys():
    # "taus" is not a step key asked for, "last_obs" is not per step, "final_obs" only when truncated
    asm = EpisodeAssembler(step_keys=("actions", "cfm_old"))           # cfm_old absent from the batch
    (ep,) = asm.add([make_batch(0, 0, ends={(3, 0): "term"}, n=1)])
    assert set(ep) == {"obs", "rewards", "actions", "terminated", "truncated", "return"}
    assert ep["obs"].shape == (4, 2) and ep["actions"].shape == (4, 2) and ep["rewards"].shape == (4,)
    np.testing.assert_array_equal(ep["actions"], -ep["obs"])


def test_episode_carried_across_batches_of_the_same_worker_and_column():
    asm = EpisodeAssembler()
    assert asm.add([make_batch(0, 0)]) == []
    assert asm.pending_steps == 8
    eps = asm.add([make_batch(0, 1, ends={(1, 1): "term"})])
    (ep,) = eps
    # column 1: the 4 steps of batch 0, then steps 0 and 1 of batch 1
    assert tags(ep) == [tag(0, 0, i, 1) for i in range(4)] + [tag(0, 1, 0, 1), tag(0, 1, 1, 1)]
    assert asm.pending_steps == 8 + 8 - 6


def test_tails_of_different_workers_are_not_mixed():
    asm = EpisodeAssembler()
    assert asm.add([make_batch(0, 0), make_batch(1, 0)]) == []
    assert asm.pending_steps == 16
    # worker 1's column 0 ends first: only worker 1's steps, none of worker 0's
    (ep,) = asm.add([make_batch(1, 1, ends={(0, 0): "term"})])
    assert tags(ep) == [tag(1, 0, i, 0) for i in range(4)] + [tag(1, 1, 0, 0)]
    (ep,) = asm.add([make_batch(0, 1, ends={(2, 0): "trunc"})])
    assert tags(ep) == [tag(0, 0, i, 0) for i in range(4)] + [tag(0, 1, i, 0) for i in range(3)]


def test_return_sums_the_episodes_rewards():
    asm = EpisodeAssembler()
    asm.add([make_batch(0, 0, rewards={(2, 0): 0.5, (3, 0): 0.25}, n=1)])
    (ep,) = asm.add([make_batch(0, 1, ends={(1, 0): "term"}, rewards={(0, 0): 1.0, (1, 0): -0.125}, n=1)])
    assert ep["return"] == 1.625
    assert isinstance(ep["return"], float)
    assert ep["rewards"].tolist() == [0, 0, 0.5, 0.25, 1.0, -0.125]


def test_final_obs_is_kept_only_for_truncated_episodes():
    asm = EpisodeAssembler()
    eps = asm.add([make_batch(0, 0, ends={(1, 0): "term", (2, 1): "trunc", (3, 0): "both"})])
    by_end = {(ep["terminated"], ep["truncated"]): ep for ep in eps}
    assert "final_obs" not in by_end[(True, False)]
    np.testing.assert_array_equal(by_end[(False, True)]["final_obs"], np.full(2, tag(0, 0, 2, 1) + 0.5))
    np.testing.assert_array_equal(by_end[(True, True)]["final_obs"], np.full(2, tag(0, 0, 3, 0) + 0.5))


def test_dict_observations_keep_every_obs_and_final_obs_part():
    asm = EpisodeAssembler()
    (ep,) = asm.add([make_batch(0, 0, ends={(2, 0): "trunc"}, n=1, dict_obs=True)])
    assert {"obs/state", "obs/rgb", "final_obs/state", "final_obs/rgb"} <= set(ep)
    assert ep["obs/state"].shape == (3, 2) and ep["obs/rgb"].dtype == np.uint8
    np.testing.assert_array_equal(ep["final_obs/state"], np.full(2, tag(0, 0, 2, 0) + 0.5))


def test_state_dict_round_trip_resumes_the_tails():
    asm = EpisodeAssembler()
    asm.add([make_batch(0, 0, ends={(1, 0): "term"}), make_batch(3, 0)])
    state = copy.deepcopy(asm.state_dict())
    pending = asm.pending_steps                                        # 2 + 4 (worker 0) + 8 (worker 3)
    assert pending == 14
    fresh = EpisodeAssembler()
    fresh.load_state_dict(state)
    assert fresh.pending_steps == pending and set(fresh.tails) == {(0, 0), (0, 1), (3, 0), (3, 1)}
    nxt = [make_batch(3, 1, ends={(0, 1): "term"}), make_batch(0, 1, ends={(3, 0): "trunc", (3, 1): "term"})]
    a, b = asm.add(copy.deepcopy(nxt)), fresh.add(copy.deepcopy(nxt))
    assert len(a) == len(b) == 3
    for ea, eb in zip(a, b):
        assert ea.keys() == eb.keys()
        for k in ea:
            np.testing.assert_array_equal(ea[k], eb[k])
    assert tags(b[0]) == [tag(3, 0, i, 1) for i in range(4)] + [tag(3, 1, 0, 1)]


def test_state_dict_is_a_snapshot_not_affected_by_later_steps():
    asm = EpisodeAssembler()
    asm.add([make_batch(0, 0)])
    state = asm.state_dict()
    asm.add([make_batch(0, 1)])                                        # appends to the live tails
    fresh = EpisodeAssembler()
    fresh.load_state_dict(state)
    assert fresh.pending_steps == 8 and asm.pending_steps == 16


def test_pad_episodes_shapes_zeros_and_mask():
    episodes = [{"actions": np.ones((3, 2, 2), np.float32)}, {"actions": 2 * np.ones((1, 2, 2), np.float32)},
                {"actions": 3 * np.ones((2, 2, 2), np.float32)}]
    out, mask = pad_episodes(episodes, "actions")
    assert out.shape == (3, 3, 2, 2) and out.dtype == np.float32
    assert mask.shape == (3, 3) and mask.dtype == bool
    assert mask.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    assert np.all(out[0] == 1) and np.all(out[1, :1] == 2) and np.all(out[2, :2] == 3)
    assert np.all(out[~mask] == 0)
    rewards, mask_r = pad_episodes([{"r": np.array([1.0, 2.0])}, {"r": np.array([5.0])}], "r")
    assert rewards.tolist() == [[1.0, 2.0], [5.0, 0.0]] and mask_r.tolist() == [[True, True], [True, False]]


def test_a_key_that_starts_mid_episode_is_left_out_of_that_episode_only():
    # A tail carried from a checkpoint written before the batches had "executed_rows": the episode
    # it ends has no such key (its user falls back to a default); the next one has it.
    asm = EpisodeAssembler(step_keys=("actions", "executed_rows"))
    assert asm.add([make_batch(0, 0, n=1)]) == []                               # 4 steps, no key
    newer = make_batch(0, 1, ends={(1, 0): "term", (3, 0): "term"}, n=1)
    newer.data["executed_rows"] = np.array([[2], [1], [2], [2]], np.int64)
    first, second = asm.add([newer])
    assert len(first["rewards"]) == 6 and "executed_rows" not in first and "actions" in first
    assert second["executed_rows"].tolist() == [2, 2]


def test_start_groups_release_whole_groups_in_completion_order_and_drop_stale_ones():
    from flowrl_ray.algorithms.episodes import StartGroups
    ep = lambda seed, tag: {"start_seed": np.array([seed, seed]), "tag": tag}     # noqa: E731
    groups = StartGroups(size=2, wait=2)
    assert groups.add([ep(5, "a"), ep(7, "b"), ep(-1, "lost")]) == []
    assert groups.stats == {"pending_group_episodes": 2.0, "dropped_group_episodes": 1.0}
    state = copy.deepcopy(groups.state_dict())
    out = groups.add([ep(7, "c"), ep(5, "d"), ep(9, "e")])       # both waiting groups complete
    assert [e["tag"] for e in out] == ["a", "d", "b", "c"]        # K consecutive per group
    assert groups.stats["pending_group_episodes"] == 1.0
    assert groups.add([]) == [] and groups.stats["pending_group_episodes"] == 1.0   # 9 waits (wait = 2) ...
    assert groups.add([]) == [] and groups.stats == {"pending_group_episodes": 0.0,
                                                     "dropped_group_episodes": 1.0}      # ... then goes
    again = StartGroups(size=2)
    again.load_state_dict(state)
    assert [e["tag"] for e in again.add([ep(5, "d")])] == ["a", "d"]
