"""The package's layers (docs/architecture.md): every module imports only its own layer and the
ones below, inside functions and under ``if TYPE_CHECKING:`` too (a model that needs an env's
shapes says so with a protocol of its own, not by importing the env)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "flowrl_ray"

#: the top-level module or sub-package -> its layer, lowest first (docs/architecture.md)
LAYERS = [("errors", "utils", "batch", "stats", "optim", "video"),
          ("registry", "config", "checkpoint", "metrics", "progress", "plotting", "resume"),
          ("models",), ("envs",), ("algorithms",), ("pretrain",), ("runtime",), ("cli",)]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def upward_imports(path: Path, rank: int) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [m for m in names if m.startswith("flowrl_ray.") and RANK[m.split(".")[1]] > rank]
    return found


def test_every_module_is_placed_in_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").is_file())}
    assert tops == set(RANK), f"not placed: {tops - set(RANK)}; gone: {set(RANK) - tops}"


def test_no_module_imports_a_layer_above_its_own():
    upward = {}
    for path in PACKAGE.rglob("*.py"):
        top = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if top != "__init__" and (bad := upward_imports(path, RANK[top])):
            upward[str(path.relative_to(PACKAGE))] = bad
    assert not upward, upward


def test_an_upward_import_is_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flowrl_ray.envs import EnvSpec\n"
                      "def f():\n    from flowrl_ray.runtime.trainer import Trainer\n    import flowrl_ray.cli\n")
    assert upward_imports(module, RANK["models"]) == ["flowrl_ray.envs", "flowrl_ray.runtime.trainer", "flowrl_ray.cli"]
