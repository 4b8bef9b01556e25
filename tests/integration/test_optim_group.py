"""The optimiser step in a group of two gloo processes (torch.distributed, no Ray): the ranks'
weighted shares sum to the one-process step on the whole minibatch, a non-finite loss on one
rank skips the step on both, and a whole update of PPO, CMA-PPO, FPO++ (with and
without accumulation) and FlowSAR on two ranks gives the one-learner weights and statistics."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowrl_ray.optim import Accumulator, local_part, optimizer_step, reduce_sum
from unit.algorithms.test_flow_grpo import sft_dir  # noqa: F401 (a fixture)

X = torch.linspace(-1, 1, 14).reshape(7, 2)          # 7 rows: shares of 4 and 3
Y = torch.arange(7.0)


def _two_ranks(fn, tmp_path, *args) -> dict:
    """``fn(rank, 2, init, *args, out)`` in two spawned processes; -> what each put in ``out``."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(fn, args=(2, f"file://{tmp_path / 'rendezvous'}", *args, out), nprocs=2, join=True)
        return dict(out)


def _assert_ranks_took_the_step(out: dict, before: dict, one: dict, metrics: dict, keys, rel: float = 1e-4) -> None:
    """Each rank's weights are the one learner's (which moved) and so are the ``keys`` statistics."""
    assert any(not torch.equal(before[k], one[k]) for k in one)            # the update moved the weights
    for rank in (0, 1):
        weights, rank_metrics = out[rank]
        for k in one:
            torch.testing.assert_close(weights[k], one[k], rtol=1e-4, atol=1e-6, msg=f"rank {rank} {k}")
        for k in keys:
            assert rank_metrics[k] == pytest.approx(metrics[k], rel=rel, abs=1e-6, nan_ok=True), k


def _model() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model, rows):
    return ((model(X[rows]).squeeze(-1) - Y[rows]) ** 2).mean()


