"""The one home of what differs between torch releases, and of the private torch APIs the library relies on.

Everything version-dependent or private is looked up here once, at import,
so a torch release that moves it fails in one place (and in
``tests/test_compat.py``), not deep inside a collective.
"""

from __future__ import annotations

import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives and deprecated the old names; older releases only have those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_single(output, input, group=..., async_op=...)``: gather equal-sized flat inputs into one output."""
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_single(output, input, op=..., group=..., async_op=...)``: reduce, then keep this rank's slice."""
