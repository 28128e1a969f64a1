"""`python -m jax_ops.bench`: the jax-ops-bench command line (jax_ops/bench/cli.py)."""
import sys

from jax_ops.bench.cli import main

sys.exit(main())
