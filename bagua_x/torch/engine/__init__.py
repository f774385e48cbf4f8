"""The torch engines: each runs one kind of algorithm on a model's parameters (see :mod:`.interface`).

``interface`` (what the wrapper sees), ``base`` (the bucket lifecycle written
once), the engines ``gradient``, ``weight``, ``momentum`` and ``background``,
and the pieces the backward engines share: ``registration`` (parameters into
buckets), ``ready_counts`` (when a gradient is final, which buckets may go)
and ``ready_order`` (buckets rebuilt in the first backward's order).
"""
