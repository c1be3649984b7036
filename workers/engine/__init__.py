"""Device scheduling: how a ranking worker spends its device.

Entry points: ``ranker.RankingEngine`` (picks relay, full or cold start for each request; its
pre-inference, loans of priority and background stores of grown prefixes in ``preinference``),
``scheduler`` (the device thread and its priorities), ``pacing`` (device-time slices and what fits
before a deadline), ``calibration`` and ``latency_model`` (the measured costs the trigger and the
sizing read), ``capacity`` (bytes per user), ``cores`` (a CPU standing in for a device).
"""
