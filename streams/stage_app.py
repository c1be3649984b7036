"""A stage's faust app: bound to this deployment's broker, its tables checked against the cluster.

Primitives:
- ``make_app(stage, settings, worker_id)``: a faust app bound to this deployment's broker and
  security settings, RocksDB (rocksdict) table store checked against the cluster (see
  ``table_lineage``) in a folder of this topic prefix's own, web server off (metrics are served
  by ``streams.common.serve_metrics`` on loopback instead). Its topics are replicated as the
  cluster's size says (``relaygr.infra.kafka.replication``); tables pass
  ``app.relaygr_changelog_configs`` (the changelog's min.insync.replicas) as their
  ``extra_topic_configs``.
- ``faust_credentials(settings)``: faust's credentials for this deployment's security settings.
"""

from __future__ import annotations

from typing import Any

from relaygr.infra.local.broker import resolve_bootstrap
from relaygr.infra.settings import Settings, kafka_client_kwargs
from relaygr.streams.state_lineage import deployment_dir


def make_app(stage: str, settings: Settings, worker_id: str, **overrides: Any):
    import faust

    from relaygr.infra.kafka import replication_blocking
    from relaygr.streams import table_lineage

    bootstrap = resolve_bootstrap(settings)
    # The changelogs follow the cluster's replication, as the registry's topics do.
    replication_factor, min_isr = replication_blocking(settings)
    # Per topic prefix: two deployments under one RELAYGR_HOME never share table state.
    datadir = deployment_dir(settings, "stages") / f"{stage}-{worker_id}"
    datadir.mkdir(parents=True, exist_ok=True)
    conf: dict[str, Any] = {
        # faust's aiokafka transport, its commits stamped with the topic id they were read from.
        "broker": [f"{table_lineage.TRANSPORT_SCHEME}://{hp.strip()}" for hp in bootstrap.split(",")],
        # RocksDB tables whose partitions are checked against the cluster before use.
        "store": table_lineage.STORE_URL,
        "datadir": str(datadir),
        "topic_partitions": settings.partitions,
        "topic_replication_factor": replication_factor,
        "web_enabled": False,
        "consumer_auto_offset_reset": "earliest",
        "producer_acks": -1,
        # Outputs of the events in flight together share a produce request (each one a send
        # syscall and a broker request): what dominated a stage's CPU per request.
        "producer_linger_ms": settings.request_linger_ms,
        "processing_guarantee": "at_least_once",
        "table_cleanup_interval": 3600.0,
        "stream_wait_empty": False,
        "consumer_metadata_max_age_ms": settings.metadata_max_age_ms,
        "producer_metadata_max_age_ms": settings.metadata_max_age_ms,
    }
    creds = faust_credentials(settings)
    if creds is not None:
        conf["broker_credentials"] = creds
    conf.update(overrides)
    app = faust.App(f"{settings.topic_prefix}-{stage}", **conf)
    # A table's changelog is as durable as the registry's topics: pass as ``extra_topic_configs``.
    app.relaygr_changelog_configs = {"min.insync.replicas": str(min_isr)}
    table_lineage.attach(app, stage, settings, datadir)
    return app


def faust_credentials(settings: Settings):
    import faust

    kw = kafka_client_kwargs(settings)
    proto = settings.security_protocol
    if proto == "PLAINTEXT":
        return None
    if proto == "SSL":
        return faust.SSLCredentials(kw["ssl_context"])
    return faust.SASLCredentials(
        username=settings.sasl_username,
        password=kw["sasl_plain_password"],
        mechanism=settings.sasl_mechanism,
        ssl_context=kw.get("ssl_context"),
    )
