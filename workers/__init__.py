"""relaygr.workers: the accelerator side of a ranking worker. It knows neither Kafka nor the contract.

Subsystems, bottom up (``pyproject.toml``'s import contracts keep them apart):
- ``kv_pages``: the device tier's memory, every layer's keys and values in fixed-address pages:
  the prefix store owns them, the model runner reads and writes prefixes there in place.
- ``prefix_kv``: the baton, a user's events and the per-layer KV cache of their prefix (on the
  device, paged); the one type the model and the prefix store share.
- ``kernels``: HSTU attention behind one entry point, with a PyTorch reference and a Triton kernel.
- ``model``: the HSTU ranker, its pre-inference, relay and full forwards, and device resolution.
- ``store``: the memory-aware expander, a tiered prefix store (device, host, disk) with leases,
  promotion and single-flight loads.
- ``engine``: device scheduling: the ranking engine, the device thread, pacing, calibration and
  the latency model behind the trigger.
- ``training``: training and its data; never imported while serving.
"""
