"""Writes docs/grafana/epd.json: a Grafana dashboard over epd's /metrics (Prometheus data
source chosen at import; the panels are in scripts/benchkit/dashboard.py). Run after changing
the panels:

    .venv/bin/python scripts/grafana_dashboard.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchkit.dashboard import render

OUT = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "epd.json"


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
