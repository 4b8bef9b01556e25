"""E(n)-equivariant graph network (Satorras et al. 2021) in the form EDM uses for QM9.

Dense and batched: a batch of molecules is ``x [B, N, 3]`` (coordinates), ``h [B, N, F]``
(invariant node features) and ``node_mask [B, N]`` (True on real atoms, False on padding). The
graph is fully connected inside each molecule without self-loops:

    edge_mask[b, i, j] = node_mask[b, i] * node_mask[b, j] * (i != j)

so padding never sends or receives a message. Pair tensors are ``[B, N, N, ...]`` with i the
receiving node (EDM's ``row``) and j the sender (``col``). No Python loop over molecules or atoms.

One equivariant block (EDM's ``EquivariantBlock`` with ``inv_sublayers`` GCLs), with
``d_ij = ||x_i - x_j||^2`` and ``d0_ij`` the same at the network's input (EDM's extra edge
attribute), ``e_ij = [d_ij, d0_ij]``:

    m_ij  = phi_e(h_i, h_j, e_ij)                  (Linear, SiLU, Linear, SiLU)
    m_ij <- m_ij * sigmoid(W_a m_ij)               (attention)
    h_i  <- h_i + phi_h(h_i, sum_j edge_mask_ij m_ij / Z)            (residual)
    x_i  <- x_i + sum_j edge_mask_ij (x_i - x_j) / (sqrt(d_ij + 1e-8) + c)
                       * tanh(phi_x(h_i, h_j, e_ij)) * coords_range / Z

Z = ``normalization_factor`` (sum aggregation), c = ``norm_constant``. EDM hands every block the
full ``coords_range`` (its ``coords_range / n_layers`` is computed but unused); so do we. With
``sin_embedding`` (EDM's option of that name) each of d and d0 enters as sin and cos of the distance
``sqrt(d + 1e-8)`` at the frequencies ``2 pi 4^k / 15``, k = 0..5 (a wavelength of 15 Å down to
15/1024 Å), so ``e_ij`` has 24 channels instead of 2; the embedding has no parameters. The last
linear of phi_x has no bias and a tiny init (xavier, gain 1e-3) so the network starts near the
identity on x. Because the updates depend on x only through differences and distances, x_out is
E(n)-equivariant (rotations, reflections, translations) and h_out invariant.

Cost: the first Linear of phi_e / phi_x on ``[h_i, h_j, e_ij]`` is split as
``W_i h_i + W_j h_j + W_e e_ij + b`` (the same function and parameters as the concatenation), so
only the hidden x hidden layers run on the ``B * N^2`` pairs; the masked sums over j are batched
matmuls, and without autograd the pair activations are applied in place (on CPU, allocating a
fresh ``[B, N, N, H]`` buffer costs more than the op). Memory: a few ``4 B N^2 H`` bytes per
block without grad (55 MB each at B = 64, N = 29, H = 256); with grad, ~8 such per block are kept.

:class:`EGNNDynamics` is EDM's ``EGNN_dynamics_QM9``: node features are the noisy
``z_h [B, N, F]`` (the one-hot atom type, and with EDM's charges channel the charge: F = K or K + 1)
concatenated with the diffusion time ``t/T``; it returns
``(eps_x, eps_h)`` concatenated as ``[B, N, 3 + F]`` with ``eps_x = x_out - x_in`` projected to
zero centre of mass over the real nodes and the time channel sliced off ``eps_h``. Non-finite
outputs are not reset (EDM zeroes the whole batch): they flow per molecule, to be gated downstream.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


def remove_mean(x: Tensor, node_mask: Tensor) -> Tensor:
    """``x [B, N, 3]`` minus its mean over the real nodes; padding rows set to exactly 0.

    Padding is selected with ``where`` (not multiplied) so NaN/inf there cannot leak."""
    m = node_mask.to(torch.bool).unsqueeze(-1)                        # [B, N, 1]
    x = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    n = m.sum(1, keepdim=True).clamp(min=1).to(x.dtype)               # [B, 1, 1]
    mean = x.sum(1, keepdim=True) / n
    return torch.where(m, x - mean, torch.zeros((), dtype=x.dtype, device=x.device))


def edge_mask_of(node_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``[B, N]`` -> ``[B, N, N]`` of 0/1 in ``dtype``: both ends real and i != j."""
    m = node_mask.to(torch.bool)
    eye = torch.eye(m.shape[1], dtype=torch.bool, device=m.device)
    return (m[:, :, None] & m[:, None, :] & ~eye).to(dtype)


