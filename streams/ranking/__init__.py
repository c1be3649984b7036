"""The ranking worker: the stage that owns a partition's signals and requests, and its device.

Entry points: ``ranking_worker.RankingWorker`` (the Kafka shell: its loop, bounded queue, offsets,
commits, rebalances, dead letters and stats; ``run_worker``), ``rank_handler.RankHandler`` (a
signal's pre-inference and a request's ranking, without Kafka), ``history_applier`` (routed
behaviours into the history table), and the gap-free replacement of a worker: ``standby`` and
``rank_rebalance``, which talk to the worker through ``worker_port.WorkerPort``, and
``worker_files`` (the folder the two processes share).
"""
