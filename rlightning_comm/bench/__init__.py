"""``rlightning-comm bench``: nccl-tests-style timing of every collective, against raw torch.distributed in the same
run."""

from rlightning_comm.bench.cli import main

__all__ = ["main"]
