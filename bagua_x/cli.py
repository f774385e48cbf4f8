"""The ``bagua-x`` command: ``demo`` times every algorithm to a target accuracy on a slow link; ``bench`` measures speed;
``cluster`` runs a script on several network-namespace "nodes" of this machine joined by capped links."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="bagua-x", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from .apps import bench, cluster, demo

    demo.add_arguments(sub.add_parser(
        "demo", help="loss against wall-clock time for every algorithm, on a 1 Gbit/s 2-node cluster as root"))
    bench.add_arguments(sub.add_parser(
        "bench", help="time the algorithms against DDP and pmean (loopback, a capped link or a cluster); ratios"))
    cluster.add_arguments(sub.add_parser(
        "cluster", help="run a script on N nodes (network namespaces, capped inter-node links) x P ranks; root only",
        description=cluster.__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    if args.command == "cluster":
        return cluster.main(args)
    if args.command == "bench":
        return bench.main(args)
    return demo.main(args)


if __name__ == "__main__":
    sys.exit(main())
