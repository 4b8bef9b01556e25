"""Flow-matching action policies: velocity networks, the Euler sampler and the CFM loss.

Time convention (one for the whole package): ``tau = 0`` is noise, ``tau = 1`` is data,

    x_tau = tau * a + (1 - tau) * eps,      target velocity  u = a - eps,

and sampling integrates ``dx/dtau = v(x, tau | o)`` with K Euler steps from ``x_0 = eps`` to the
action at ``tau = 1``. Actions are chunks ``[Ta, Da]`` (``horizon_steps`` x action width) in the
dataset-normalised [-1, 1] range.

Written once and shared: :func:`cfm_losses` is behaviour cloning's loss (pretraining), FPO++'s
likelihood surrogate and FlowSAR's energy; :func:`euler_sample` is every flow policy's sampler.

The velocity network has a few architecture options (:data:`FLOW_ARCH_DEFAULTS`; the defaults are
this package's network, unchanged) so that the ReinFlow / ReFlow release's ``FlowMLP`` is
represented exactly (:mod:`flowrl_ray.envs.robot.import_reinflow` converts its checkpoints):
``time_embedding`` (:data:`TIME_EMBEDDINGS`), ``velocity_mlp`` (:data:`VELOCITY_MLPS`) and
``velocity_activation``; the sampler has the release's time grid and per-step clipping as options
(:data:`TIME_GRIDS`). The release uses the same time convention as this package (t = 0 noise,
t = 1 data, x_t = t a + (1 - t) eps, target a - eps), so no time is flipped.
"""

from __future__ import annotations

import math
from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch import nn

from flowrl_ray.models.mlp import ResidualMLP, mlp
from flowrl_ray.utils import randn

#: an observation batch: a state tensor [B, D], or {"state": [B, D], "rgb": [B, C, H, W] uint8}
Obs = Union[torch.Tensor, dict]
#: velocity_fn(x [B, Ta, Da], tau [B], cond [B, ...]) -> v [B, Ta, Da]
VelocityFn = Callable[[torch.Tensor, torch.Tensor, Obs], torch.Tensor]

#: the velocity network's time features: "flowrl" (:func:`sinusoidal_embedding`: sin/cos of
#: 1000 tau) or "reinflow" (:func:`diffuser_time_embedding`: sin/cos of tau itself, the ReinFlow /
#: ReFlow FlowMLP's, from Diffuser); either goes through the same Linear-Mish-Linear time MLP
TIME_EMBEDDINGS = ("flowrl", "reinflow")
#: the velocity network's body: "plain" (:func:`~flowrl_ray.models.mlp.mlp`: Linear, act, ..,
#: Linear) or "residual" (:class:`~flowrl_ray.models.mlp.ResidualMLP`, ReinFlow's residual_style)
VELOCITY_MLPS = ("plain", "residual")
#: the Euler sampler's times: "left" tau_k = k / K (every sampler of this package) or "linspace"
#: tau_k = k / (K - 1), i.e. torch.linspace(0, 1, K) (the ReFlow release's sampler; its last step
#: is evaluated at tau = 1, its step stays 1 / K; tau_0 = 0 for K = 1)
TIME_GRIDS = ("left", "linspace")
#: the architecture options and their defaults (this package's network); a checkpoint's "arch"
#: names an option only when it differs, so every older checkpoint means the defaults
FLOW_ARCH_DEFAULTS = {"time_embedding": "flowrl", "velocity_mlp": "plain", "velocity_activation": "mish"}


def repeat_obs(obs: Obs, n: int) -> Obs:
    """Each row repeated ``n`` times in place: [o0, o0, .., o1, o1, ..] (matches
    ``x.reshape(B * n, ...)`` of a [B, n, ...] tensor)."""
    if isinstance(obs, dict):
        return {k: v.repeat_interleave(n, dim=0) for k, v in obs.items()}
    return obs.repeat_interleave(n, dim=0)


def obs_batch_size(obs: Obs) -> int:
    return next(iter(obs.values())).shape[0] if isinstance(obs, dict) else obs.shape[0]


#: how a chunk's squared errors [Ta, Da] become one CFM loss: "mean_dims" averages over the
#: action dims and sums over the (executed) rows, the FPO++ paper's and release's scale;
#: "sum" sums over both (Da times larger: behaviour cloning's historical loss, and the ablation)
CFM_REDUCTIONS = ("mean_dims", "sum")


