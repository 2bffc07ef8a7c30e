"""The commands the examples' docstrings show, as the tests run them, so a docstring cannot show a command no test runs.

An example's module docstring shows its commands on indented lines that start with ``python`` or ``torchrun`` (a
trailing ``# comment`` is not part of the command), to be run from the repository root with the package installed: one
command without a launcher and at most one under torchrun. :func:`documented` returns one of them as an argument list
for ``subprocess``: ``python`` is this interpreter, ``torchrun`` is ``python -m torch.distributed.run --standalone`` (a
free port instead of torchrun's fixed default). Tests append arguments to shorten a run (``--steps 3``), never change
the ones shown.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def commands(example: str) -> list[str]:
    """The commands in the module docstring of ``examples/<example>``, in order."""
    doc = ast.get_docstring(ast.parse((EXAMPLES / example).read_text())) or ""
    found = []
    for line in doc.splitlines():
        if line.startswith("    ") and line.split(maxsplit=1)[0] in ("python", "torchrun"):
            found.append(line.split(" #", 1)[0].strip())
    return found


def documented(example: str, launcher: bool = False, *extra: str) -> list[str]:
    """The argument list of the example's command without a launcher (or under torchrun), plus ``extra``.

    Raises:
        AssertionError: the docstring does not show exactly one such command.
    """
    shown = [c for c in commands(example) if c.startswith("torchrun ") == launcher]
    assert len(shown) == 1, (
        f"examples/{example}: its docstring shows {shown} {'under torchrun' if launcher else 'without a launcher'}; "
        "expected one command"
    )
    words = shown[0].split()
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone"] if launcher else [sys.executable]
    return [*head, *words[1:], *extra]


def environment() -> dict[str, str]:
    """This process's environment as a user's shell would have it: the package importable, no launcher variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env
