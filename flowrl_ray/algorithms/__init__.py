"""Algorithms: one module each, plus shared pieces (advantages, losses). Pure torch."""

from __future__ import annotations


def get_algorithm(name: str) -> type:
    """The Algorithm class for a config's ``algorithm`` key."""
    if name == "ppo":
        from flowrl_ray.algorithms.ppo import PPO
        return PPO
    raise KeyError(f"unknown algorithm {name!r}")
