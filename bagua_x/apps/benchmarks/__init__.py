"""The scripts ``bagua-x bench`` runs, shipped in the package so that an installed wheel can run them.

Each is also a command of its own: ``python -m bagua_x.apps.benchmarks.torch_vs_ddp --help``.
"""
