"""Algorithms: one module each, plus shared pieces (advantages, losses). Pure torch.

A config's ``algorithm`` key names a built-in algorithm or a plugin class as
``"package.module:Class"`` (importable on every Ray node, e.g. shipped with the job's working_dir),
a subclass of one of the two kinds in :mod:`flowrl_ray.algorithms.base`.
"""

from flowrl_ray.registry import BUILTIN_ALGORITHMS, get_algorithm

__all__ = ["BUILTIN_ALGORITHMS", "get_algorithm"]
