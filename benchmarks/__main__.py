"""`python -m benchmarks`: the benchmark runner (benchmarks/runner.py)."""
import os
import sys

# The benchmarks import each other as modules of this folder (results_dir, report, suites).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from runner import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
