"""Equivariant diffusion model (EDM, Hoogeboom et al. 2022) for QM9-style molecules, as a policy.

State and data (EDM's notation): a molecule of n real atoms among N padded slots is
``z = [z_x, z_h]`` ``[B, N, D]`` with D = 3 + K (+ 1 with ``include_charges``): positions x in Å
(EDM's norm_values[0] = 1), the one-hot atom type divided by ``atom_type_scale`` (norm_values[1] =
4) and, with EDM's charges channel, the atom's charge divided by ``charge_scale`` (norm_values[2] =
10). In EDM's QM9 the charge is the atomic number, so it is a function of the type
(``atom_charges[type]``: H 1, C 6, N 7, O 8, F 9); the network denoises and predicts it like every
other channel, and decoding reads the type from the one-hot part only (EDM rounds the charge
channel for its output files; its stability and validity checks, like ours, use the types).
x lives in the zero centre-of-mass (CoM) subspace of the real atoms; padding is exactly 0.

Schedule (``polynomial_2`` with clipping and precision s), for t = 0..T:

    alpha^2_t = (1 - 2s) * clip(1 - (t'/(T+1))^p)^2) + s     t' = t (T+1)/T  (EDM's linspace)
    gamma_t = -(log alpha_t^2 - log sigma_t^2),  alpha_t^2 = sigmoid(-gamma_t),  sigma_t^2 = sigmoid(gamma_t)

where "clip" bounds each ratio alpha^2_t / alpha^2_{t-1} below by 1e-3 (``clip_noise_schedule``).

Forward process and l2 loss: t ~ U{0..T}, eps = [eps_x (zero CoM), eps_h],
``z_t = alpha_t [x, h] + sigma_t eps`` and ``L = ||eps - eps_hat(z_t, t/T)||^2 / (n D)``
(mean over the real atoms' dims; EDM divides by D * N_padded, a batch constant, which would make
the loss depend on how a batch is trimmed).

Reverse step p(z_s | z_t), s = t - 1 (EDM's ``sample_p_zs_given_zt``, ``sigma_and_alpha_t_given_s``):

    alpha_{t|s} = alpha_t / alpha_s
    sigma^2_{t|s} = 1 - alpha^2_{t|s} = -expm1(softplus(gamma_s) - softplus(gamma_t))
    mu    = z_t / alpha_{t|s} - sigma^2_{t|s} / (alpha_{t|s} sigma_t) * eps_hat(z_t, t)
    sigma = sigma_{t|s} sigma_s / sigma_t
    z_s   = mu + sigma * eps'          (eps' with its x part projected to zero CoM)

Final decode p(x, h | z_0) (``sample_p_xh_given_z0``), returned as its mean for x:
``x = (z0_x - sigma_0 eps_hat_x(z0, 0)) / alpha_0``, ``type = argmax z0_h[:K]`` (the argmax of the
unscaled one-hot; scaling does not change it; the charge channel is not read). The predicted clean state at step t is
``(z_t - sigma_t eps_hat) / alpha_t`` (``x0_predictions``; t = 0 gives exactly ``decode``).

Transition log-density (what PPO/GRPO ratios are made of), over the real nodes only, with the x
part a Gaussian on the 3(n-1)-dimensional zero-CoM subspace (EDM's ``subspace_dimensionality``):

    log p(z_s | z_t) = -||z_s - mu||^2 / (2 sigma^2) - d (log sigma + log(2 pi)/2),   d = 3(n-1) + n(D-3)

KL between two such transitions with the same sigma (policy vs reference):
``||mu - mu_ref||^2 / (2 sigma^2)`` summed over the real dims (:func:`reference_kl`).

Non-finite values are not trapped: a NaN network output flows into that molecule's z (other rows
are untouched), and decode marks such a molecule by atom type -1 on every node (positions stay
NaN); reward code must gate on ``torch.isfinite(positions)``.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from flowrl_ray.checkpoint import load_base_checkpoint
from flowrl_ray.config import ConfigError, check
from flowrl_ray.models.egnn import EGNNDynamics, remove_mean
from flowrl_ray.optim import ema_update, optimizer_step

__all__ = ["EDMModelConfig", "check_model_config", "remove_mean", "NoiseSchedule", "NodeDistribution", "SampleResult",
           "EDM", "transition_log_prob", "step_log_prob", "reference_kl", "fit_edm", "load_base_model",
           "check_base_model", "model_of_base", "to_numpy_molecules"]


@dataclass
class EDMModelConfig:
    """``algo.model.*`` of the molecule algorithms. Defaults are small; EDM's QM9 values in comments."""
    num_layers: int = field(default=4, metadata=check(gt=0))            # EGNN blocks (QM9: 9)
    hidden_size: int = field(default=64, metadata=check(gt=0))          # (QM9: 256)
    diffusion_steps: int = field(default=100, metadata=check(gt=0))     # T (QM9: 1000)
    noise_precision: float = field(default=1e-5, metadata=check(gt=0, lt=0.5))
    schedule_power: float = field(default=2.0, metadata=check(gt=0))    # polynomial_2
    max_atoms: int = field(default=29, metadata=check(gt=0))            # N, padded size of samples
    num_atom_types: int = field(default=5, metadata=check(gt=0))        # K: H C N O F (chemistry.ATOM_TYPES)
    atom_type_scale: float = field(default=4.0, metadata=check(gt=0))   # norm_values[1]
    attention: bool = True
    tanh: bool = True
    coords_range: float = field(default=15.0, metadata=check(gt=0))
    norm_constant: float = field(default=1.0, metadata=check(ge=0))
    aggregation_factor: float = field(default=1.0, metadata=check(gt=0))  # EDM normalization_factor
    inv_sublayers: int = field(default=1, metadata=check(gt=0))         # invariant GCLs per block (QM9: 1)
    sin_embedding: bool = False                                         # distances as sin/cos features
    include_charges: bool = False                                       # EDM's charges channel (QM9: true)
    charge_scale: float = field(default=10.0, metadata=check(gt=0))     # norm_values[2]
    atom_charges: list = field(default_factory=lambda: [1, 6, 7, 8, 9])  # charge of each type: H C N O F's Z