def cfm_losses(velocity_fn: VelocityFn, obs: Obs, actions: torch.Tensor, taus: torch.Tensor,
               eps: torch.Tensor, huber_delta: float = 0.0, reduction: str = "mean_dims",
               row_mask: torch.Tensor | None = None, per_row: bool = False) -> torch.Tensor:
    """Per-sample conditional flow-matching losses (FPO++ Eq. 5-8), all in one forward pass:

        x_i = tau_i * a + (1 - tau_i) * eps_i
        l_i = sum_rows m_r * reduce_dims (v(x_i, tau_i | o) - (a - eps_i))_r^2

    obs [B, ...] (repeated ``N`` times for the call), actions [B, Ta, Da], taus [B, N],
    eps [B, N, Ta, Da] -> [B, N]. ``reduction`` (see :data:`CFM_REDUCTIONS`) reduces each row's
    Da errors by their mean or sum; ``row_mask`` [B, Ta] (1: the env executed the row, 0: it
    never ran) weighs the rows before their sum (None: every row counts). With ``huber_delta``
    > 0 each element's squared error d^2 becomes ``2 delta |d| - delta^2`` where ``|d| > delta``
    (the FPO++ release's Huber error: equal to d^2 inside delta, linear outside, so large
    noise-dominated errors weigh less). ``per_row``: the rows' losses [B, N, Ta] before their
    (masked) sum, for a caller that learns the mask later (:func:`sum_rows` finishes them).
    """
    if reduction not in CFM_REDUCTIONS:
        raise ValueError(f"CFM reduction must be one of {CFM_REDUCTIONS}, got {reduction!r}")
    b, n = taus.shape
    a = actions.unsqueeze(1)                                    # [B, 1, Ta, Da]
    t = taus[..., None, None]                                   # [B, N, 1, 1]
    x = t * a + (1.0 - t) * eps                                 # [B, N, Ta, Da]
    target = a - eps                                            # [B, N, Ta, Da]
    v = velocity_fn(x.reshape(b * n, *actions.shape[1:]), taus.reshape(b * n), repeat_obs(obs, n))
    d = v.reshape(b, n, *actions.shape[1:]) - target            # [B, N, Ta, Da]
    if huber_delta > 0:
        err = torch.where(d.abs() <= huber_delta, d.pow(2), 2.0 * huber_delta * d.abs() - huber_delta ** 2)
    else:
        err = d.pow(2)
    rows = err.mean(-1) if reduction == "mean_dims" else err.sum(-1)          # [B, N, Ta]
    return rows if per_row else sum_rows(rows, row_mask)


