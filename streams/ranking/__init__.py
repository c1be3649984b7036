"""The ranking worker: the stage that owns a partition's signals and requests, and its device.

Modules, one job each:
- ``ranking_worker``: the Kafka shell (consume, dispatch, produce; ``RankingWorker``, ``main``);
- ``rank_handler``: a signal's pre-inference and a request's ranking, without Kafka;
- ``engine_factory``: the engine built from the settings (model, device thread, prefix store);
- ``worker_stats``: what the worker reports of itself (its stats, its gauges);
- ``history_applier``: routed behaviours into the history table;
- ``partitions``: what the worker holds per partition (``offset_tracker``: the offsets in flight);
- ``intake``: which consumer the loop reads from, and the commits through it;
- ``hand_over``: the state machine of rolling restarts and rebalances (``rank_rebalance``: the
  group's listener, passing its rebalances to it);
- ``standby``: the replacement's way through those states; ``standby_warmup``: its cache warmed
  from the active process's; ``worker_files``: the folder the two processes share.
"""
