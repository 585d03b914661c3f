#!/usr/bin/env python3
"""Regenerate the README tables, findings and plots from results/.

    python scripts/report.py            # rewrite README.md and phases/*/README.md blocks, redraw plots
    python scripts/report.py --check    # change nothing; exit 1 if any block is stale

Same as `lab report [--check]`; usable without installing the package.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.cli import main  # noqa: E402

if __name__ == "__main__":
    flags = sys.argv[1:]
    debug = ["--debug"] if "--debug" in flags else []     # a top-level flag of `lab`
    sys.exit(main([*debug, "report", *[f for f in flags if f != "--debug"]]))