def pair_linear(lin: nn.Linear, h: Tensor, e: Tensor) -> Tensor:
    """``lin(cat[h_i, h_j, e_ij])`` for all pairs without building the concatenation.

    h ``[B, N, H]``, e ``[B, N, N, E]`` -> ``[B, N, N, out]``: one broadcast add of the per-node
    halves, then the edge part accumulated in place (autograd-safe: add keeps no output)."""
    B, N, H = h.shape
    w, out = lin.weight, lin.out_features                              # w: [out, 2H + E]
    hi = torch.addmm(lin.bias, h.reshape(-1, H), w[:, :H].T).view(B, N, 1, out)    # receiver
    hj = (h.reshape(-1, H) @ w[:, H:2 * H].T).view(B, 1, N, out)                   # sender
    pair = hi + hj
    pair.view(-1, out).addmm_(e.reshape(-1, e.shape[-1]), w[:, 2 * H:].T)
    return pair


def silu(x: Tensor) -> Tensor:
    """SiLU, in place when no graph is recorded (sampling): a fresh ``[B, N, N, H]`` buffer costs
    more than the activation itself on CPU."""
    return F.silu(x, inplace=not (torch.is_grad_enabled() and x.requires_grad))


def aggregate(w: Tensor, v: Tensor) -> Tensor:
    """``sum_j w_ij v_ij``: w ``[B, N, N]``, v ``[B, N, N, F]`` -> ``[B, N, F]`` (a batched matmul)."""
    return (w.unsqueeze(2) @ v).squeeze(2)


#: sin_embedding's frequencies (rad/Å): 2 pi 4^k / 15 for k = 0..5, i.e. int(log_4(2000)) + 1 of them
DISTANCE_FREQUENCIES = tuple(2 * math.pi * 4 ** k / 15.0 for k in range(int(math.log(2000, 4)) + 1))


def distance_features(radial: Tensor, sin_embedding: bool) -> Tensor:
    """Edge features of squared distances ``radial [B, N, N, 1]``: the squared distance itself, or
    with ``sin_embedding`` ``[sin(w_k r), cos(w_k r)]`` of ``r = sqrt(radial + 1e-8)`` at
    :data:`DISTANCE_FREQUENCIES` -> ``[B, N, N, 12]`` (constant features: no gradient flows through)."""
    if not sin_embedding:
        return radial
    w = torch.tensor(DISTANCE_FREQUENCIES, dtype=radial.dtype, device=radial.device)
    angle = torch.sqrt(radial + 1e-8) * w                                      # [B, N, N, 6]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).detach()


def coord_differences(x: Tensor, norm_constant: float) -> tuple[Tensor, Tensor]:
    """``x [B, N, 3]`` -> squared distances ``[B, N, N, 1]`` and normalised
    ``(x_i - x_j) / (||x_i - x_j|| + c)`` ``[B, N, N, 3]`` (EDM's ``coord2diff``)."""
    diff = x[:, :, None] - x[:, None]
    radial = (diff ** 2).sum(-1, keepdim=True)
    return radial, diff / (torch.sqrt(radial + 1e-8) + norm_constant)


class GCL(nn.Module):
    """Invariant message-passing layer on h (with attention)."""

    def __init__(self, hidden: int, edge_dim: int, attention: bool, normalization_factor: float):
        super().__init__()
        self.edge_in = nn.Linear(2 * hidden + edge_dim, hidden)
        self.edge_out = nn.Linear(hidden, hidden)
        self.att = nn.Linear(hidden, 1) if attention else None
        self.node_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.normalization_factor = normalization_factor

    def forward(self, h: Tensor, e: Tensor, edge_mask: Tensor, node_mask: Tensor) -> Tensor:
        m = silu(self.edge_out(silu(pair_linear(self.edge_in, h, e))))        # [B, N, N, H]
        w = edge_mask if self.att is None else torch.sigmoid(self.att(m)).squeeze(-1) * edge_mask
        agg = aggregate(w, m) / self.normalization_factor                      # [B, N, H]
        h = h + self.node_mlp(torch.cat([h, agg], dim=-1))
        return h * node_mask[..., None]


class EquivariantUpdate(nn.Module):
    """The coordinate update: x_i += sum_j (x_i - x_j)/(|.|+c) * phi_x(h_i, h_j, e_ij)."""

    def __init__(self, hidden: int, edge_dim: int, tanh: bool, coords_range: float,
                 normalization_factor: float):
        super().__init__()
        self.inp = nn.Linear(2 * hidden + edge_dim, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 1, bias=False)
        nn.init.xavier_uniform_(self.out.weight, gain=0.001)
        self.tanh, self.coords_range = tanh, coords_range
        self.normalization_factor = normalization_factor

    def forward(self, h: Tensor, x: Tensor, diff: Tensor, e: Tensor, edge_mask: Tensor,
                node_mask: Tensor) -> Tensor:
        phi = self.out(silu(self.mid(silu(pair_linear(self.inp, h, e))))).squeeze(-1)   # [B, N, N]
        if self.tanh:
            phi = torch.tanh(phi) * self.coords_range
        x = x + aggregate(phi * edge_mask, diff) / self.normalization_factor
        return x * node_mask[..., None]


