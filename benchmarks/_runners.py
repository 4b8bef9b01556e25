"""One training run per call, for the benchmark scripts: a flowrl_ray config through the Trainer,
or RLlib's PPO (new API stack) built from the numbers of a flowrl_ray PPO config. Each returns a
dict with env steps, startup / loop wall time, the final training return, the deterministic eval
return of the final policy, per-iteration timings, the learning curve and the CPU load."""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

from _common import LoadMonitor


def mean_finite(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.fmean(xs) if xs else None


def steps_per_iteration(cfg) -> int:
    r = cfg.runtime
    return r.num_workers * r.envs_per_worker * r.rollout_length


# --------------------------------------------------------------------------- flowrl_ray

def run_flowrl(config_path, steps: int, seed: int, overrides=(), eval_episodes: int = 10,
               return_window: int = 100, run_dir: str | Path | None = None) -> dict:
    """Train `config_path` for ceil(steps / steps-per-iteration) iterations (no periodic eval, one
    checkpoint at the end), then evaluate the final policy deterministically in this process, as
    `flowrl-ray eval` does."""
    import numpy as np
    import ray

    import flowrl_ray.runtime.trainer as trainer_mod
    from flowrl_ray.runtime.policy import load_policy
    from flowrl_ray.config import load_config
    from flowrl_ray.envs import env_family
    from flowrl_ray.envs.rollout import EnvRunner
    from flowrl_ray.metrics import read_metrics

    per_iter = steps_per_iteration(load_config(config_path, list(overrides)))
    iterations = math.ceil(steps / per_iter)
    cfg = load_config(config_path, [f"train.iterations={iterations}", f"seed={seed}", "eval.interval=0",
                                    "runtime.checkpoint_interval=0", *overrides])
    run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix=f"bench-{cfg.name}-"))
    print(f"[bench] {cfg.name} seed {seed}: {iterations} iterations x {per_iter} steps; run dir {run_dir}",
          flush=True)
    trainer_mod.RETURN_WINDOW = return_window   # module constant read by Trainer.train()

    monitor = LoadMonitor()
    t0 = time.perf_counter()
    trainer = trainer_mod.Trainer(cfg, run_dir)
    try:
        trainer.setup()
        # setup() returns once the learner has published; wait for the rollout workers'
        # constructors as well, so that worker start-up counts as startup, not as training.
        ray.get([w.policy_version.remote() for w in trainer.workers])
        t1 = time.perf_counter()
        summary = trainer.train()
        t2 = time.perf_counter()
        load = monitor.stop()          # before Ray shuts down, so its processes are attributed
    finally:
        trainer.close()

    rows = read_metrics(run_dir)
    e0 = time.perf_counter()
    ecfg, _, policy = load_policy(run_dir)
    runner = EnvRunner(env_family(ecfg.env.family), ecfg.env, min(eval_episodes, 8), ecfg.seed, policy, start_group=1)
    try:
        ev = runner.evaluate(eval_episodes, deterministic=True)
    finally:
        runner.close()
    return {"name": cfg.name, "algorithm": cfg.algorithm, "env": cfg.env.id, "seed": seed,
            "steps": summary["env_steps"], "iterations": summary["iterations"],
            "startup_s": t1 - t0, "loop_s": t2 - t1, "iteration_time_sum_s": summary["time_s"],
            "final_train_return": summary["final_episode_return_mean"],
            "eval_return": float(np.mean(ev["episode_returns"])), "eval_std": float(np.std(ev["episode_returns"])),
            "eval_returns": [float(x) for x in ev["episode_returns"]],
            "eval_episodes": len(ev["episode_returns"]), "eval_s": time.perf_counter() - e0,
            "sample_s": mean_finite([r.get("sample_time_s") for r in rows]),
            "update_s": mean_finite([r.get("learner/update_time_s") for r in rows]),
            "iter_s": mean_finite([r["time_s"] - p["time_s"] for p, r in zip([{"time_s": 0.0}] + rows, rows)]),
            "curve": [(r["env_steps"], r.get("episode_return_mean")) for r in rows],
            "load": load, "run_dir": str(run_dir)}


# --------------------------------------------------------------------------- RLlib

