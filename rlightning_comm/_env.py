"""Reading the launcher's environment variables (torchrun, RLightning's Ray actors): one place, one error style."""

from __future__ import annotations

import os

from rlightning_comm.errors import CommError

DEBUG_ENV = "RLIGHTNING_COMM_DEBUG"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_debug() -> bool:
    """Whether ``RLIGHTNING_COMM_DEBUG`` switches debug mode on.

    Raises:
        ValueError: the variable holds something other than a boolean word.
    """
    value = os.environ.get(DEBUG_ENV, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(
            f"environment variable {DEBUG_ENV} must be one of {list(_TRUE + _FALSE)}; got {os.environ[DEBUG_ENV]!r}"
        )
    return value in _TRUE


def parse_int(name: str, raw: str) -> int:
    """``raw``, the value of environment variable ``name``, as an int.

    Raises:
        ValueError: ``raw`` is not an integer.
    """
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer; got {raw!r}") from None


def argument_from_env(name: str, argument: str) -> int:
    """The int in environment variable ``name``, standing in for the omitted ``argument``.

    Raises:
        ValueError: the variable is not set, or not an integer.
    """
    raw = os.environ.get(name)
    if raw is None:
        raise ValueError(
            f"{argument} was not given and the environment variable {name} is not set; pass {argument}= or launch with "
            "torchrun"
        )
    return parse_int(name, raw)


def launcher_int(name: str, caller: str) -> int:
    """The int the launcher put in environment variable ``name`` (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), read by
    ``caller``.

    Raises:
        CommError: the variable is not set (this process was not started by a launcher that sets it).
        ValueError: the variable is not an integer.
    """
    raw = os.environ.get(name)
    if raw is None:
        raise CommError(
            f"{caller} reads the environment variable {name}, which is not set in this process; "
            f"launch with torchrun, or set {name} before calling it (RLightning's init_distributed_env sets it on each "
            "actor)"
        )
    return parse_int(name, raw)