class EquivariantBlock(nn.Module):
    def __init__(self, hidden: int, inv_sublayers: int, attention: bool, tanh: bool,
                 coords_range: float, norm_constant: float, normalization_factor: float,
                 sin_embedding: bool = False):
        super().__init__()
        edge_dim = 2 * (2 * len(DISTANCE_FREQUENCIES) if sin_embedding else 1)
        self.gcls = nn.ModuleList(GCL(hidden, edge_dim, attention, normalization_factor)
                                  for _ in range(inv_sublayers))
        self.update = EquivariantUpdate(hidden, edge_dim, tanh, coords_range, normalization_factor)
        self.norm_constant, self.sin_embedding = norm_constant, sin_embedding

    def forward(self, h, x, d0, edge_mask, node_mask):
        """``d0 [B, N, N, E/2]``: the input distances' features (:func:`distance_features`)."""
        radial, diff = coord_differences(x, self.norm_constant)
        e = torch.cat([distance_features(radial, self.sin_embedding), d0], dim=-1)   # [B, N, N, E]
        for gcl in self.gcls:
            h = gcl(h, e, edge_mask, node_mask)
        x = self.update(h, x, diff, e, edge_mask, node_mask)
        return h * node_mask[..., None], x


class EGNN(nn.Module):
    """``(h [B,N,F_in], x [B,N,3], node_mask [B,N]) -> (h_out [B,N,F_out], x_out [B,N,3])``."""

    def __init__(self, in_nf: int, out_nf: int, hidden: int = 64, num_layers: int = 4,
                 attention: bool = True, tanh: bool = True, coords_range: float = 15.0,
                 norm_constant: float = 1.0, normalization_factor: float = 1.0,
                 inv_sublayers: int = 1, sin_embedding: bool = False):
        super().__init__()
        self.embedding = nn.Linear(in_nf, hidden)
        self.blocks = nn.ModuleList(
            EquivariantBlock(hidden, inv_sublayers, attention, tanh, coords_range, norm_constant,
                             normalization_factor, sin_embedding) for _ in range(num_layers))
        self.embedding_out = nn.Linear(hidden, out_nf)
        self.sin_embedding = sin_embedding

    def forward(self, h: Tensor, x: Tensor, node_mask: Tensor) -> tuple[Tensor, Tensor]:
        mask = node_mask.to(h.dtype)
        edge_mask = edge_mask_of(node_mask, h.dtype)
        d0 = distance_features(coord_differences(x, 1.0)[0], self.sin_embedding)   # the input d_ij^2
        h = self.embedding(h)
        for block in self.blocks:
            h, x = block(h, x, d0, edge_mask, mask)
        return self.embedding_out(h) * mask[..., None], x


class EGNNDynamics(nn.Module):
    """EDM's noise predictor: ``(z_t [B, N, 3+F], t [B] in [0, 1], node_mask) -> eps [B, N, 3+F]``.

    Input node features are ``[z_h, t]`` (F + 1), the output h has F + 1 channels of which the
    time channel is dropped (as in EDM). Padding inputs are ignored (selected away, not multiplied)."""

    def __init__(self, node_features: int, hidden: int = 64, num_layers: int = 4,
                 attention: bool = True, tanh: bool = True, coords_range: float = 15.0,
                 norm_constant: float = 1.0, normalization_factor: float = 1.0,
                 inv_sublayers: int = 1, sin_embedding: bool = False):
        super().__init__()
        self.node_features = node_features
        self.egnn = EGNN(node_features + 1, node_features + 1, hidden, num_layers, attention, tanh,
                         coords_range, norm_constant, normalization_factor, inv_sublayers, sin_embedding)

    def forward(self, z: Tensor, t: Tensor, node_mask: Tensor) -> Tensor:
        B, N, _ = z.shape
        m = node_mask.to(torch.bool)
        z = torch.where(m[..., None], z, torch.zeros((), dtype=z.dtype, device=z.device))
        x, h = z[..., :3], z[..., 3:]
        t = torch.as_tensor(t, dtype=z.dtype, device=z.device).reshape(-1)
        h_time = t.expand(B)[:, None, None].expand(B, N, 1) * m[..., None].to(z.dtype)
        h_out, x_out = self.egnn(torch.cat([h, h_time], dim=-1), x, m)
        eps_x = remove_mean(x_out - x, m)                                      # zero CoM
        return torch.cat([eps_x, h_out[..., :-1]], dim=-1)
