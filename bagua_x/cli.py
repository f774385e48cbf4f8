"""The ``bagua-x`` command: ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bagua-x", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a small classifier with every algorithm, both frontends")
    sub.add_parser("bench", help="run the benchmarks and print ratios")
    args = parser.parse_args(argv)
    print(f"bagua-x {args.command}: not implemented yet (see the open issues)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
