"""Errors shared by the config, the algorithms, the runtime and the CLI (importable without Ray
and without any other module of the package)."""


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the offending key."""


class TrainingError(RuntimeError):
    """The run cannot go on: a restart budget is spent, or no batch arrived at all."""


class UserError(Exception):
    """Anything a user of the command line can fix (a bad flag, a missing file); printed as one
    line with exit status 2."""
