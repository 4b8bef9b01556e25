"""The browser form-filling family (``env.family: forms``), a scoring family for group rollouts.

A policy (a language model) reads a task's instruction and writes an action script
(:mod:`~flowrl_ray.envs.forms.actions`); a scoring actor executes the script in a real headless
Chromium (:mod:`~flowrl_ray.envs.forms.browser`) on real HTML forms served over HTTP on 127.0.0.1
(:mod:`~flowrl_ray.envs.forms.server`), and the reward comes from what the server accepted
(:mod:`~flowrl_ray.envs.forms.reward`). Forms are data (:mod:`~flowrl_ray.envs.forms.spec`, 26
shipped specs in 8 domains under ``flowrl_ray/data/forms``); tasks are drawn from them
deterministically (:mod:`~flowrl_ray.envs.forms.tasks`).

The family contract (``flowrl_ray.envs``):

- :func:`spec` validates the config (before any actor starts) and returns ``EnvSpec((1,), 1)``;
- :func:`make_scorer` gives a scoring actor its :class:`FormsScorer` (``score(samples) -> Batch``,
  ``close()``);
- :func:`load_tasks` is what the algorithm draws prompts from (``env.kwargs.task_file``: the
  training tasks of a file in FormFactory's layout instead, :mod:`~flowrl_ray.envs.forms.task_file`);
- :func:`save_snapshots` writes the pictures a scorer made of the episodes it was asked for
  (``score(samples, snapshots=N)``) to ``media/forms/``.

:mod:`~flowrl_ray.envs.forms.fewshot` prompts a pretrained LM that an installed package ships
(:mod:`flowrl_ray.models.packaged_lm`) few-shot on the evaluation tasks and scores it with the
same reward: the no-RL reference (``flowrl-ray forms fewshot``).

Modules import Playwright only when a browser starts, so specs, tasks, the parser and the reward
work without it.
"""

from __future__ import annotations

from pathlib import Path

from flowrl_ray.envs import EnvSpec
from flowrl_ray.envs.forms.actions import Action, ParsedScript, format_action, parse_actions
from flowrl_ray.envs.forms.browser import BrowserPool, BrowserUnavailable, find_chromium
from flowrl_ray.envs.forms.reward import EpisodeResult, RewardWeights, normalize_value, score_episode
from flowrl_ray.envs.forms.scorer import FormsScorer, FormsSettings
from flowrl_ray.envs.forms.server import FormServer, render_form, validate_submission
from flowrl_ray.envs.forms.snapshots import compose_snapshot, save_snapshots
from flowrl_ray.envs.forms.spec import FormCatalog, FormSpec, FormSpecError, FieldSpec, load_form_spec
from flowrl_ray.envs.forms.tasks import (SPLITS, FormTask, evaluation_tasks, gold_actions, make_task, prompt_text,
                                         task_from_id)
from flowrl_ray.envs.forms.tasks import load_tasks as _load_tasks

__all__ = ["Action", "BrowserPool", "BrowserUnavailable", "EpisodeResult", "FieldSpec", "FormCatalog", "FormServer",
           "FormSpec", "FormSpecError", "FormTask", "FormsScorer", "FormsSettings", "ParsedScript", "RewardWeights",
           "SPLITS", "evaluation_tasks", "find_chromium", "format_action", "gold_actions", "load_form_spec", "prompt_text", "load_tasks", "make_scorer",
           "make_task", "normalize_value", "parse_actions", "render_form", "save_snapshots", "score_episode", "spec",
           "task_from_id", "validate_submission", "compose_snapshot"]


def spec(env_cfg) -> EnvSpec:
    """Validate the family's settings and forms (ConfigError naming the key) and return the
    (trivial) env spec: the policy's input and output are text, not arrays."""
    settings = FormsSettings.from_env_cfg(env_cfg)
    settings.file_tasks(settings.catalog())          # a bad task file stops here, naming its line
    return EnvSpec(obs_shape=(1,), action_dim=1)


def make_scorer(env_cfg, seed: int, worker_id: int) -> FormsScorer:
    """A scorer with its own form server and browser. ``seed`` is unused: scoring is
    deterministic given the texts (task ids carry their own seed)."""
    return FormsScorer(FormsSettings.from_env_cfg(env_cfg), worker_id)


def load_tasks(split: str, forms_dir: str | Path | None = None, seed: int = 0,
               per_form: int | None = None, catalog: FormCatalog | None = None) -> list[FormTask]:
    """The tasks of ``split`` (train | heldout | heldout_values | heldout_forms), the same for
    the same arguments; see :mod:`flowrl_ray.envs.forms.tasks`."""
    return _load_tasks(split, forms_dir=forms_dir, seed=seed, per_form=per_form, catalog=catalog)
