"""User-facing commands built on both frontends: ``bagua-x demo`` and ``bagua-x bench``.

Unlike the library, these may print progress bars and draw plots.
"""
