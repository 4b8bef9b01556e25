"""ReinFlow on synthetic batches: the log-prob scale, where the gradients go, the direction of an
update, loading a base, evaluation with the noise off, exact resume of the learner state. Rollouts
on real robosuite Lift (ratio = 1 at the old policy, sync and async):
tests/integration/test_reinflow.py."""

import copy
import math
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from flowrl_ray.algorithms.fpopp import FPOPP  # noqa: E402
from flowrl_ray.algorithms.reinflow import ReinFlow  # noqa: E402
from flowrl_ray.batch import Batch, BatchMeta  # noqa: E402
from flowrl_ray.config import ConfigError, config_from_dict  # noqa: E402
from flowrl_ray.envs import env_family  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def robot_cfg(mode="sync", algorithm="reinflow", env=None, **algo):
    base = {"hidden_sizes": [32], "critic_hidden_sizes": [16], "minibatch_size": 4, "flow_steps": 2,
            "critic_warmup_iters": 0, "feature_dim": 8}
    if algorithm == "reinflow":
        base.update(noise_hidden_sizes=[16], epochs=2)
    else:
        base.update(n_mc=2)
    return config_from_dict({
        "algorithm": algorithm,
        "env": {"family": "robot", "id": "lift", "horizon_steps": 4, "act_steps": 2, "max_episode_steps": 6,
                **(env or {})},
        "runtime": {"num_workers": 1, "envs_per_worker": 2, "rollout_length": 5, "mode": mode},
        "algo": {**base, **algo}})


def _spec(cfg):
    return env_family("robot").spec(cfg.env)


