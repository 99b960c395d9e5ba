"""Run memfit's fuzz tests with many generated inputs (the suite runs a fixed-seed sample of each).

    python scripts/fuzz.py              # 300 inputs per property (fresh random inputs every run)
    python scripts/fuzz.py -n 2000 -k oom

Every bad input must end in one line on stderr and exit 2; a crash prints the smallest input Hypothesis found.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--examples", type=int, default=300, help="inputs per property (default 300)")
    parser.add_argument("-k", help="only the properties whose name matches (pytest -k)")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests" / "test_fuzz.py")]
    if args.k:
        command += ["-k", args.k]
    env = {**os.environ, "MEMFIT_FUZZ_EXAMPLES": str(args.examples), "OMP_NUM_THREADS": "1"}
    return subprocess.call(command, cwd=root, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
