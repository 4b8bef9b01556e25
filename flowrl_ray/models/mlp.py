"""MLP builder and a running observation normaliser, shared by every vector-observation policy."""

from __future__ import annotations

import math

import torch
from torch import nn

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "mish": nn.Mish,
               "elu": nn.ELU, "gelu": nn.GELU, "silu": nn.SiLU, "softplus": nn.Softplus}


def mlp(sizes: list[int], activation: str = "tanh", out_gain: float = 1.0) -> nn.Sequential:
    """Linear layers with `activation` between them (none after the last), orthogonal init
    (gain sqrt(2) hidden, `out_gain` output, zero biases), as in the PPO implementation details."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        last = i == len(sizes) - 2
        linear = nn.Linear(sizes[i], sizes[i + 1])
        nn.init.orthogonal_(linear.weight, gain=out_gain if last else math.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class ResidualBlock(nn.Module):
    """A pre-activation residual pair of layers: x + fc2(act(fc1(act(x)))). [B, H] -> [B, H]."""

    def __init__(self, width: int, activation: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        self.act = ACTIVATIONS[activation]()
        for linear in (self.fc1, self.fc2):
            nn.init.orthogonal_(linear.weight, gain=math.sqrt(2))
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.act(x))))


class ResidualMLP(nn.Module):
    """The residual MLP of IBC / d3il (ReinFlow's and DPPO's ``residual_style`` networks):

        h = first(x);  h = block_j(h) for each block (:class:`ResidualBlock`);  y = last(h)

    ``sizes`` = [in, H, H, .., H, out] with an odd number of equal hidden widths: the first H is
    the input layer's, each further pair of H's one block ((len(hidden) - 1) / 2 blocks). There is
    no activation between the last block and the output layer (the blocks pre-activate).
    Orthogonal init as :func:`mlp` (gain sqrt(2) hidden, ``out_gain`` output, zero biases)."""

    def __init__(self, sizes: list[int], activation: str = "mish", out_gain: float = 1.0):
        super().__init__()
        hidden = sizes[1:-1]
        if not hidden or len(hidden) % 2 == 0 or len(set(hidden)) != 1:
            raise ValueError(f"a residual MLP needs an odd number of equal hidden sizes, got {hidden}")
        width = hidden[0]
        self.first = nn.Linear(sizes[0], width)
        self.blocks = nn.ModuleList(ResidualBlock(width, activation) for _ in range((len(hidden) - 1) // 2))
        self.last = nn.Linear(width, sizes[-1])
        for linear, gain in ((self.first, math.sqrt(2)), (self.last, out_gain)):
            nn.init.orthogonal_(linear.weight, gain=gain)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        for block in self.blocks:
            h = block(h)
        return self.last(h)


class RunningNorm(nn.Module):
    """Running mean/variance of observations; its buffers travel with the policy's weights, so
    every rollout worker normalises with the statistics of the version it acts with."""

    def __init__(self, dim: int, enabled: bool = True, clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.enabled, self.clip, self.eps = enabled, clip, eps
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(dim, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(0.0, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Merge the moments of `x` [B, D] (Chan et al.'s parallel update)."""
        if not self.enabled or x.shape[0] == 0:
            return
        x = x.to(torch.float64)
        b_mean, b_var, b_count = x.mean(0), x.var(0, unbiased=False), float(x.shape[0])
        total = self.count + b_count
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * b_count + delta.pow(2) * self.count * b_count / total
        self.mean.add_(delta * b_count / total)
        self.var.copy_(m2 / total)
        self.count.fill_(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled or self.count.item() == 0:
            return x
        y = (x - self.mean.to(x.dtype)) / torch.sqrt(self.var.to(x.dtype) + self.eps)
        return y.clamp(-self.clip, self.clip)
