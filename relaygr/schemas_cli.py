"""Export the public contract as JSON Schema files, for producers and consumers in any language.

`relaygr schemas export --out DIR` writes one draft 2020-12 JSON Schema per public event:
behaviours and requests (what a producer may publish), results and dead letters (what a consumer
reads). File names carry the schema version (`behavior.v1.schema.json`); each schema names its
topic (`x-kafka-topic`, with the deployment's prefix as `<prefix>`) and message key
(`x-kafka-key`), and holds an example message. Needs no broker.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from relaygr.schemas.events import SCHEMA_VERSION
from relaygr.schemas.json_schema import PUBLIC_EVENTS, export_schemas


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (__doc__ or "").strip()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("action", choices=["export"], help="export: write the JSON Schema files")
    parser.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="folder to write the files into (created)"
    )


def run(args: argparse.Namespace) -> int:
    written = export_schemas(args.out)
    print(f"schema_version {SCHEMA_VERSION}: {len(written)} schemas in {args.out}")
    for path, (role, event_type) in zip(written, PUBLIC_EVENTS.items(), strict=True):
        print(f"  {path.name:32s} {event_type.__name__:22s} ({role})")
    return 0
