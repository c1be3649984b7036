"""The memory-aware expander: a tiered store of prefixes (device, host, disk).

Entry points: ``prefix_store.PrefixStore`` (asynchronous lookups, single-flight loads and
computations), over ``placement`` (the synchronous core: tiers, leases, demotion, spill),
``device_tier`` (the device's entries in the pages the store owns, ``kv_pages``),
``tiers`` (host and disk tiers: ``blob_files``, one file per prefix, and a RocksDB index),
``staging`` (disk reads headed to a CUDA device), ``tier_costs`` (whether a tier beats
recomputing), ``kv_formats`` and ``kv_codec`` (the cold formats and their byte layout). It knows
the prefix type and its pages and nothing else of the model, and nothing of the engine.
"""
