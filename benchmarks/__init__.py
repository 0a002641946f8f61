"""trtserve's benchmarks, run from the repository's root as modules (benchmarks/common/__init__.py)."""