def check_model_config(cfg: EDMModelConfig, prefix: str = "algo.model.") -> None:
    """Constraints between ``algo.model`` keys; ConfigError naming the key."""
    charges = cfg.atom_charges
    if cfg.include_charges and (len(charges) != cfg.num_atom_types or not all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) for c in charges)):
        raise ConfigError(f"config key '{prefix}atom_charges': the charges channel needs one number per atom type "
                          f"({prefix}num_atom_types={cfg.num_atom_types}), got {charges!r}")


class NoiseSchedule:
    """EDM's predefined polynomial schedule; ``gamma [T+1]`` float64 on the CPU, t integer in 0..T."""

    def __init__(self, steps: int, power: float, precision: float):
        self.T = int(steps)
        n = self.T + 1
        u = np.linspace(0, n, n) / n                                   # EDM's grid (ends at 1)
        a2 = (1.0 - u ** power) ** 2
        ratio = a2 / np.concatenate([[1.0], a2[:-1]])                  # alpha^2_t / alpha^2_{t-1}
        a2 = np.cumprod(np.clip(ratio, 1e-3, 1.0))                     # clip_noise_schedule
        a2 = (1.0 - 2.0 * precision) * a2 + precision
        self.gamma = torch.from_numpy(np.log1p(-a2) - np.log(a2))      # [T+1], increasing

    def _at(self, t, sign: float):
        if isinstance(t, Tensor):
            return torch.sqrt(torch.sigmoid(sign * self.gamma[t.long().cpu()])).to(t.device)
        return math.sqrt(float(torch.sigmoid(sign * self.gamma[int(t)])))

    def alpha(self, t):
        """alpha_t: a float for an int t, a float64 tensor shaped like a LongTensor t."""
        return self._at(t, -1.0)

    def sigma(self, t):
        return self._at(t, 1.0)

    def transition(self, t: int) -> tuple[float, float]:
        """(alpha_{t|s}, sigma_{t|s}) for s = t - 1, computed from gamma as EDM does."""
        gs, gt = self.gamma[int(t) - 1], self.gamma[int(t)]
        sigma2 = -torch.expm1(F.softplus(gs) - F.softplus(gt))
        alpha = torch.exp(0.5 * (F.logsigmoid(-gt) - F.logsigmoid(-gs)))
        return float(alpha), math.sqrt(float(sigma2))