def rllib_ppo_config(ppo_cfg, steps: int, seed: int, eval_episodes: int, return_window: int):
    """RLlib's PPOConfig with the numbers of a flowrl_ray PPO config: the same workers x envs x
    rollout length per iteration, epochs, minibatch, lr (linear to 0 over the budget when the
    flowrl_ray config anneals), gamma, lambda, clip, value-loss weight, entropy bonus, grad clip,
    hidden sizes and activation; a MeanStdFilter for observation normalisation."""
    import torch
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.connectors.env_to_module.mean_std_filter import MeanStdFilter
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    a, r = ppo_cfg.algo, ppo_cfg.runtime
    lr = [[0, a.lr], [steps, 0.0]] if a.lr_schedule == "linear" else a.lr
    connector = (lambda env, spaces, device: MeanStdFilter()) if a.normalize_obs else None
    return (
        PPOConfig()
        .api_stack(enable_rl_module_and_learner=True, enable_env_runner_and_connector_v2=True)
        .environment(ppo_cfg.env.id)
        .env_runners(num_env_runners=r.num_workers, num_envs_per_env_runner=r.envs_per_worker,
                     num_cpus_per_env_runner=1, rollout_fragment_length="auto",
                     env_to_module_connector=connector)
        .learners(num_learners=0)
        .training(train_batch_size_per_learner=steps_per_iteration(ppo_cfg), num_epochs=a.epochs,
                  minibatch_size=a.minibatch_size, lr=lr, gamma=a.gamma, lambda_=a.gae_lambda,
                  clip_param=a.clip,
                  # flowrl_ray minimises vf_coef * 0.5 (V - R)^2; RLlib vf_loss_coeff * (V - R)^2
                  vf_loss_coeff=a.vf_coef / 2, vf_clip_param=a.vf_clip or float("inf"),
                  entropy_coeff=a.ent_coef, use_kl_loss=False, kl_coeff=0.0,
                  grad_clip=a.max_grad_norm, grad_clip_by="global_norm", use_gae=True, use_critic=True)
        .rl_module(model_config=DefaultModelConfig(
            fcnet_hiddens=list(a.hidden_sizes), fcnet_activation=a.activation, vf_share_layers=False,
            free_log_std=True, fcnet_kernel_initializer=torch.nn.init.orthogonal_,
            fcnet_kernel_initializer_kwargs={"gain": math.sqrt(2)},
            fcnet_bias_initializer=torch.nn.init.zeros_))
        .evaluation(evaluation_interval=None, evaluation_num_env_runners=1,
                    evaluation_duration=eval_episodes, evaluation_duration_unit="episodes",
                    evaluation_config=PPOConfig.overrides(explore=False))
        .reporting(metrics_num_episodes_for_smoothing=return_window)
        .debugging(seed=seed)
    )