def _rank(rank: int, world: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, opt = _model()
        part = local_part(len(X))
        rows = torch.arange(len(X))[part]
        share = len(rows) / len(X)
        stats = torch.tensor([float(len(rows)), rank + 1.0])          # summed in the step's all-reduce
        norms, stepped = optimizer_step(_loss(model, rows) * share, opt, max_grad_norm=1.0, also_sum=stats)
        mean = reduce_sum(_loss(model, rows).detach() * share)       # after the step: the whole batch's
        # a non-finite loss on rank 1 only: both ranks skip (neither waits for the other)
        bad = lambda: torch.tensor(float("nan")) * model.weight.sum() if rank == 1 else _loss(model, rows) * share  # noqa: E731
        _, stepped_bad = optimizer_step(bad(), opt, max_grad_norm=1.0)
        acc = Accumulator([opt], 1.0)
        acc.backward(bad())
        _, stepped_acc = acc.step()
        out[rank] = {"weight": model.weight.detach().clone(), "bias": model.bias.detach().clone(),
                     "norm": norms[0], "stepped": stepped, "mean": float(mean),
                     "stepped_bad": stepped_bad, "stepped_acc": stepped_acc, "rows": len(rows),
                     "stats": stats.tolist()}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_take_the_one_process_step_and_skip_together(tmp_path):
    out = _two_ranks(_rank, tmp_path)
    model, opt = _model()
    norms, _ = optimizer_step(_loss(model, torch.arange(len(X))), opt, max_grad_norm=1.0)
    assert [out[r]["rows"] for r in (0, 1)] == [4, 3]
    assert out[0]["stats"] == out[1]["stats"] == [7.0, 3.0]          # 4 + 3 rows, 1 + 2
    for r in (0, 1):
        assert out[r]["stepped"] and out[r]["norm"] == pytest.approx(norms[0], rel=1e-6)   # clipped alike
        torch.testing.assert_close(out[r]["weight"], model.weight.detach())
        torch.testing.assert_close(out[r]["bias"], model.bias.detach())
        assert out[r]["mean"] == pytest.approx(float(_loss(model, torch.arange(len(X)))), rel=1e-6)
        assert not out[r]["stepped_bad"] and not out[r]["stepped_acc"]


def _algorithm(name: str):
    """(algorithm, its batches) built the same in every process."""
    torch.manual_seed(0)
    if name == "ppo":
        from conftest import tiny_config
        from flowrl_ray.algorithms.ppo import PPO
        from flowrl_ray.envs import EnvSpec
        from unit.algorithms.test_ppo_math import _synthetic_batch
        algo = PPO(tiny_config("algo.epochs=2", "algo.minibatch_size=24", "algo.target_kl=0.5"), EnvSpec((3,), 1),
                   torch.device("cpu"))
        return algo, [_synthetic_batch(algo, seed=1)]
    if name == "cma_ppo":
        from conftest import PENDULUM
        from flowrl_ray.algorithms.cma_ppo import CMAPPO
        from flowrl_ray.config import load_config
        from flowrl_ray.envs import EnvSpec
        from unit.algorithms.test_ppo_math import _synthetic_batch
        cfg = load_config(PENDULUM.parent.parent / "cma_ppo" / "pendulum.yaml",
                          ["runtime.num_workers=1", "runtime.envs_per_worker=4", "runtime.rollout_length=16",
                           "algo.minibatch_size=20", "algo.epochs=2"])
        algo = CMAPPO(cfg, EnvSpec((3,), 1), torch.device("cpu"))
        return algo, [_synthetic_batch(algo, seed=1)]
    if name == "flowsar":
        from flowrl_ray.algorithms.flowsar import FlowSAR
        from unit.algorithms.test_flowsar import SPEC, make_batch
        from unit.algorithms.test_flowsar import tiny_cfg as flowsar_cfg
        algo = FlowSAR(flowsar_cfg(minibatch_size=7, epochs=2), SPEC, torch.device("cpu"))
        ends = {(5, 0): "term", (3, 1): "term", (2, 2): "trunc", (5, 3): "term"}
        return algo, [make_batch(0, ends=ends, rewards={(5, 0): 1.0, (5, 3): 1.0}, n=4)]
    from flowrl_ray.algorithms.fpopp import FPOPP
    from flowrl_ray.envs import EnvSpec
    from unit.algorithms.test_fpopp import _rollout_batch, tiny_cfg
    kind = {"fpopp": {}, "fpopp_accumulating": {"grad_accumulation": 2}}[name]
    algo = FPOPP(tiny_cfg(critic_warmup_iters=0, minibatch_size=11, epochs=2, **kind), EnvSpec((19,), 7),
                 torch.device("cpu"))
    return algo, [_rollout_batch(algo), _rollout_batch(algo, seed=1)]


def _weights(algo) -> dict:
    return {f"{i}.{k}": v.detach().clone() for i, m in enumerate(algo_modules(algo)) for k, v in m.state_dict().items()}


def algo_modules(algo) -> list:
    return [algo.policy] + [getattr(algo, n) for n in ("value_net", "critic", "old")
                            if getattr(algo, n, None) is not None]


def _algo_rank(rank: int, world: int, init: str, name: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        algo, batches = _algorithm(name)
        metrics = algo.update(algo.prepare(batches))
        out[rank] = (_weights(algo), metrics)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ppo", "cma_ppo", "fpopp", "fpopp_accumulating", "flowsar"])
def test_an_update_on_two_ranks_is_the_one_learner_update(name, tmp_path):
    out = _two_ranks(_algo_rank, tmp_path, name)
    algo, batches = _algorithm(name)
    before = _weights(algo)
    metrics = algo.update(algo.prepare(batches))
    # statistics of whole minibatches (std, min and max are averaged over the parts, as
    # accumulation does: not compared)
    keys = [k for k, v in metrics.items() if isinstance(v, float) and not k.endswith(("_std", "_min", "_max"))]
    _assert_ranks_took_the_step(out, before, _weights(algo), metrics, keys, rel=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["ppo", "fpopp"])
def test_the_learner_update_on_cuda_is_the_cpu_update(name):
    algo, batches = _algorithm(name)
    cuda = type(algo)(algo.cfg, algo.spec, torch.device("cuda"))
    cuda.load_state_dict(algo.state_dict())                      # the same start, on the GPU
    algo.update(algo.prepare(batches))
    cuda.update(cuda.prepare(batches))
    cpu = _weights(algo)
    for k, v in _weights(cuda).items():
        torch.testing.assert_close(v.cpu(), cpu[k], rtol=1e-3, atol=1e-5, msg=k)


# ---------------------------------------------------------------------- a group algorithm: FED-GRPO

FORCE = [3.0, 1.0, 2.0, 0.5, 0.0, 4.0, 1.5, 2.5, 1.0, 0.0, 3.5, 2.0]      # 4 groups of 3
ENERGY = [0.0, 1.0, 0.5, 2.0, 1.0, 0.0, 0.5, 0.5, 2.5, 1.0, 0.0, 3.0]


def _fed(kl_coeff: float):
    from unit.algorithms.test_fed_grpo import _algo
    # 4 groups of 3 in micro-batches of 5 rows: a micro-batch holds rows of both ranks' groups
    return _algo(sample_group_size=4, each_prompt_sample=3, train_micro_batch_size=5,
                 grad_accumulation=2, epochs=2, kl_coeff=kl_coeff, lr=1e-3)


def _fed_trajectory(algo, rows: torch.Tensor) -> dict:
    """The rows' part of a whole batch's recorded trajectory (each tensor's batch dimension)."""
    traj = algo.pending["trajectory"]
    batch_dim = {"z": 1, "mu": 1, "logp": 1, "node_mask": 0}
    return {k: v.index_select(batch_dim[k], rows) if k in batch_dim else v for k, v in traj.items()}


def _fed_rank(rank: int, world: int, init: str, kl_coeff: float, out: dict) -> None:
    from unit.algorithms.test_fed_grpo import _scored
    torch.set_num_threads(1)
    algo = _fed(kl_coeff)
    chunks = algo.generate(2)                     # the whole batch, sampled as one learner would
    batches = _scored(chunks, FORCE, ENERGY)
    rows = (torch.arange(rank, 4, world)[:, None] * 3 + torch.arange(3)).flatten()   # its groups: rank, rank + 2
    algo.pending = {**algo.pending, "rows": rows, "trajectory": _fed_trajectory(algo, rows)}
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        metrics = algo.update(algo.prepare(batches))
        out[rank] = ({k: v.detach().clone() for k, v in algo.model.state_dict().items()}, metrics)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("kl_coeff", [0.0, 0.1])
def test_a_fed_grpo_update_on_two_ranks_is_the_one_learner_update(kl_coeff, tmp_path):
    from unit.algorithms.test_fed_grpo import _scored
    out = _two_ranks(_fed_rank, tmp_path, kl_coeff)
    algo = _fed(kl_coeff)
    before = {k: v.clone() for k, v in algo.model.state_dict().items()}
    metrics = algo.update(algo.prepare(_scored(algo.generate(2), FORCE, ENERGY)))
    _assert_ranks_took_the_step(out, before, algo.model.state_dict(), metrics, (
        "fed_grpo/pg_loss", "fed_grpo/kl", "fed_grpo/ratio_mean", "fed_grpo/clipfrac", "fed_grpo/grad_norm",
        "fed_grpo/advantage_mean", "force_reward_mean", "fed_grpo/lr", "fed_grpo/skipped_updates"))


def _fed_generate_rank(rank: int, world: int, init: str, out: dict) -> None:
    torch.set_num_threads(1)
    algo = _fed(0.0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        chunks = algo.generate(1)
        out[rank] = ([int(i) for c in chunks for i in c["ids"]], [p.tolist() for c in chunks for p in c["positions"]],
                     algo.generator.get_state())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_sample_their_own_whole_groups_with_their_own_noise(tmp_path):
    out = _two_ranks(_fed_generate_rank, tmp_path)
    (ids0, pos0, gen0), (ids1, pos1, gen1) = out[0], out[1]
    assert ids0 == [0, 1, 2, 6, 7, 8] and ids1 == [3, 4, 5, 9, 10, 11]     # groups 0, 2 and 1, 3: never split
    assert pos0[0] != pos1[0]                                             # each rank its own noise
    assert torch.equal(gen0, gen1)                                        # the shared generator stays equal


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fed_grpo_generates_on_cuda_and_its_update_there_is_the_cpu_update():
    import numpy as np

    from unit.algorithms.test_fed_grpo import _scored
    cpu = _fed(0.1)
    torch.manual_seed(0)                                          # as _fed: the same start, on the GPU
    cuda = type(cpu)(cpu.cfg, cpu.spec, torch.device("cuda"))
    chunks = cuda.generate(2)                                     # the learner samples on its device
    assert cuda.pending["trajectory"]["z"].device.type == "cuda"
    assert all(np.isfinite(p).all() for c in chunks for p in c["positions"])
    # the update on one trajectory (the CPU learner's, copied to the GPU) takes the same step
    batches = _scored(cpu.generate(2), FORCE, ENERGY)
    traj = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in cpu.pending["trajectory"].items()}
    cuda.pending = {**cpu.pending, "trajectory": traj}
    cpu.update(cpu.prepare(batches))
    cuda.update(cuda.prepare(batches))
    for k, v in cuda.model.state_dict().items():
        torch.testing.assert_close(v.cpu(), cpu.model.state_dict()[k], rtol=1e-3, atol=1e-5, msg=k)


# ---------------------------------------------------------------------- a group algorithm: Flow-GRPO

FORMS_REWARDS = [0.9, 0.1, 0.3, 0.6, 0.0, 1.0, 0.5, 0.2]          # 4 groups of 2


def _flow_grpo(sft_dir: str):
    from unit.algorithms.test_flow_grpo import _algorithm
    # minibatches of 2 whole groups drawn at random: each holds rows of both ranks' groups or one's
    return _algorithm(sft_dir, prompts_per_iteration=4, group_size=2, minibatch_groups=2, epochs=2,
                      timestep_fraction=0.5, kl_coeff=0.05, lr=3e-3)


def _flow_grpo_rank(rank: int, world: int, init: str, sft_dir: str, out: dict) -> None:
    from integration.test_flow_grpo import _scored
    torch.set_num_threads(1)
    algo = _flow_grpo(sft_dir)
    chunks = algo.generate(2, "train")            # the whole batch, sampled as one learner would
    batches = _scored(algo, chunks, FORMS_REWARDS)
    rows = (torch.arange(rank, 4, world)[:, None] * 2 + torch.arange(2)).flatten()   # its groups: rank, rank + 2
    batch_dim = {"states": 1, "unmasked": 1, "tokens": 1, "logp": 1, "attention_mask": 0}
    traj = {k: v.index_select(batch_dim[k], rows) if k in batch_dim else v
            for k, v in algo.pending["trajectory"].items()}
    algo.pending = {**algo.pending, "rows": rows, "trajectory": traj}
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        metrics = algo.update(algo.prepare(batches))
        out[rank] = ({k: v.detach().clone() for k, v in algo.lm.model.state_dict().items()}, metrics)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_flow_grpo_update_on_two_ranks_is_the_one_learner_update(sft_dir, tmp_path):
    from integration.test_flow_grpo import _scored
    out = _two_ranks(_flow_grpo_rank, tmp_path, sft_dir)
    algo = _flow_grpo(sft_dir)
    before = {k: v.clone() for k, v in algo.lm.model.state_dict().items()}
    metrics = algo.update(algo.prepare(_scored(algo, algo.generate(2, "train"), FORMS_REWARDS)))
    _assert_ranks_took_the_step(out, before, algo.lm.model.state_dict(), metrics, (
        "flow_grpo/pg_loss", "flow_grpo/kl", "flow_grpo/approx_kl", "flow_grpo/clipfrac", "flow_grpo/grad_norm",
        "flow_grpo/loss", "flow_grpo/ratio_mean", "flow_grpo/ratio_min", "flow_grpo/ratio_max",
        "flow_grpo/sampler_logp_gap", "reward_mean", "flow_grpo/advantage_abs_mean"))