class NodeDistribution:
    """Number of atoms n ~ histogram (index n = count of molecules with n atoms)."""

    def __init__(self, histogram: np.ndarray):
        p = torch.as_tensor(np.asarray(histogram, dtype=np.float64))
        if p.ndim != 1 or (p < 0).any() or p.sum() <= 0 or p[0] != 0:
            raise ValueError("histogram must be 1-D, non-negative, with mass and none at 0 atoms")
        self.probs = p / p.sum()

    def sample(self, k: int, generator: Optional[torch.Generator] = None) -> Tensor:
        return torch.multinomial(self.probs, k, replacement=True, generator=generator)


@dataclass
class SampleResult:
    positions: Tensor            # [B, N, 3] Å, zero CoM, 0 on padding
    atom_types: Tensor           # [B, N] long, -1 on padding (and on every node of a NaN molecule)
    node_mask: Tensor            # [B, N] bool
    trajectory: dict             # z [K+1,B,N,D], mu [K,B,N,D], t [K], logp [K,B], sigma [K], node_mask [B,N]
    x0_predictions: dict         # t -> (positions [B,N,3], atom_types [B,N])


def _masked(z: Tensor, node_mask: Tensor) -> Tensor:
    """x part to zero CoM, h part 0 on padding: the projection onto EDM's state space."""
    node_mask = node_mask.to(torch.bool)
    h = torch.where(node_mask[..., None], z[..., 3:], torch.zeros((), dtype=z.dtype, device=z.device))
    return torch.cat([remove_mean(z[..., :3], node_mask), h], dim=-1)