def sum_rows(rows: torch.Tensor, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row CFM losses [B, N, Ta] -> [B, N]: the sum over the rows ``row_mask`` [B, Ta] keeps
    (1: executed, 0: never ran; None: all)."""
    if row_mask is not None:
        rows = rows * row_mask[:, None, :].to(rows.dtype)
    return rows.sum(-1)


def row_mean(x: torch.Tensor, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Ta, Da] -> [B]: the mean over the action dims and the rows ``row_mask`` [B, Ta] keeps
    (1: executed; None: every row); a chunk without a kept row gives 0."""
    per_row = x.mean(-1)                                                     # [B, Ta]
    if row_mask is None:
        return per_row.mean(-1)
    m = row_mask.to(x.dtype)
    return (per_row * m).sum(-1) / m.sum(-1).clamp_min(1.0)


def euler_sample(velocity_fn: VelocityFn, obs: Obs, eps: torch.Tensor, steps: int,
                 time_grid: str = "left", clip_intermediate: bool = False) -> torch.Tensor:
    """Integrate the flow from ``x_0 = eps`` [B, Ta, Da] to tau = 1 with ``steps`` Euler steps:
    ``x_{k+1} = x_k + v(x_k, tau_k | o) / K`` with ``tau_k = k / K`` (``time_grid`` "left") or
    ``k / (K - 1)`` ("linspace", the ReFlow release's grid). ``clip_intermediate``: clamp every
    x_{k+1} to [-1, 1] (the release's default). Returns [B, Ta, Da] (the last step unclipped)."""
    if time_grid not in TIME_GRIDS:
        raise ValueError(f"time grid must be one of {TIME_GRIDS}, got {time_grid!r}")
    x, dt = eps, 1.0 / steps
    grid = torch.linspace(0.0, 1.0, steps, dtype=x.dtype) if time_grid == "linspace" else None
    for k in range(steps):
        t = k * dt if grid is None else grid[k].item()
        tau = torch.full((x.shape[0],), t, dtype=x.dtype, device=x.device)
        x = x + dt * velocity_fn(x, tau, obs)
        if clip_intermediate and k < steps - 1:
            x = x.clamp(-1.0, 1.0)
    return x


def sinusoidal_embedding(tau: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """tau [B] in [0, 1] -> [B, dim]: sin/cos at geometric frequencies (the transformer
    embedding, with tau scaled by 1000 so that neighbouring Euler steps differ)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=tau.dtype, device=tau.device) / half)
    angles = 1000.0 * tau[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def diffuser_time_embedding(tau: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """tau [B] in [0, 1] -> [B, dim]: the ReinFlow / ReFlow FlowMLP's time features (Diffuser's
    SinusoidalPosEmb): [sin(tau f_k), cos(tau f_k)] with f_k = exp(-ln(max_period) k / (half - 1)),
    k = 0 .. half - 1, on tau itself (not scaled)."""
    half = dim // 2
    if half < 2:
        raise ValueError(f"the reinflow time embedding needs time_dim >= 4, got {dim}")
    freqs = torch.exp(torch.arange(half, dtype=tau.dtype, device=tau.device) * (-math.log(max_period) / (half - 1)))
    angles = tau[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class VelocityMLP(nn.Module):
    """v(x, tau | cond): an MLP on [flattened chunk, time embedding, condition] (DPPO's and
    ReinFlow's FlowMLP shape). x [B, Ta, Da], tau [B], cond [B, C] -> [B, Ta, Da].

    The time embedding is sin/cos features (``time_embedding``, see :data:`TIME_EMBEDDINGS`)
    through Linear(time_dim, 2 time_dim), Mish, Linear(2 time_dim, time_dim); the body is a plain
    or residual MLP (``velocity_mlp``, :data:`VELOCITY_MLPS`) with ``activation`` between layers."""

    def __init__(self, cond_dim: int, horizon_steps: int, action_dim: int, hidden_sizes: list[int],
                 time_dim: int = 32, activation: str = "mish", time_embedding: str = "flowrl",
                 velocity_mlp: str = "plain"):
        super().__init__()
        if time_embedding not in TIME_EMBEDDINGS:
            raise ValueError(f"time embedding must be one of {TIME_EMBEDDINGS}, got {time_embedding!r}")
        if velocity_mlp not in VELOCITY_MLPS:
            raise ValueError(f"velocity MLP must be one of {VELOCITY_MLPS}, got {velocity_mlp!r}")
        self.horizon_steps, self.action_dim, self.time_dim = horizon_steps, action_dim, time_dim
        self.time_embedding = time_embedding
        self.time_mlp = nn.Sequential(nn.Linear(time_dim, 2 * time_dim), nn.Mish(),
                                      nn.Linear(2 * time_dim, time_dim))
        chunk = horizon_steps * action_dim
        sizes = [chunk + time_dim + cond_dim, *hidden_sizes, chunk]
        body = mlp if velocity_mlp == "plain" else ResidualMLP
        self.net = body(sizes, activation, out_gain=0.01)

    def time_features(self, tau: torch.Tensor) -> torch.Tensor:
        """tau [B] -> the time MLP's input [B, time_dim]."""
        if self.time_embedding == "reinflow":
            return diffuser_time_embedding(tau, self.time_dim)
        return sinusoidal_embedding(tau, self.time_dim)

    def forward(self, x: torch.Tensor, tau: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        temb = self.time_mlp(self.time_features(tau))                               # [B, time_dim]
        out = self.net(torch.cat([x.flatten(1), temb, cond], dim=-1))              # [B, Ta * Da]
        return out.view(x.shape)


def random_shift(images: torch.Tensor, pad: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """DrQ's augmentation: replicate-pad by ``pad`` pixels and crop back at a random integer
    offset per image. images [B, C, H, W] float -> same shape."""
    b, _, h, w = images.shape
    padded = F.pad(images, (pad, pad, pad, pad), mode="replicate")
    shifts = torch.randint(0, 2 * pad + 1, (b, 2), generator=generator).to(images.device)
    rows = (torch.arange(h, device=images.device)[None] + shifts[:, :1])       # [B, H]
    cols = (torch.arange(w, device=images.device)[None] + shifts[:, 1:])       # [B, W]
    batch = torch.arange(b, device=images.device)[:, None, None]
    # gather [B, C, H, W]: index rows then columns of each image
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2)


class ImageEncoder(nn.Module):
    """A small conv encoder (DrQ-v2's): uint8 RGB [B, C, H, W] -> features [B, feature_dim].
    Random-shift augmentation when ``augment`` is on (training only)."""

    def __init__(self, in_channels: int, image_size: int, feature_dim: int = 64, channels: int = 32):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, stride=2), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=2), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, stride=1), nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, in_channels, image_size, image_size)).shape[-1]
        self.head = nn.Sequential(nn.Linear(flat, feature_dim), nn.LayerNorm(feature_dim), nn.Tanh())

    def forward(self, rgb: torch.Tensor, augment: bool = False) -> torch.Tensor:
        x = rgb.float() / 255.0 - 0.5
        if augment:
            x = random_shift(x)
        return self.head(self.conv(x))


