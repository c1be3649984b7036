"""Training and its data: never imported while serving.

Entry points: ``train.main`` (``relaygr train``), ``fit`` (the loop) with ``objectives``,
``tuning`` and ``sizing`` (defaults from the log itself), ``quality`` (ranking metrics), and the
interaction logs: ``interactions``, ``movielens``, ``instacart``.
"""