class EDM(nn.Module):
    def __init__(self, cfg: EDMModelConfig):
        super().__init__()
        check_model_config(cfg)
        self.cfg = cfg
        self.schedule = NoiseSchedule(cfg.diffusion_steps, cfg.schedule_power, cfg.noise_precision)
        self.dynamics = EGNNDynamics(self.D - 3, cfg.hidden_size, cfg.num_layers, cfg.attention,
                                     cfg.tanh, cfg.coords_range, cfg.norm_constant, cfg.aggregation_factor,
                                     cfg.inv_sublayers, cfg.sin_embedding)

    T = property(lambda self: self.cfg.diffusion_steps)
    D = property(lambda self: 3 + self.cfg.num_atom_types + int(self.cfg.include_charges))
    device = property(lambda self: next(self.parameters()).device)
    dtype = property(lambda self: next(self.parameters()).dtype)

    def noise(self, node_mask: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
        """eps ``[B, N, D]`` ~ N(0, I) on the state space; drawn on the generator's device."""
        dev = generator.device if generator is not None else node_mask.device
        eps = torch.randn((*node_mask.shape, self.D), generator=generator, device=dev, dtype=self.dtype)
        return _masked(eps.to(node_mask.device), node_mask)

    def encode(self, positions: Tensor, atom_types: Tensor, node_mask: Tensor) -> Tensor:
        """Data -> ``[x, h]`` ``[B, N, D]`` (x centred, h = one-hot / atom_type_scale, then with the
        charges channel the type's charge / charge_scale)."""
        types = atom_types.long().clamp(min=0)                                          # [B, N]
        parts = [positions.to(self.dtype), F.one_hot(types, self.cfg.num_atom_types).to(self.dtype)
                 / self.cfg.atom_type_scale]
        if self.cfg.include_charges:
            charges = torch.tensor(self.cfg.atom_charges, dtype=self.dtype, device=types.device)
            parts.append(charges[types][..., None] / self.cfg.charge_scale)             # [B, N, 1]
        return _masked(torch.cat(parts, -1), node_mask)

    def training_loss(self, positions, atom_types, node_mask, generator=None) -> Tensor:
        m = node_mask.to(torch.bool)
        xh = self.encode(positions, atom_types, m)
        B = xh.shape[0]
        dev = generator.device if generator is not None else xh.device
        t = torch.randint(0, self.T + 1, (B,), generator=generator, device=dev).to(xh.device)
        a = self.schedule.alpha(t).to(xh.dtype)[:, None, None]
        s = self.schedule.sigma(t).to(xh.dtype)[:, None, None]
        eps = self.noise(m, generator)
        eps_hat = self.predict_eps(a * xh + s * eps, t, m)
        err = torch.where(m[..., None], (eps - eps_hat) ** 2, torch.zeros((), dtype=xh.dtype,
                                                                          device=xh.device))
        return err.sum((1, 2)) / (m.sum(1) * self.D).to(xh.dtype)          # [B]

    def predict_eps(self, z_t: Tensor, t, node_mask: Tensor) -> Tensor:
        """eps_hat ``[B, N, D]``; the network sees the time as t / T."""
        if isinstance(t, Tensor) and t.dim() > 0:
            tt = t.to(z_t.dtype) / self.T
        else:
            tt = torch.full((z_t.shape[0],), float(t) / self.T, dtype=z_t.dtype, device=z_t.device)
        return self.dynamics(z_t, tt, node_mask.to(torch.bool))

    def _reverse(self, z_t: Tensor, t: int, node_mask: Tensor) -> tuple[Tensor, float, Tensor]:
        a_ts, s_ts = self.schedule.transition(t)
        s_t, s_s = self.schedule.sigma(t), self.schedule.sigma(t - 1)
        eps = self.predict_eps(z_t, t, node_mask)
        mu = z_t / a_ts - (s_ts ** 2 / (a_ts * s_t)) * eps
        return _masked(mu, node_mask.to(torch.bool)), s_ts * s_s / s_t, eps

    def reverse_mean_std(self, z_t: Tensor, t: int, node_mask: Tensor) -> tuple[Tensor, float]:
        """Mean ``[B, N, D]`` (x part zero CoM) and std of p(z_{t-1} | z_t), t in 1..T."""
        if not 1 <= int(t) <= self.T:
            raise ValueError(f"t must be in 1..{self.T}, got {t}")
        mu, sigma, _ = self._reverse(z_t, int(t), node_mask)
        return mu, sigma

    def _types(self, h: Tensor, x: Tensor, node_mask: Tensor) -> Tensor:
        """argmax of the one-hot part of h ``[B, N, D-3]`` (not the charge), -1 on padding and on
        every node of a molecule with non-finite x or h."""
        bad = ~(torch.isfinite(x).flatten(1).all(1) & torch.isfinite(h).flatten(1).all(1))   # [B]
        keep = node_mask & ~bad[:, None]
        types = h[..., :self.cfg.num_atom_types].argmax(-1)
        return torch.where(keep, types, torch.full_like(keep, -1, dtype=torch.long))

    def _predicted_clean(self, z_t: Tensor, eps: Tensor, t: int, node_mask: Tensor):
        z0 = (z_t - self.schedule.sigma(t) * eps) / self.schedule.alpha(t)
        x = remove_mean(z0[..., :3], node_mask)
        return x, self._types(z0[..., 3:], x, node_mask)

    def decode(self, z0: Tensor, node_mask: Tensor) -> tuple[Tensor, Tensor]:
        """p(x, h | z0): positions ``[B, N, 3]`` (mean of x), atom types ``[B, N]`` (-1 padding)."""
        m = node_mask.to(torch.bool)
        eps = self.predict_eps(z0, 0, m)
        x = remove_mean((z0[..., :3] - self.schedule.sigma(0) * eps[..., :3]) / self.schedule.alpha(0), m)
        return x, self._types(z0[..., 3:], x, m)

    @torch.no_grad()
    def sample(self, n_atoms: Tensor, generator: Optional[torch.Generator] = None, group_size: int = 1,
               shared_prefix_steps: int = 0, x0_steps: Sequence[int] = ()) -> SampleResult:
        """Ancestral sampling of B = len(n_atoms) molecules, padded to the largest, N = max(n_atoms)
        (the network's cost grows with N^2 per molecule, so padding to max_atoms would waste it).

        Rows come in consecutive groups of ``group_size`` with equal n_atoms. z_T is drawn per
        group (P = B / group_size chains), the first S = ``shared_prefix_steps`` steps run on the
        P chains, then each chain is repeated to its group's rows and the remaining K = T - S steps
        use independent noise per row; only those are recorded (shared steps carry no
        group-relative signal). With S = 0 group members share z_T only. Trajectory memory:
        4 (2K+1) B N D bytes for z and the behaviour means mu in float32, ~180 MB at K = 1000,
        B = 96, N = 29, D = 8.
        """
        T, G, S = self.T, int(group_size), int(shared_prefix_steps)
        n_atoms = torch.as_tensor(n_atoms, dtype=torch.long, device=self.device).reshape(-1)
        B, N = n_atoms.numel(), int(n_atoms.max()) if n_atoms.numel() else 0
        if G < 1 or B % G or not 0 <= S <= T:
            raise ValueError(f"need B % group_size == 0 and 0 <= shared_prefix_steps <= T; got B={B}, "
                             f"group_size={G}, shared_prefix_steps={S}, T={T}")
        if (n_atoms < 1).any() or N > self.cfg.max_atoms or (n_atoms.view(-1, G) != n_atoms[::G, None]).any():
            raise ValueError(f"n_atoms must be in 1..max_atoms={self.cfg.max_atoms} and equal within each group")
        steps = {int(s) for s in x0_steps}
        if any(not 0 <= s <= T for s in steps):
            raise ValueError(f"x0_steps must lie in 0..{T}, got {sorted(steps)}")
        node_mask = torch.arange(N, device=self.device)[None] < n_atoms[:, None]       # [B, N]
        K = T - S
        zs = torch.empty((K + 1, B, N, self.D), dtype=self.dtype, device=self.device)
        mus = torch.empty((K, B, N, self.D), dtype=self.dtype, device=self.device)
        logp = torch.empty((K, B), dtype=self.dtype, device=self.device)
        sig = torch.empty(K, dtype=torch.float64)
        x0: dict = {}
        mask = node_mask[::G]
        z = self.noise(mask, generator)                                                   # z_T [P, N, D]
        for t in range(T, 0, -1):
            if t == K:                                                    # branch: P -> B rows
                z, mask = z.repeat_interleave(G, 0), node_mask
            mu, sigma, eps = self._reverse(z, t, mask)
            if t in steps:
                x, h = self._predicted_clean(z, eps, t, mask)
                x0[t] = (x, h) if t <= K else (x.repeat_interleave(G, 0), h.repeat_interleave(G, 0))
            z_next = mu + sigma * self.noise(mask, generator)
            if t <= K:
                k = K - t
                zs[k], mus[k], sig[k] = z, mu, sigma
                logp[k] = transition_log_prob(z_next, mu, sigma, mask)
            z = z_next
        if K == 0:
            z = z.repeat_interleave(G, 0)
        zs[K] = z
        positions, types = self.decode(z, node_mask)
        if 0 in steps:
            x0[0] = (positions, types)
        traj = {"z": zs, "mu": mus, "t": torch.arange(K, 0, -1, device=self.device), "logp": logp,
                "sigma": sig.to(self.device, self.dtype), "node_mask": node_mask}
        return SampleResult(positions, types, node_mask, traj, x0)


def transition_log_prob(z_prev: Tensor, mu: Tensor, sigma, node_mask: Tensor) -> Tensor:
    """log N(z_prev; mu, sigma^2 I) ``[B]`` on EDM's state space (see the module docstring).

    The x difference is projected to zero CoM (a no-op for states from :meth:`EDM.sample`) and its
    squared norm equals that of its coordinates in any orthonormal basis of the subspace; the
    normaliser counts d = 3(n-1) + n(D-3) dimensions: ``-d (log sigma + 0.5 log 2 pi)``.
    ``sigma``: a float or a tensor ``[B]``."""
    m = node_mask.to(torch.bool)
    diff = _masked(z_prev - mu, m)
    sq = (diff ** 2).sum((1, 2))
    n = m.sum(1).to(diff.dtype)
    dof = 3 * (n - 1) + n * (diff.shape[-1] - 3)
    sigma = torch.as_tensor(sigma, dtype=diff.dtype, device=diff.device).reshape(-1)
    return -0.5 * sq / sigma ** 2 - dof * (torch.log(sigma) + 0.5 * math.log(2 * math.pi))


def step_log_prob(model: EDM, z_t: Tensor, z_prev: Tensor, t: int,
                  node_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(log p_theta(z_prev | z_t) ``[B]``, mu ``[B, N, D]``) with gradients, for the PPO ratio and
    :func:`reference_kl`. Bitwise equal to the behaviour logp for the same weights and batch."""
    mu, sigma = model.reverse_mean_std(z_t, t, node_mask)
    return transition_log_prob(z_prev, mu, sigma, node_mask), mu


def reference_kl(mu: Tensor, mu_ref: Tensor, sigma, node_mask: Tensor) -> Tensor:
    """KL(p || p_ref) ``[B]`` of two transitions sharing sigma: ``||mu - mu_ref||^2 / (2 sigma^2)``."""
    diff = _masked(mu - mu_ref, node_mask.to(torch.bool))
    sigma = torch.as_tensor(sigma, dtype=diff.dtype, device=diff.device).reshape(-1)
    return (diff ** 2).sum((1, 2)) / (2 * sigma ** 2)


def fit_edm(model: EDM, positions, atom_types, *, steps: int, batch_size: int, lr: float = 1e-4,
            ema_decay: float = 0.999, generator: Optional[torch.Generator] = None, log_every: int = 50,
            progress: Optional[Callable[[int, int, float], None]] = None, state: Optional[dict] = None) -> dict:
    """Train on ``positions [M, N, 3]`` / ``atom_types [M, N]`` (-1 padding) with EDM's recipe.

    AdamW (amsgrad, weight decay 1e-12, as EDM's ``get_optim``), EDM's adaptive gradient clipping
    (max norm = 1.5 mean + 2 std of the last 50 norms, seeded with 3000), random batches trimmed
    to their largest molecule (its last real slot), an EMA of the weights (``ema_decay`` 0/None:
    none). A step whose gradient norm is not finite is skipped. Every ``log_every`` steps
    ``progress(step, last step, mean recent loss)`` is called (printed when None), steps counted
    from the run's start. ``state``, the ``"state"`` an earlier call returned (with the model's raw
    weights as that call left them), continues that run: optimiser moments, EMA, the clipping
    window and the step count; ``steps`` more steps are taken. Returns ``{"loss_history": [one
    float per step of this call], "ema_state_dict": state_dict or None, "skipped_steps": int,
    "state": {"optimizer", "ema", "norms", "step"}}``; the model keeps its raw (non-EMA) weights."""
    pos = torch.as_tensor(np.asarray(positions)) if not isinstance(positions, Tensor) else positions
    types = torch.as_tensor(np.asarray(atom_types)) if not isinstance(atom_types, Tensor) else atom_types
    pos, types = pos.detach().to("cpu", model.dtype), types.detach().cpu().long()
    real = types >= 0
    extent = (real * torch.arange(1, real.shape[1] + 1)).amax(1)      # 1 + index of the last real atom
    opt = torch.optim.AdamW(model.parameters(), lr=lr, amsgrad=True, weight_decay=1e-12)
    ema = ({k: v.detach().clone() for k, v in model.state_dict().items()} if ema_decay else None)
    norms: deque = deque([3000.0], maxlen=50)
    first = 0                                                          # steps taken before this call
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        for group in opt.param_groups:                                 # this call's learning rate
            group["lr"] = lr
        if ema is not None and state.get("ema") is not None:
            ema = {k: v.detach().clone().to(model.device) for k, v in state["ema"].items()}
        norms = deque(state["norms"], maxlen=50)
        first = int(state["step"])
    history: list[float] = []
    skipped = 0
    was_training = model.training
    model.train()
    dev = generator.device if generator is not None else torch.device("cpu")
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(pos), (batch_size,), generator=generator, device=dev).cpu()
        nmax = int(extent[idx].max())                                  # trim the batch's padding
        b_types = types[idx, :nmax].to(model.device)
        loss = model.training_loss(pos[idx, :nmax].to(model.device), b_types, b_types >= 0, generator).mean()
        max_norm = 1.5 * float(np.mean(norms)) + 2 * float(np.std(norms))   # EDM's adaptive clip
        (gn,), stepped = optimizer_step(loss, opt, max_norm)       # a non-finite step: skipped
        if not stepped:
            skipped += 1
        else:
            norms.append(min(gn, max_norm))
            if ema is not None:
                ema_update(ema, model.state_dict(), ema_decay)
        history.append(float(loss.detach()))
        if step % log_every == 0 or step == steps:
            recent = float(np.mean(history[-log_every:]))
            if progress is not None:
                progress(first + step, first + steps, recent)
            else:
                print(f"fit_edm step {first + step}/{first + steps} loss {recent:.4f}", file=sys.stdout, flush=True)
    model.train(was_training)
    return {"loss_history": history, "ema_state_dict": ema, "skipped_steps": skipped,
            "state": {"optimizer": opt.state_dict(), "ema": ema, "norms": list(norms), "step": first + steps}}


# ---------------------------------------------------------------------- checkpoints and molecules

def load_base_model(path: str | Path) -> dict:
    """A `flowrl-ray pretrain` EDM checkpoint: {"model_config", "state_dict", "node_histogram", ...}."""
    return load_base_checkpoint(path, "algo.base_model", ("state_dict", "model_config"),
                                "an EDM pretraining checkpoint", "make it with `flowrl-ray pretrain CONFIG`")


def check_base_model(cfg, path: str | Path | None = None) -> None:
    """The base model's (``path``, default ``algo.base_model``) architecture must be the config's
    (``cfg.algo.model``, an :class:`EDMModelConfig`); ConfigError naming the key."""
    path = cfg.algo.base_model if path is None else path
    if path is None:
        return
    # a key newer than the checkpoint: its default, which keeps the behaviour from before the key
    saved = {**asdict(EDMModelConfig()), **load_base_model(path)["model_config"]}
    mine = asdict(cfg.algo.model)
    for key, value in saved.items():
        if key in mine and mine[key] != value:
            raise ConfigError(f"config key 'algo.model.{key}': {mine[key]!r} does not match the base "
                              f"model's {value!r} ({path})")


def model_of_base(ckpt: dict) -> EDM:
    """The EDM of a base checkpoint (:func:`load_base_model`'s dict) with its own architecture and
    weights, on the CPU in float32 (a checkpoint from before a key of EDMModelConfig: its default)."""
    model = EDM(EDMModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["state_dict"])
    return model


def to_numpy_molecules(positions: torch.Tensor, atom_types: torch.Tensor,
                        node_mask: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray]]:
    """[B, N, 3], [B, N], [B, N] -> B molecules (positions [n, 3] float64 in Å, types [n] int)."""
    pos, types, mask = positions.detach().cpu().double().numpy(), atom_types.cpu().numpy(), node_mask.cpu().numpy()
    return [(pos[i][mask[i]], types[i][mask[i]].astype(np.int64)) for i in range(len(pos))]
