"""GPU check: one bounded command that verifies the NCCL paths on a CUDA machine and writes a JSON report of every cell.

    python benchmarks/gpu_check --out gpu-out          # then read gpu-out/gpu_check.json
    python benchmarks/gpu_check --cpu-only --out cpu-out

Run by path from any folder, the library not installed (the folder's ``__main__.py`` puts its checkout first on
``sys.path``; only the library's dependencies are needed); ``python -m benchmarks.gpu_check`` does the same from the
checkout's root.

Steps, each guarded (a failure, a hang or a crash is recorded and the next step still runs; every process has a deadline
and is killed with its process group), all within ``--budget-s`` (a step that no longer fits is skipped with "no time
left"):

1. ``nccl_world1`` (about 30 s): NCCL at world size 1: what every process-group call returns with ``asyncOp=False``,
   then every op x dtype x sync/async x plain/stats/debug mode against an oracle; then ``bounded_wait=True``.
2. ``cuda_tests`` (1 to 3 min): the suite's CUDA tests (pytest, per-test outcomes).
3. ``nccl_ranks`` (1 to 3 min): 2 NCCL ranks on the one GPU (a distinct ``NCCL_HOSTID`` each, sockets on loopback): a 20
   s raw smoke test first, then the matrix with non-zero roots, gradients, groups, a call one rank skips (default and
   ``bounded_wait=True``), a connected mode and a kill.
4. ``cuda_branches`` (about 1 min): the NCCL-only Python branches on 4 gloo ranks with CUDA tensors (a test-only
   communicator staging on ``cuda:0``).
5. ``bench``: ``rlightning-comm bench`` with whatever time is left.

Without CUDA (or with ``--cpu-only``) every CUDA step is skipped with the reason "no CUDA", and steps 1, 3 and 4 run
their machinery on gloo with CPU tensors as a self-test. Exit status 1 when a step failed (a wrong result, an error, a
crash or hang, a documented claim contradicted), else 0.

Modules: ``_cli`` (the command and its report), ``_steps`` (each step's
launches and verdict), ``_launch`` (bounded processes, killed by process group), ``_rank`` (one rank's program, run as
``python -m benchmarks.gpu_check._rank``), ``_cells`` (a rank's record, lockstep), ``_matrix``, ``_ops`` and ``_case``
(the op matrix, its ops, inputs and oracles), ``_probes`` (what the matrix does not cover), ``_comms`` (test-only
communicators), ``_pytest_plugin`` (the CUDA tests step's selection).
"""
