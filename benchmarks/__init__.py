"""The benchmark scripts (run by path) and the GPU check (:mod:`benchmarks.gpu_check`).

A regular package, so that ``benchmarks.gpu_check`` imports from this checkout even where another installed distribution
ships a top-level ``benchmarks``.
"""