def _synthetic_batch(cfg, algo, t=3, n=2, seed=0):
    """A [T, N] env-step batch sampled from the algorithm's policy on random observations."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(t, n, _spec(cfg).obs_dim, generator=g)
    recs = [algo.policy.act(obs[i], generator=g)[1] for i in range(t)]
    data = {k: torch.stack([r[k] for r in recs]).numpy() for k in recs[0]}
    data.update(obs=obs.numpy(), rewards=torch.randn(t, n, generator=g).numpy(),
                terminated=np.zeros((t, n), bool), truncated=np.zeros((t, n), bool),
                last_obs=torch.randn(n, obs.shape[-1], generator=g).numpy(),
                executed_rows=np.full((t, n), cfg.env.act_steps))
    return Batch(data=data, meta=BatchMeta(worker_id=0, policy_version=1, env_steps=t * n))


def test_only_executed_rows_enter_the_log_prob():
    cfg = robot_cfg()
    algo = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    b = algo.prepare([_synthetic_batch(cfg, algo)])
    assert b["row_mask"].sum(-1).eq(2).all()                        # act_steps 2 of horizon 4
    changed = b["chains"].clone()
    changed[:, -1, 2:] += 5.0            # the final state's rows that never ran (earlier states feed
    #                                      the velocity of every row: the net reads the whole chunk)
    with torch.no_grad():
        same = algo.policy.chain_log_prob(b["obs"], changed, b["row_mask"])
        other = algo.policy.chain_log_prob(b["obs"], changed)
    torch.testing.assert_close(same, b["logp_old"], rtol=0, atol=1e-5)
    assert (other < b["logp_old"] - 10).all()


def test_reference_scale_divides_the_log_ratio_by_k_plus_one_rows_dims():
    cfg = robot_cfg(logprob_scale="reference")
    algo = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    assert algo.scale == pytest.approx(1.0 / ((2 + 1) * 2 * 7))        # (K + 1) * act_steps * Da = 42
    b = algo.prepare([_synthetic_batch(cfg, algo)])
    b["logp_old"] = b["logp_old"] - 4.2                              # pretend pi_new / pi_old = e^4.2
    _, stats = algo._losses(b, torch.arange(6), torch.arange(6), train_actor=True)
    assert float(stats["ratio_mean"]) == pytest.approx(math.exp(4.2 / 42), rel=1e-5)
    joint = ReinFlow(robot_cfg(), _spec(cfg), torch.device("cpu"))
    assert joint.scale == 1.0


def test_policy_gradient_reaches_both_nets_and_entropy_only_the_noise_net():
    cfg = robot_cfg(ent_coef=1.0)
    algo = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    b = algo.prepare([_synthetic_batch(cfg, algo)])
    policy = algo.policy
    obs = b["obs"]
    policy.zero_grad()
    policy.chain_entropy(obs, b["chains"], b["row_mask"]).sum().backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for n, p in policy.named_parameters()
               if not n.startswith("noise."))
    assert sum(float(p.grad.abs().sum()) for p in policy.noise.parameters()) > 0
    policy.zero_grad()
    policy.chain_log_prob(obs, b["chains"], b["row_mask"]).sum().backward()
    assert sum(float(p.grad.abs().sum()) for p in policy.velocity.parameters()) > 0
    assert sum(float(p.grad.abs().sum()) for p in policy.noise.parameters()) > 0


def test_an_update_raises_the_log_prob_of_the_chain_with_the_positive_advantage():
    cfg = robot_cfg(epochs=1, minibatch_size=6, clip=10.0, lr=1e-3, noise_lr=1e-3, normalize_advantages=False)
    algo = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    b = algo.prepare([_synthetic_batch(cfg, algo)])
    b["advantages"] = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    before = b["logp_old"].clone()
    algo.update(b)
    with torch.no_grad():
        after = algo.policy.chain_log_prob(b["obs"], b["chains"], b["row_mask"])
    assert after[0] > before[0] and after[1] < before[1]


def test_noise_net_has_its_own_learning_rate_and_is_bounded():
    cfg = robot_cfg(lr=1e-4, noise_lr=3e-3, min_noise_std=0.05, max_noise_std=0.2)
    algo = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    assert [g["lr"] for g in algo.actor_opt.param_groups] == [1e-4, 3e-3]
    noise_ids = {id(p) for p in algo.policy.noise.parameters()}
    assert {id(p) for p in algo.actor_opt.param_groups[1]["params"]} == noise_ids
    assert not noise_ids & {id(p) for p in algo.actor_opt.param_groups[0]["params"]}
    std = algo.policy.log_std(torch.rand(64), 100 * torch.randn(64, _spec(cfg).obs_dim)).exp()
    assert std.min() >= 0.05 - 1e-6 and std.max() <= 0.2 + 1e-6


def test_evaluation_runs_the_mean_chain_and_training_the_noisy_one():
    cfg = robot_cfg()
    policy = ReinFlow.make_policy(cfg, _spec(cfg))
    obs = torch.randn(3, _spec(cfg).obs_dim)
    a_eval, rec = policy.act(obs, generator=torch.Generator().manual_seed(1), record=False)
    assert set(rec) == {"actions"}
    x0 = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(a_eval, policy.sample(obs, x0))                      # x_0 ~ N(0, I), no noise
    zero, _ = policy.act(obs, deterministic=True)
    torch.testing.assert_close(zero, policy.sample(obs, torch.zeros(3, 4, 7)))     # x_0 = 0
    noisy, rec = policy.act(obs, generator=torch.Generator().manual_seed(1))
    assert rec["chains"].shape == (3, 3, 4, 7) and not torch.allclose(noisy, a_eval)
    torch.testing.assert_close(rec["chains"][:, 0], x0)


def test_a_pretraining_checkpoint_loads_and_a_wrong_one_is_refused():
    cfg = robot_cfg()
    flow = FPOPP.make_policy(robot_cfg(algorithm="fpopp"), _spec(cfg))
    policy = ReinFlow.make_policy(cfg, _spec(cfg))
    noise_before = copy.deepcopy(policy.noise.state_dict())
    policy.load_base(flow.state_dict())
    for k, v in flow.state_dict().items():
        assert torch.equal(policy.state_dict()[k], v), k
    for k, v in noise_before.items():
        assert torch.equal(policy.noise.state_dict()[k], v), k
    wrong = {k: v for k, v in flow.state_dict().items() if not k.startswith("velocity.net.0")}
    with pytest.raises(RuntimeError, match="missing"):
        policy.load_base(wrong)


def test_equal_noise_bounds_make_a_fixed_noise_head():
    cfg = robot_cfg(min_noise_std=0.1, max_noise_std=0.1, ent_coef=0.1)
    algo = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    b = algo.prepare([_synthetic_batch(cfg, algo)])
    with torch.no_grad():
        log_std = algo.policy.log_std(torch.rand(6), algo.policy.encoder(b["obs"]))
    torch.testing.assert_close(log_std, torch.full_like(log_std, math.log(0.1)))
    loss, _ = algo._losses(b, torch.arange(6), torch.arange(6), train_actor=True)
    loss.backward()
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in algo.policy.noise.parameters())


def test_flow_sde_policy_scores_its_own_chain_with_ratio_one_and_learns_nothing_in_the_noise():
    # πRL's Flow-SDE: the chain is sampled and scored with the SDE's transitions (K = 2, a = 0.5:
    # step stds 0.5 and 0.5 sqrt(0.5)); the recorded log-probs equal the learner's (ratio 1), an
    # update moves the velocity net only, and evaluation is the Euler sampler without noise
    cfg = robot_cfg(noise="sde", sde_level=0.5, epochs=1, minibatch_size=6, clip=10.0, lr=1e-3,
                    normalize_advantages=False, advantage="group", env={"start_group": 2})
    algo = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    pi = algo.policy
    assert pi.sde_level == 0.5
    cond = pi.encoder(torch.randn(3, _spec(cfg).obs_dim))
    stds = [float(pi.log_std(torch.full((3,), k / 2), cond).exp().unique()) for k in (0, 1)]
    assert stds == pytest.approx([0.5, 0.5 * math.sqrt(0.5)], abs=1e-6)
    obs = torch.randn(6, _spec(cfg).obs_dim)
    _, rec = pi.act(obs, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        again = pi.chain_log_prob(obs, rec["chains"], per_row=True)
        learned_noise = ReinFlow.make_policy(robot_cfg(), _spec(cfg))
        learned_noise.load_state_dict(pi.state_dict())
        other = learned_noise.chain_log_prob(obs, rec["chains"], per_row=True)     # the noise net's chain
    torch.testing.assert_close(again, rec["logp_old"])
    assert not torch.allclose(again, other)
    b = {"obs": obs, "chains": rec["chains"], "row_mask": torch.ones(6, 4), "logp_old": again.sum(-1),
         "advantages": torch.tensor([1.0, -1.0, 0, 0, 0, 0]), "returns": torch.zeros(6), "values_old": torch.zeros(6)}
    loss, stats = algo._losses(b, torch.arange(6), torch.arange(6), train_actor=True)
    assert float(stats["ratio_max"]) == pytest.approx(1.0, abs=1e-5)
    loss.backward()
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in pi.noise.parameters())
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in pi.velocity.parameters())
    x0 = torch.randn(6, 4, 7, generator=torch.Generator().manual_seed(1))
    x = x0
    with torch.no_grad():
        for k in range(2):
            x = x + pi.velocity(x, torch.full((6,), k / 2), pi.encoder(obs)) / 2
    torch.testing.assert_close(pi.sample(obs, x0), x.clamp(-1, 1))


def test_config_mistakes_name_the_key():
    with pytest.raises(ConfigError, match="algo.min_noise_std"):
        ReinFlow.validate_config(robot_cfg(min_noise_std=0.3, max_noise_std=0.1))
    with pytest.raises(ConfigError, match="algo.ent_coef"):
        ReinFlow.validate_config(robot_cfg(noise="sde", ent_coef=0.01))
    with pytest.raises(ConfigError, match="algo.noise"):
        robot_cfg(noise="ode")
    with pytest.raises(ConfigError, match="algo.sde_level"):
        robot_cfg(noise="sde", sde_level=0.0)
    with pytest.raises(ConfigError, match="algo.logprob_scale"):
        robot_cfg(logprob_scale="mean")


def test_group_advantage_is_the_episodes_return_normalised_in_its_start_group_for_every_step():
    # πRL's GRPO: env 0 succeeds at t = 1 (return 1), env 1 fails at t = 2 (return 0), both from
    # start seed 3: A = (G - mean) / std = +1 and -1 for every step of each; no critic is trained,
    # and the update raises the successful chains' log-prob against the failed ones'.
    cfg = robot_cfg(env={"start_group": 2}, advantage="group", epochs=4, minibatch_size=5)
    algo = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    first = _synthetic_batch(cfg, algo, t=3, seed=4)
    first.data["rewards"] = np.zeros((3, 2), np.float32)
    first.data["rewards"][1, 0] = 1.0
    first.data["terminated"][1, 0] = first.data["terminated"][2, 1] = True
    first.data["start_seed"] = np.array([[3, 3], [3, 3], [8, 3]])
    algo2 = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))        # other weights: the recorded log-probs count
    lone = _synthetic_batch(cfg, algo2, t=3, seed=5)               # not ended: nothing to learn yet
    lone.data["start_seed"] = np.full((3, 2), 9)
    assert algo2.prepare([lone]) is None
    assert algo2.update(None)["reinflow/pending_group_episodes"] == 0.0
    b = algo.prepare([first])
    recorded = np.concatenate([first["logp_old"][:2, 0], first["logp_old"][:3, 1]])      # [5, Ta] per row
    torch.testing.assert_close(b["logp_old"], torch.as_tensor(recorded[:, :2]).sum(-1))  # the 2 executed rows
    algo2.load_state_dict(copy.deepcopy(algo.state_dict()))
    torch.testing.assert_close(b["advantages"], torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0]))
    assert b["row_mask"].sum(-1).eq(2).all() and b["chains"].shape[0] == 5
    with torch.no_grad():                                       # ratio 1 at the behaviour policy
        torch.testing.assert_close(algo2.policy.chain_log_prob(b["obs"], b["chains"], b["row_mask"]), b["logp_old"])
    critic = copy.deepcopy(algo2.critic.state_dict())
    stats = algo2.update(b)
    assert stats["reinflow/groups"] == 1.0 and stats["reinflow/groups_mixed"] == 1.0
    assert "reinflow/explained_variance" not in stats
    assert all(torch.equal(v, algo2.critic.state_dict()[k]) for k, v in critic.items())
    with torch.no_grad():
        gain = algo2.policy.chain_log_prob(b["obs"], b["chains"], b["row_mask"]) - b["logp_old"]
    assert gain[:2].mean() > gain[2:].mean()
    with pytest.raises(ConfigError, match="algo.advantage.*env.start_group"):
        robot_cfg(advantage="group")


def test_state_dict_round_trip_gives_the_same_next_update_bit_for_bit():
    cfg = robot_cfg(critic_warmup_iters=1, target_kl=100.0)
    a = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    a.update(a.prepare([_synthetic_batch(cfg, a, seed=1)]))         # critic warm-up
    a.update(a.prepare([_synthetic_batch(cfg, a, seed=2)]))
    b = ReinFlow(cfg, _spec(cfg), torch.device("cpu"))
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    batch = _synthetic_batch(cfg, a, seed=3)
    ma, mb = a.update(a.prepare([batch])), b.update(b.prepare([batch]))
    assert ma == mb
    for k, v in a.state_dict()["policy"].items():
        assert torch.equal(v, b.state_dict()["policy"][k]), k


def test_an_imported_reinflow_architecture_builds_and_loads_into_the_noisy_policy():
    arch = {"time_embedding": "reinflow", "velocity_mlp": "residual", "velocity_activation": "relu",
            "hidden_sizes": [32, 32, 32]}
    cfg = robot_cfg(**arch)
    flow = FPOPP.make_policy(robot_cfg(algorithm="fpopp", **arch), _spec(cfg))
    policy = ReinFlow.make_policy(cfg, _spec(cfg))
    assert type(policy.velocity.net).__name__ == "ResidualMLP" and policy.velocity.time_embedding == "reinflow"
    policy.load_base(flow.state_dict())
    x, tau, cond = torch.randn(3, 4, 7), torch.rand(3), torch.randn(3, _spec(cfg).obs_dim)
    torch.testing.assert_close(policy.velocity(x, tau, cond), flow.velocity(x, tau, cond), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="algo.hidden_sizes"):
        ReinFlow.validate_config(robot_cfg(velocity_mlp="residual", hidden_sizes=[32, 32]))
