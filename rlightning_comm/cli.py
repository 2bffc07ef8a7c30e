"""The ``rlightning-comm`` console command: ``rlightning-comm bench [ARGS]``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

_USAGE = """usage: rlightning-comm COMMAND [ARGS]

commands:
  bench    time every collective against raw torch.distributed (nccl-tests style); see rlightning-comm bench --help
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from rlightning_comm.bench.cli import main as bench_main

        return bench_main(rest)
    print(
        f"rlightning-comm: error: unknown command {command!r}; expected one of ['bench']\n\n{_USAGE}",
        file=sys.stderr,
        end="",
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
