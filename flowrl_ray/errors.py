"""Errors shared between the runtime and the CLI (importable without Ray)."""


class TrainingError(RuntimeError):
    """The run cannot go on: a restart budget is spent, or no batch arrived at all."""
