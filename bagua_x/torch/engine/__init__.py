"""The torch engines: each runs one kind of algorithm on a model's parameters (see :mod:`.interface`).

``interface`` (what the wrapper sees), ``base`` (the bucket lifecycle written
once), the engines ``gradient``, ``weight``, ``momentum`` and ``background``,
and the pieces the backward engines share: ``registration`` (parameters into
buckets) and ``ready_order`` (buckets rebuilt in the first backward's order);
when a gradient is final and which buckets may go is core's
(:mod:`bagua_x.core.readiness`).
"""
