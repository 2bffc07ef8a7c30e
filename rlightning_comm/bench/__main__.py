"""``python -m rlightning_comm.bench [ARGS]``: the same as ``rlightning-comm bench [ARGS]``."""

from rlightning_comm.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m rlightning_comm.bench"))