def run_rllib(ppo_config_path, steps: int, seed: int, eval_episodes: int = 10, return_window: int = 100) -> dict:
    """RLlib PPO until `steps` env steps are sampled, then algo.evaluate() with explore=False."""
    import ray
    import torch

    from flowrl_ray.config import load_config

    ppo_cfg = load_config(ppo_config_path)
    if ppo_cfg.algorithm != "ppo":
        raise ValueError(f"{ppo_config_path} is not a PPO config (algorithm: {ppo_cfg.algorithm})")
    env_id = ppo_cfg.env.id
    torch.set_num_threads(1)
    monitor = LoadMonitor()
    t0 = time.perf_counter()
    # driver/learner bundle + EnvRunners + the evaluation EnvRunner; the dashboard on, as for flowrl_ray
    ray.init(address="local", num_cpus=ppo_cfg.runtime.num_workers + 2, log_to_driver=True)
    algo = rllib_ppo_config(ppo_cfg, steps, seed, eval_episodes, return_window).build_algo()
    t1 = time.perf_counter()
    curve, sample_s, update_s, iter_s, keys_seen = [], [], [], [], {}
    done, it = 0, 0
    try:
        last_print = 0.0
        while done < steps:
            i0 = time.perf_counter()
            result = algo.train()
            iter_s.append(time.perf_counter() - i0)
            it += 1
            env = result.get("env_runners", {})
            done = int(result.get("num_env_steps_sampled_lifetime", env.get("num_env_steps_sampled_lifetime", 0)))
            ret = env.get("episode_return_mean")
            ret = float(ret) if ret is not None and math.isfinite(ret) else None
            curve.append((done, ret))
            timers = result.get("timers", {})
            sample_s.append(timers.get("env_runner_sampling_timer"))
            update_s.append(timers.get("learner_update_timer"))
            if it == 1:
                keys_seen = {"num_env_steps_sampled_lifetime": "num_env_steps_sampled_lifetime" in result,
                             "env_runners/episode_return_mean": "episode_return_mean" in env,
                             "env_runners/num_env_steps_sampled_lifetime": "num_env_steps_sampled_lifetime" in env,
                             "env_runners/num_env_steps_sampled (per iteration)": env.get("num_env_steps_sampled")}
            if time.perf_counter() - last_print > 10 or done >= steps:
                last_print = time.perf_counter()
                el = last_print - t1
                print(f"[rllib ppo {env_id}] seed {seed} | it {it} | steps {done:,} | return "
                      f"{'-' if ret is None else f'{ret:.1f}'} | {done / el:,.0f} steps/s | elapsed {el:.0f}s | "
                      f"ETA {el / max(done, 1) * max(0, steps - done):.0f}s", flush=True)
        t2 = time.perf_counter()
        load = monitor.stop()          # before Ray shuts down, so its processes are attributed
        e0 = time.perf_counter()
        # algo.evaluate() does not copy the training MeanStdFilter statistics to the evaluation
        # EnvRunner in Ray 2.60 (its filter held only the eval episodes' own pushes and the
        # deterministic return collapsed), so copy them from the local EnvRunner, which holds
        # the merged training statistics after every iteration.
        from ray.rllib.core import COMPONENT_ENV_TO_MODULE_CONNECTOR
        filter_state = algo.env_runner.get_state(components=[COMPONENT_ENV_TO_MODULE_CONNECTOR])
        algo.eval_env_runner_group.foreach_env_runner(lambda w: w.set_state(filter_state), local_env_runner=False)
        ev = algo.evaluate()
        eval_s = time.perf_counter() - e0
        ev_env = ev.get("env_runners", ev.get("evaluation", {}).get("env_runners", {}))
    finally:
        algo.stop()
        ray.shutdown()
    # RLlib's sampling/update timers are smoothed per iteration; their mean is a fair summary.
    return {"name": "RLlib PPO", "algorithm": "rllib_ppo", "env": env_id, "seed": seed,
            "steps": done, "iterations": it,
            "startup_s": t1 - t0, "loop_s": t2 - t1, "iteration_time_sum_s": sum(iter_s),
            # an iteration in which no episode ended reports no return: take the last one reported
            "final_train_return": next((r for _, r in reversed(curve) if r is not None), None),
            "eval_return": ev_env.get("episode_return_mean"), "eval_std": None,
            "eval_episodes": ev_env.get("num_episodes"), "eval_s": eval_s,
            "sample_s": mean_finite(sample_s), "update_s": mean_finite(update_s), "iter_s": mean_finite(iter_s),
            "curve": curve, "load": load, "keys_seen": keys_seen}


# --------------------------------------------------------------------------- rollout benchmarks

def niceness(pid: int) -> int | None:
    """A process's nice value from /proc (None when unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        return int(raw[raw.rindex(")") + 2:].split()[16])
    except (OSError, ValueError, IndexError):
        return None


def make_runner(cfg, spec, worker_id: int, state_dict: dict | None):
    """An EnvRunner exactly as RolloutWorker builds one (its seed ``worker_seed(cfg.seed,
    worker_id)``, the config's algorithm's rollout policy)."""
    import torch

    from flowrl_ray.algorithms import get_algorithm
    from flowrl_ray.envs import env_family
    from flowrl_ray.envs.rollout import EnvRunner
    from flowrl_ray.utils import seed_everything, worker_seed
    torch.set_num_threads(cfg.runtime.torch_threads)
    seed = worker_seed(cfg.seed, worker_id)
    seed_everything(seed)
    runner = EnvRunner(env_family(cfg.env.family), cfg.env, cfg.runtime.envs_per_worker,
                       seed, get_algorithm(cfg.algorithm).make_policy(cfg, spec), worker_id)
    if state_dict is not None:
        runner.set_weights(state_dict, 1)
    return runner


# --------------------------------------------------------------------------- no-Ray reference

def _mp_child(conn, cfg, spec, worker_id: int, state_dict: dict, rollout_length: int) -> None:
    runner = make_runner(cfg, spec, worker_id, state_dict)
    conn.send("ready")
    while conn.recv() == "sample":
        conn.send(runner.sample(rollout_length).meta)
    runner.close()


class ProcessPair:
    """Plain spawned processes (no Ray) with an EnvRunner each, built like the Ray workers':
    ``sample()`` drives all of them in parallel and returns their BatchMetas. The machine's own
    ceiling for n-way parallelism, to tell Ray's overhead from CPU contention."""

    def __init__(self, cfg, spec, state_dict: dict, n: int = 2):
        import multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_mp_child, args=(child, cfg, spec, i, state_dict, cfg.runtime.rollout_length),
                               daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for c in self.conns:
            assert c.recv() == "ready"

    def sample(self) -> list:
        for c in self.conns:
            c.send("sample")
        return [c.recv() for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            c.send("stop")
        for p in self.procs:
            p.join(timeout=60)
