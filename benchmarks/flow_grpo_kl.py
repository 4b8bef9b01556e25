"""How far does one Flow-GRPO update move the masked-diffusion policy, and what does each KL
estimator make of that move?

    .venv/bin/python benchmarks/flow_grpo_kl.py                       # forms_small, lr 1e-4 and 1e-5
    .venv/bin/python benchmarks/flow_grpo_kl.py --lrs 1e-4 --config configs/flow_grpo/forms_small.yaml

For each learning rate, a fresh learner (the config's SFT base, seed fixed) generates the same
batch (prompts_per_iteration x group_size rollouts at the training temperature), scores each
completion offline by the fraction of its task's gold action lines it wrote (the browser's
field accuracy without the browser), and runs the config's own update on it (``FlowGRPO.update``:
its epochs, minibatches and step subsampling). Reported per learning rate: what the update
logged (k3 KL, loss, gradient norm before clipping, smallest ratio), then, over every
(rollout, step) of the batch, the updated policy against the reference (the SFT base, which also
generated the batch): the step log-ratio d = log pi_ref(step) - log pi(step) and both KL
penalties of :func:`flowrl_ray.algorithms.flow_grpo.kl_penalty` (``step``: k3 of d; ``token``:
the sum of per-token k3). Results: ``<results-dir>/<output>.{json,md}``. No assertion is made.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (RESULTS_DIR, git_revision, machine_info, md_table,  # noqa: E402
                     write_json, write_results)

CONFIG = "configs/flow_grpo/forms_small.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 1e-5])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--output", default="flow_grpo_kl")
    p.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p.parse_args(argv)


def offline_rewards(algo, chunks) -> "np.ndarray":
    """Per rollout: the fraction of its task's gold action lines that the completion contains."""
    import numpy as np

    from flowrl_ray.envs.forms import gold_actions
    from flowrl_ray.envs.forms.actions import parse_actions
    tasks = {t.task_id: t for t in algo.train_tasks}
    out = []
    for c in chunks:
        for task_id, text in zip(c["task_ids"], c["texts"]):
            gold = [str(a) for a in parse_actions(gold_actions(tasks[task_id], algo.catalog)).actions]
            written = {str(a) for a in parse_actions(text).actions}
            out.append(sum(g in written for g in gold) / len(gold))
    return np.asarray(out, np.float32)


def one_update(cfg, lr: float) -> dict:
    import numpy as np
    import torch

    from flowrl_ray.algorithms.flow_grpo import FlowGRPO, kl_penalty
    from flowrl_ray.batch import Batch, BatchMeta
    from flowrl_ray.config import apply_overrides, config_from_dict
    from flowrl_ray.envs import EnvSpec
    cfg = config_from_dict(apply_overrides(cfg, [f"algo.lr={lr}"]))
    torch.manual_seed(cfg.seed)
    algo = FlowGRPO(cfg, EnvSpec(obs_shape=(1,), action_dim=1), torch.device("cpu"))
    chunks = algo.generate(1, "train")
    r = offline_rewards(algo, chunks)
    zeros = np.zeros_like(r)
    data = {"ids": np.concatenate([c["ids"] for c in chunks]), "rewards": r, "task_completion": zeros,
            "field_accuracy": r, "execution_completeness": zeros, "unparseable_lines": zeros}
    logged = algo.update(algo.prepare([Batch(data, BatchMeta(policy_version=0, worker_id=0, env_steps=len(r)))]))
    traj = algo.pending["trajectory"]
    rows = torch.arange(traj["states"].shape[1])
    d, step_kl, token_kl = [], [], []
    with torch.no_grad():
        algo.lm.model.eval()
        for s in range(traj["states"].shape[0]):
            if not traj["unmasked"][s].any():
                continue
            tok = algo._token_log_probs(algo.lm.model, traj, s, rows)          # [B, L]
            ref = algo._reference_log_probs(traj, s, rows)
            d.append((ref - tok).sum(-1))
            step_kl.append(kl_penalty(tok, ref, "step"))
            token_kl.append(kl_penalty(tok, ref, "token"))
    d, step_kl, token_kl = (torch.cat(x).numpy() for x in (d, step_kl, token_kl))
    q = lambda x: {"mean": float(x.mean()), "median": float(np.median(x)), "p99": float(np.quantile(x, 0.99)),
                   "max": float(x.max())}
    return {"lr": lr, "rollouts": len(r), "reward_mean": float(r.mean()),
            "logged": {k: logged[k] for k in ("flow_grpo/kl", "flow_grpo/loss", "flow_grpo/pg_loss",
                                               "flow_grpo/grad_norm", "flow_grpo/ratio_min", "flow_grpo/ratio_max",
                                               "flow_grpo/optimizer_steps") if k in logged},
            "abs_step_log_ratio": q(np.abs(d)), "step_k3": q(step_kl), "token_k3": q(token_kl)}


def main(argv=None) -> dict:
    import torch

    from flowrl_ray.config import apply_overrides, read_yaml
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    base = apply_overrides(read_yaml(args.config), args.overrides)
    runs = [one_update(base, lr) for lr in args.lrs]
    f = lambda x: f"{x:.3g}"
    rows = [[f"{r['lr']:g}", f(r["logged"]["flow_grpo/kl"]), f(r["logged"]["flow_grpo/loss"]),
             f(r["logged"]["flow_grpo/grad_norm"]), f(r["logged"]["flow_grpo/ratio_min"]),
             f(r["abs_step_log_ratio"]["median"]), f(r["abs_step_log_ratio"]["max"]),
             f(r["step_k3"]["mean"]), f(r["step_k3"]["max"]), f(r["token_k3"]["mean"]), f(r["token_k3"]["max"])]
            for r in runs]
    body = (f"Config `{args.config}` {' '.join(args.overrides)}; one update of the config's own shape "
            f"({runs[0]['logged'].get('flow_grpo/optimizer_steps', 0):.0f} optimiser steps) on one batch of "
            f"{runs[0]['rollouts']} rollouts from the SFT base, rewards scored offline (mean "
            f"{runs[0]['reward_mean']:.3f}). Logged by the update (means over its minibatch steps), then the "
            f"updated policy against the reference on every (rollout, step) of the batch.\n\n"
            + md_table(["lr", "logged k3", "logged loss", "grad norm", "ratio min", "|d| median", "|d| max",
                        "step k3 mean", "step k3 max", "token k3 mean", "token k3 max"], rows))
    out = Path(args.results_dir)
    write_results(args.output, "Flow-GRPO: how far one update moves the policy, and the two KL estimators",
                  body, results_dir=out)
    write_json(out / f"{args.output}.json",
        {"args": vars(args), "machine": machine_info(), "git": git_revision(), "runs": runs})
    return {"runs": runs}


if __name__ == "__main__":
    main()
