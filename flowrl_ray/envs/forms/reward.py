"""The reward of one form-filling episode, with its breakdown.

    reward = w_tc * task_completion + w_fa * field_accuracy + w_ec * execution_completeness

- ``task_completion``: 1 when the form was submitted and the server accepted it, else 0.
- ``field_accuracy``: the fraction of the task's gold fields whose *submitted* value equals the
  gold value after normalisation (:func:`normalize_value`). It is read from the last submission
  the episode made, accepted or rejected: a rejected form with most fields right still earns part
  of this term, which gives the policy a gradient before it learns to satisfy every validation
  rule. No submission: 0. No task (a free run): ``None``, and the term is left out of the reward.
- ``execution_completeness``: executed actions / attempted lines, where the attempted lines are
  the parsed actions plus the unparseable lines: garbage lines in an otherwise good script cost
  something, so the policy learns to write only actions.

Gating: an episode that could not be judged — no action at all (``no_actions``), the browser
died under it (``browser_crash``), it ran past ``rollout_timeout_s`` (``timeout``), the task or
form is unknown (``unknown_task``), the page did not load (``load_error``), the browser threw
something unexpected (``page_error``) — scores 0 with that
``reason`` recorded.

Validity: the reasons in ``INVALID_REASONS`` (the browser crashed or threw, the page did not load,
the episode timed out) say nothing about the policy's text, so such an episode is *invalid*
(``EpisodeResult.valid`` False): a group algorithm leaves it out of its group's advantage
statistics and out of the loss, and counts it per reason, instead of treating it as a failure.
``no_actions`` and ``unknown_task`` stay valid zero-reward episodes. The default weights (0.4, 0.4, 0.2) are the issue's; any non-negative weights
may be configured (``env.kwargs.reward_weights``).
"""

from __future__ import annotations

import datetime as _dt
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from flowrl_ray.config import check
from flowrl_ray.envs.forms.spec import FormSpec, normalize_label

COMPONENTS = ("task_completion", "field_accuracy", "execution_completeness")
#: reasons an episode is gated to reward 0
GATE_REASONS = ("no_actions", "browser_crash", "timeout", "unknown_task", "load_error", "page_error")
#: gated reasons that make an episode invalid (the infrastructure failed, not the policy)
INVALID_REASONS = ("browser_crash", "timeout", "load_error", "page_error")


@dataclass(frozen=True)
class RewardWeights:
    """The reward's mix of its components (``env.kwargs.reward_weights``; missing ones keep
    their default); at least one must be > 0 (checked with the family's settings)."""
    task_completion: float = field(default=0.4, metadata=check(ge=0))
    field_accuracy: float = field(default=0.4, metadata=check(ge=0))
    execution_completeness: float = field(default=0.2, metadata=check(ge=0))


@dataclass
class EpisodeResult:
    """What one episode did and earned. ``reason`` is '' unless the episode was gated."""
    task_id: str | None
    form_id: str
    reward: float = 0.0
    task_completion: float = 0.0
    field_accuracy: float | None = 0.0
    execution_completeness: float = 0.0
    actions: int = 0                    # parsed actions
    executed: int = 0                   # of which executed without error
    unparseable_lines: int = 0
    submitted: bool = False
    accepted: bool = False
    reason: str = ""
    field_matches: dict[str, bool] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)        # why actions failed (first few)
    submission_errors: list[str] = field(default_factory=list)   # the server's validation errors
    submitted_values: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0             # in the browser (waiting for a free page not counted)
    # PNG of the filled page, only for episodes run with a screenshot asked for (not in to_dict)
    screenshot: bytes | None = field(default=None, repr=False)

    @property
    def valid(self) -> bool:
        """False when the episode was gated for a reason in ``INVALID_REASONS`` (crash, timeout,
        load or page error): its reward says nothing about the policy."""
        return self.reason not in INVALID_REASONS

    @property
    def success(self) -> bool:
        """Accepted with every gold field right (the trainer's success rate)."""
        return self.accepted and (self.field_accuracy is None or self.field_accuracy >= 1.0)

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["screenshot"]
        return out


# --------------------------------------------------------------------------- normalisation

def _norm_text(v: Any) -> str:
    return normalize_label(v)


def _norm_number(v: Any) -> float | str:
    try:
        x = float(str(v).strip().replace(",", ""))
    except ValueError:
        return _norm_text(v)
    return x if math.isfinite(x) else _norm_text(v)


def _norm_date(v: Any) -> str:
    try:
        return _dt.date.fromisoformat(str(v).strip()).isoformat()
    except ValueError:
        return _norm_text(v)


def _norm_tel(v: Any) -> str:
    digits = "".join(c for c in str(v) if c.isdigit())
    return digits or _norm_text(v)


def _norm_bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("on", "true", "yes", "1", "checked")
    return bool(v)


def normalize_value(form_field, value: Any) -> Any:
    """The comparable form of a field's value: text case- and whitespace-folded, numbers as
    floats (``"42"`` == ``42.0``), dates ISO, phone numbers as their digits, a yes/no box as a
    bool, a checkbox group as the sorted set of folded options."""
    t = form_field.type
    if t == "number":
        return _norm_number(value)
    if t == "date":
        return _norm_date(value)
    if t == "tel":
        return _norm_tel(value)
    if t == "checkbox":
        if form_field.is_group:
            items = value if isinstance(value, (list, tuple, set)) else ([] if value in (None, "") else [value])
            return tuple(sorted({_norm_text(x) for x in items}))
        return _norm_bool(value)
    return _norm_text(value)


def field_matches(form: FormSpec, gold: Mapping[str, Any], submitted: Mapping[str, Any] | None) -> dict[str, bool]:
    """{gold field name: submitted value == gold value after normalisation}. A field the form no
    longer has, or that was not submitted, does not match (an unsubmitted yes/no box is False)."""
    out = {}
    for name, want in gold.items():
        try:
            f = form.field(name)
        except KeyError:
            out[name] = False
            continue
        if submitted is None:
            out[name] = False
            continue
        got = submitted.get(name, False if f.type == "checkbox" and not f.is_group else None)
        out[name] = got is not None and normalize_value(f, got) == normalize_value(f, want)
    return out


# --------------------------------------------------------------------------- the reward

def score_episode(result: EpisodeResult, form: FormSpec | None, gold: Mapping[str, Any] | None,
                  weights: RewardWeights) -> EpisodeResult:
    """Fill ``result``'s reward terms from what it did (actions, executed, submission). A gated
    result (``reason`` set) scores 0 everywhere. ``gold`` None: no task, field_accuracy None."""
    if result.reason:
        result.reward = result.task_completion = result.execution_completeness = 0.0
        result.field_accuracy = 0.0 if gold is not None else None
        result.field_matches = {}
        return result
    attempted = result.actions + result.unparseable_lines
    result.execution_completeness = result.executed / attempted if attempted else 0.0
    result.task_completion = 1.0 if (result.submitted and result.accepted) else 0.0
    if gold is None or form is None:
        result.field_accuracy = None
        result.field_matches = {}
    else:
        matches = field_matches(form, gold, result.submitted_values if result.submitted else None)
        result.field_matches = matches
        result.field_accuracy = sum(matches.values()) / len(matches) if matches else 1.0
    reward = (weights.task_completion * result.task_completion
              + weights.execution_completeness * result.execution_completeness)
    if result.field_accuracy is not None:
        reward += weights.field_accuracy * result.field_accuracy
    result.reward = float(reward)
    return result
