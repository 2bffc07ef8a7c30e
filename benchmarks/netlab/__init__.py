"""A network lab on one machine: hosts in network namespaces of their own, linked through a bridge by links shaped with
``tc tbf``, to measure weight sync over links slower than loopback (guide: docs/benchmarks.md, "The network lab")."""

from ._calibrate import Calibration, calibrate
from ._lab import Lab
from ._netns import (
    IFNAME,
    PREFIX,
    SUBNET,
    LabError,
    cleanup,
    enter,
    format_rate,
    in_namespace,
    parse_rate,
    unavailable,
)

__all__ = [
    "IFNAME",
    "PREFIX",
    "SUBNET",
    "Calibration",
    "Lab",
    "LabError",
    "calibrate",
    "cleanup",
    "enter",
    "format_rate",
    "in_namespace",
    "parse_rate",
    "unavailable",
]
