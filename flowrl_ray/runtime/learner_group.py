"""The learner group: ``runtime.num_learners`` Learner actors that update one policy together.

    num_learners 1    one Learner actor, as a run has always had (no process group)
    num_learners N    N Learner actors in one placement group (runtime.learner_placement: pack
                      or spread), each with learner_num_cpus / learner_num_gpus; rank 0 hosts the
                      rendezvous and every rank joins one torch.distributed process group (gloo
                      on CPUs, NCCL on GPUs)

Every rank fetches the whole batch and prepares it; each updates on its share of each minibatch
and the optimiser step sums the gradients over the ranks (``flowrl_ray.optim``), so the weights
are the same on every rank after each step. What changes the state (``update``, ``set_state``)
goes to every rank; what reads it (weights to publish, the checkpoint, analysis) to rank 0. A
rank that dies ends the group: the Trainer builds a new one from the last checkpoint
(``runtime.max_learner_restarts``).
"""

from __future__ import annotations

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flowrl_ray.config import Config
from flowrl_ray.envs import EnvSpec
from flowrl_ray.errors import TrainingError
from flowrl_ray.runtime.actors import Learner
from flowrl_ray.runtime.cluster import cluster_gpus, learner_gpus

#: learner methods every rank runs (they change its state); the others are asked of rank 0
ALL_RANKS = frozenset({"update", "set_state"})


class LearnerDied(Exception):
    """A rank of the group died (its process, or a collective it was part of)."""


def get_all(refs: list) -> list:
    """ray.get of every ref, raising the first failure as soon as it lands (a rank that died)
    rather than after the refs before it, which may wait on it in a collective."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
    return ray.get(refs)


class LearnerGroup:
    def __init__(self, cfg: Config, spec: EnvSpec):
        rt = cfg.runtime
        self.size = rt.num_learners
        gpus = learner_gpus(cfg, cluster_gpus())
        options = {"num_cpus": rt.learner_num_cpus, "num_gpus": gpus}
        self.placement_group = None
        self.backend = None                            # the process group's: "gloo" or "nccl"
        if self.size == 1:
            self.actors = [Learner.options(**options).remote(cfg, spec)]
            return
        # Inside a placement group that captures its children (a Tune trial, which reserved a
        # bundle per rank): each rank takes one of its bundles shaped like a rank's, the first ones
        # (a rank in a rollout worker's bundle could leave the worker no room). Otherwise the
        # group reserves its own.
        bundle = {k: float(v) for k, v in (("CPU", rt.learner_num_cpus), ("GPU", gpus)) if v} or {"CPU": 0.01}
        outer = ray.util.get_current_placement_group()
        if outer is not None:
            shaped = [i for i, spec in enumerate(outer.bundle_specs)
                      if {k: float(v) for k, v in spec.items() if k in ("CPU", "GPU") and v} == bundle]
            indices = shaped[:self.size] if len(shaped) >= self.size else [-1] * self.size
        else:
            indices = list(range(self.size))
            self.placement_group = placement_group([bundle] * self.size,
                                                   strategy="PACK" if rt.learner_placement == "pack" else "SPREAD")
            try:
                ray.get(self.placement_group.ready(), timeout=rt.sample_timeout_s)
            except GetTimeoutError:
                self.close()
                raise TrainingError(f"runtime.num_learners: the cluster cannot place {self.size} learners of "
                                    f"{bundle} each (waited {rt.sample_timeout_s:.0f} s)") from None
        group = self.placement_group or outer
        try:
            self.actors = [Learner.options(**options, scheduling_strategy=PlacementGroupSchedulingStrategy(
                               group, placement_group_bundle_index=indices[rank])).remote(cfg, spec, rank)
                           for rank in range(self.size)]
            address = ray.get(self.actors[0].rendezvous_address.remote())
            self.backend = get_all([a.join.remote(address, self.size, rt.sample_timeout_s) for a in self.actors])[0]
        except BaseException:
            self.close()                               # no half-built group left behind
            raise

    def call(self, method: str, *args):
        """The learner method on every rank (``ALL_RANKS``) or on rank 0; returns rank 0's result.
        A group algorithm's training samples come from every rank (``generate(num_chunks,
        "train", ...)``: each rank samples its groups into num_chunks / N chunks; the chunk refs of
        all ranks are returned). LearnerDied when a rank died: its process, or a collective that
        lost a peer."""
        gather = method == "generate" and self.size > 1 and args[1] == "train"
        ranks = self.actors if method in ALL_RANKS or gather else self.actors[:1]
        if gather:
            args = (max(1, args[0] // self.size), *args[1:])
        try:
            results = get_all([getattr(a, method).remote(*args) for a in ranks])
            return [ref for refs in results for ref in refs] if gather else results[0]
        except RayActorError:
            raise LearnerDied(method) from None
        except RayError:
            if self.size > 1 and self.dead_ranks():        # a peer died under a collective
                raise LearnerDied(method) from None
            raise

    def dead_ranks(self) -> list[int]:
        """Ranks whose actor is gone (a busy rank still answers, later: it is not dead)."""
        dead = []
        for rank, actor in enumerate(self.actors):
            try:
                ray.get(actor.pid.remote(), timeout=30)
            except RayActorError:
                dead.append(rank)
            except (GetTimeoutError, RayError):
                pass
        return dead

    def pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                pass
            self.placement_group = None
