"""A group-rollout plugin for the runtime tests: the learner samples G tokens per prompt from a
categorical policy, scoring workers reward the one right token per prompt, and the update is
GRPO's clipped surrogate on group-relative advantages. It exercises the same contracts as the
browser-form and molecule families (learner-side generation, CPU scoring actors)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from flowrl_ray.algorithms.advantages import group_advantages
from flowrl_ray.algorithms.base import GroupAlgorithm
from flowrl_ray.optim import optimizer_step
from flowrl_ray.algorithms.losses import ppo_clip_objective
from flowrl_ray.batch import Batch, BatchMeta
from flowrl_ray.config import check
from flowrl_ray.envs import EnvSpec

NUM_PROMPTS, NUM_TOKENS = 4, 8


def right_token(prompt: np.ndarray) -> np.ndarray:
    return (3 * prompt + 1) % NUM_TOKENS


# ----------------------------------------------------------------------------- scoring family

def spec(env_cfg) -> EnvSpec:
    return EnvSpec(obs_shape=(1,), action_dim=1)


class TokenScorer:
    def __init__(self, seed: int, worker_id: int):
        self.worker_id = worker_id
        self.crash_file = os.environ.get("FLOWRL_TEST_CRASH_FILE")

    def score(self, samples: dict) -> Batch:
        # A test can make one scorer die mid-iteration: the one whose remove() succeeds exits (two
        # scorers may both see the file; only one can remove it).
        if self.crash_file and os.path.exists(self.crash_file):
            try:
                os.remove(self.crash_file)
            except FileNotFoundError:
                pass
            else:
                os._exit(1)
        rewards = (samples["tokens"] == right_token(samples["prompts"])).astype(np.float32)
        meta = BatchMeta(policy_version=-1, worker_id=self.worker_id, env_steps=len(rewards),
                         episode_returns=rewards.tolist(), episode_lengths=[1] * len(rewards))
        return Batch({"ids": samples["ids"], "tokens": samples["tokens"], "rewards": rewards}, meta)


def make_scorer(env_cfg, seed: int, worker_id: int) -> TokenScorer:
    return TokenScorer(seed, worker_id)


# ----------------------------------------------------------------------------- algorithm

@dataclass
class TokenGRPOConfig:
    lr: float = field(default=0.2, metadata=check(gt=0))
    group_size: int = field(default=8, metadata=check(gt=1))
    clip: float = field(default=0.2, metadata=check(gt=0))
    epochs: int = field(default=4, metadata=check(gt=0))


class TokenPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(NUM_PROMPTS, NUM_TOKENS))


class TokenGRPO(GroupAlgorithm):
    config_class = TokenGRPOConfig

    def __init__(self, cfg, spec, device):
        super().__init__(cfg, spec, device)
        self._policy = TokenPolicy()
        self.optimizer = torch.optim.Adam(self._policy.parameters(), lr=cfg.algo.lr)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.pending: dict = {}
        # A test can make the learner die in its n-th update (n read from the file, which is
        # removed first, so only one learner process dies).
        self.crash_file = os.environ.get("FLOWRL_TEST_LEARNER_CRASH_FILE")
        self.updates = 0

    def generate(self, num_chunks: int, mode: str) -> list[dict]:
        g = self.cfg.algo.group_size
        prompts = torch.arange(NUM_PROMPTS).repeat_interleave(g)                 # [P*G], groups consecutive
        logits = self._policy.logits.detach()[prompts]
        if mode == "eval":
            tokens = logits.argmax(-1)
        else:
            tokens = torch.multinomial(logits.softmax(-1), 1, generator=self.generator).squeeze(-1)
        self.pending = {"prompts": prompts, "tokens": tokens,
                        "logp_old": torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)}
        ids = np.arange(len(prompts))
        return [{"ids": part, "prompts": prompts.numpy()[part], "tokens": tokens.numpy()[part]}
                for part in np.array_split(ids, num_chunks)]

    def _rewards(self, batches: list[Batch], gen: dict) -> torch.Tensor:
        rewards = torch.zeros(len(gen["prompts"]))
        for b in batches:
            ids = torch.as_tensor(b["ids"])
            # the scored tokens are the generation this update reads (async mode keeps several)
            if not torch.equal(torch.as_tensor(b["tokens"]), gen["tokens"][ids]):
                raise AssertionError("scored samples do not match the generation being prepared")
            rewards[ids] = torch.as_tensor(b["rewards"])
        return rewards

    def prepare(self, batches, generation=None):
        gen = self.pending if generation is None else generation
        rewards = self._rewards(batches, gen)
        return dict(gen, rewards=rewards, adv=group_advantages(rewards, self.cfg.algo.group_size))

    def update(self, p):
        self.updates += 1
        if self.crash_file and os.path.exists(self.crash_file):
            with open(self.crash_file) as f:
                die_at = int(f.read())
            if self.updates == die_at:
                os.remove(self.crash_file)
                os._exit(1)
        ratios = []
        for _ in range(self.cfg.algo.epochs):
            logp = torch.log_softmax(self._policy.logits[p["prompts"]], -1).gather(-1, p["tokens"][:, None]).squeeze(-1)
            ratio = (logp - p["logp_old"]).exp()
            ratios.append(float((ratio - 1).abs().max()))
            loss = -ppo_clip_objective(ratio, p["adv"], self.cfg.algo.clip).mean()
            optimizer_step(loss, self.optimizer, None)
        # 0 when the samples are the current policy's (sync); > 0 for samples generated ahead
        return {"token_grpo/reward_mean": float(p["rewards"].mean()), "token_grpo/ratio_start_dev": ratios[0]}

    def eval_metrics(self, batches):
        rewards = self._rewards(batches, self.pending)
        return {"eval/return_mean": float(rewards.mean()), "eval/episodes": len(rewards)}

    def state_dict(self):
        return {"policy": self._policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self._policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
