"""The scenario kinds: broker scenarios that each run on fresh pipelines and print JSON lines.

A sweep (``relaygr experiment seq-len|throughput``, ``tools.experiment.kinds``) asks where relay
and baseline stop holding the SLO. A scenario asks what one situation does to a pipeline: Kafka's
hops and the ranking stage side by side, a burst of long histories, a heavy user, returning users,
a rolling restart. Each is a ``runner.Scenario``: the pipelines it needs (``runner.Setup``) and
what it measures on each; ``runner.run_scenario`` does the rest through the harness, the paced
sender and the long-user builder that the sweeps use too (``tools.experiment.harness``,
``tools.sender``, ``tools.long_users``).

``SCENARIOS``: command name -> (module, one-line help); ``relaygr bench <name>`` runs it. Importing
this package imports nothing else (the command line reads it to list the commands).
"""

from __future__ import annotations

SCENARIOS: dict[str, tuple[str, str]] = {
    "pipeline": (
        "relaygr.tools.experiment.scenarios.latency",
        "Kafka hop overhead; relay vs baseline ranking P99 on the broker",
    ),
    "noisy-neighbour": (
        "relaygr.tools.experiment.scenarios.noisy_neighbour",
        "ordinary users' ranking P99 with and without one 60k-event user on the same worker",
    ),
    "ingest": (
        "relaygr.tools.experiment.scenarios.ingest",
        "every stage's ingestion rate for a burst of long histories; request hops during it vs idle",
    ),
    "steady-load": (
        "relaygr.tools.experiment.scenarios.steady_load",
        "returning users at steady rates and in a burst: relay share by visit, pre-inferences "
        "finished and dropped, timeouts and ranking P99, per pre-inference policy",
    ),
    "rolling-restart": (
        "relaygr.tools.experiment.scenarios.rolling_restart",
        "every ranking worker replaced by a warm standby in turn at a steady load: lost, "
        "duplicated, timeouts, relay share and ranking P99 per window",
    ),
}