class ObsEncoder(nn.Module):
    """Observation -> condition vector: the state itself, or [state, image features]."""

    def __init__(self, state_dim: int, image_shape: tuple[int, int, int] | None = None,
                 feature_dim: int = 64):
        super().__init__()
        self.image = ImageEncoder(image_shape[0], image_shape[1], feature_dim) if image_shape else None
        self.out_dim = state_dim + (feature_dim if image_shape else 0)

    def forward(self, obs: Obs, augment: bool = False) -> torch.Tensor:
        if self.image is None:
            return obs["state"] if isinstance(obs, dict) else obs
        return torch.cat([obs["state"], self.image(obs["rgb"], augment)], dim=-1)


class FlowPolicy(nn.Module):
    """A flow-matching action-chunk policy pi(a | o): an observation encoder and a velocity MLP.

    ``act`` samples with K Euler steps from ``eps ~ N(0, I)`` (training) or from ``eps = 0``
    (``deterministic``: FPO++'s zero-sampling), clips to [-1, 1] and, when sampling for
    training, draws ``n_mc`` pairs (tau_i, eps_i) and records their CFM losses under the
    sampling weights (FPO++'s "old" losses, computed once).

    ``time_embedding``, ``velocity_mlp``, ``velocity_activation``: the velocity network's
    architecture options (:class:`VelocityMLP`; defaults :data:`FLOW_ARCH_DEFAULTS`);
    ``time_grid`` and ``clip_intermediate``: the sampler's (:func:`euler_sample`).
    """

    def __init__(self, state_dim: int, action_dim: int, horizon_steps: int, hidden_sizes: list[int],
                 time_dim: int = 32, flow_steps: int = 10, n_mc: int = 8,
                 image_shape: tuple[int, int, int] | None = None, feature_dim: int = 64,
                 cfm_huber_delta: float = 0.0, cfm_reduction: str = "mean_dims",
                 record_old_losses: bool = True, time_embedding: str = "flowrl",
                 velocity_mlp: str = "plain", velocity_activation: str = "mish",
                 time_grid: str = "left", clip_intermediate: bool = False):
        super().__init__()
        self.action_dim, self.horizon_steps = action_dim, horizon_steps
        self.flow_steps, self.n_mc = flow_steps, n_mc
        if time_grid not in TIME_GRIDS:
            raise ValueError(f"time grid must be one of {TIME_GRIDS}, got {time_grid!r}")
        self.time_grid, self.clip_intermediate = time_grid, clip_intermediate
        # the error of the recorded and the recomputed CFM losses (0: squared; behaviour cloning
        # always uses the squared error)
        self.cfm_huber_delta = cfm_huber_delta
        # how a chunk's errors reduce to one loss (see CFM_REDUCTIONS; behaviour cloning always sums)
        if cfm_reduction not in CFM_REDUCTIONS:
            raise ValueError(f"CFM reduction must be one of {CFM_REDUCTIONS}, got {cfm_reduction!r}")
        self.cfm_reduction = cfm_reduction
        # False: act() records the (tau, eps) pairs but not their losses (a learner that holds the
        # sampling weights computes them itself, on the images its update sees)
        self.record_old_losses = record_old_losses
        self.encoder = ObsEncoder(state_dim, image_shape, feature_dim)
        self.velocity = VelocityMLP(self.encoder.out_dim, horizon_steps, action_dim, hidden_sizes, time_dim,
                                    velocity_activation, time_embedding, velocity_mlp)

    @property
    def chunk_shape(self) -> tuple[int, int]:
        return self.horizon_steps, self.action_dim

    def sample(self, obs: Obs, eps: torch.Tensor, steps: int | None = None) -> torch.Tensor:
        """Actions [B, Ta, Da] in [-1, 1] from initial noise eps [B, Ta, Da]."""
        cond = self.encoder(obs)
        x = euler_sample(self.velocity, cond, eps, steps or self.flow_steps, self.time_grid, self.clip_intermediate)
        return x.clamp(-1.0, 1.0)

    def cfm_losses(self, obs: Obs, actions: torch.Tensor, taus: torch.Tensor, eps: torch.Tensor,
                   augment: bool = False, huber_delta: float | None = None, reduction: str | None = None,
                   row_mask: torch.Tensor | None = None, per_row: bool = False) -> torch.Tensor:
        """[B, N] per-sample CFM losses (see :func:`cfm_losses`; ``huber_delta`` and ``reduction``
        default to the policy's, ``row_mask`` [B, Ta] to every row; ``per_row``: [B, N, Ta]); the
        observation is encoded once per row, not once per Monte Carlo sample."""
        delta = self.cfm_huber_delta if huber_delta is None else huber_delta
        return cfm_losses(self.velocity, self.encoder(obs, augment), actions, taus, eps, delta,
                          reduction or self.cfm_reduction, row_mask, per_row)

    def bc_loss(self, obs: Obs, actions: torch.Tensor, generator: torch.Generator | None = None,
                augment: bool = False) -> torch.Tensor:
        """Behaviour cloning: the CFM loss of one (tau ~ U[0, 1], eps ~ N(0, I)) pair per
        demonstration chunk, averaged over the chunk, action and batch dims (the summed reduction
        divided by Ta * Da, whatever the policy's FPO++ reduction: bases keep their loss)."""
        b = actions.shape[0]
        taus = torch.rand(b, 1, generator=generator).to(actions.device)
        eps = torch.randn(b, 1, *actions.shape[1:], generator=generator).to(actions.device)
        return self.cfm_losses(obs, actions, taus, eps, augment, huber_delta=0.0,
                               reduction="sum").mean() / (actions[0].numel())

    @torch.no_grad()
    def act(self, obs: Obs, deterministic: bool = False,
            generator: torch.Generator | None = None,
            record: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """obs [N, ...] -> (action chunk [N, Ta, Da] in [-1, 1], record). The record holds
        ``actions``; when sampling for training also ``taus`` [N, M], ``mc_eps`` [N, M, Ta, Da]
        and, with ``record_old_losses``, ``cfm_old`` [N, M, Ta] (M = n_mc): each row's loss,
        summed over the rows the env executes once that is known (:func:`sum_rows`).
        ``record=False`` (evaluation) draws no Monte Carlo pairs: the generator then gives only
        the action noise, so an evaluation's noise does not depend on ``n_mc``."""
        n = obs_batch_size(obs)
        shape = (n, *self.chunk_shape)
        if deterministic:
            eps = torch.zeros(shape)
        else:
            eps = randn(shape, generator)
        actions = self.sample(obs, eps)
        out = {"actions": actions}
        if record and not deterministic and self.n_mc > 0:
            taus = torch.rand(n, self.n_mc, generator=generator)
            mc_eps = torch.randn(n, self.n_mc, *self.chunk_shape, generator=generator)
            out.update(taus=taus, mc_eps=mc_eps)
            if self.record_old_losses:
                out["cfm_old"] = self.cfm_losses(obs, actions, taus, mc_eps, per_row=True)
        return actions, out


class ValueMLP(nn.Module):
    """V(o) for the flow policies' critics: its own observation encoder and an MLP -> [B]."""

    def __init__(self, state_dim: int, hidden_sizes: list[int],
                 image_shape: tuple[int, int, int] | None = None, feature_dim: int = 64):
        super().__init__()
        self.encoder = ObsEncoder(state_dim, image_shape, feature_dim)
        self.net = mlp([self.encoder.out_dim, *hidden_sizes, 1], "mish", out_gain=1.0)

    def forward(self, obs: Obs, augment: bool = False) -> torch.Tensor:
        return self.net(self.encoder(obs, augment)).squeeze(-1)
