"""Read the results topic: look one request's result up, or watch the results as they come.

  relaygr results get REQUEST_ID [--wait S]
      The results topic read as a table (it is compacted by request_id): prints the result kept
      for REQUEST_ID as JSON and exits 0, or exits 1 when there is none. A request ranked twice
      (at-least-once delivery) shows its last result. --wait S keeps watching S seconds for a
      result that has not come yet.

  relaygr results tail [-n N] [--from WHEN] [--follow] [--json]
      Prints the last N results (default 10), oldest first, one line each: when it was produced,
      request, user, path, latency, worker and the top items. --from WHEN starts at `earliest`,
      `latest`, epoch seconds or an ISO date-time instead of the last N. --follow keeps printing
      new results until Ctrl-C. --json prints each result as one JSON line instead.

Topics are those of RELAYGR_TOPIC_PREFIX on the configured broker.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from datetime import datetime

from relaygr.client import (
    ClientError,
    ResultRecord,
    StartAt,
    lookup_result,
    open_results,
    read_results,
    seek_results,
)
from relaygr.infra.local.broker import BrokerError
from relaygr.infra.settings import Settings, get_settings
from relaygr.schemas import TopicRegistry, encode
from relaygr.tools.args import int_at_least

TOP_ITEMS_SHOWN = 5


def start_at(text: str) -> StartAt:
    """An argparse type: `earliest`, `latest`, epoch seconds, or an ISO date-time (local time
    unless it has an offset)."""
    if text in ("earliest", "latest"):
        return text  # type: ignore[return-value]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).astimezone()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not earliest, latest, epoch seconds or an ISO date-time"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (__doc__ or "").strip()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    get = sub.add_parser("get", help="print the result kept for one request id (exit 1: none)")
    get.add_argument("request_id", metavar="REQUEST_ID")
    get.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="when there is no result yet, watch for it this many seconds (default 0)",
    )
    tail = sub.add_parser("tail", help="print the latest results; --follow keeps printing new ones")
    tail.add_argument(
        "-n",
        type=int_at_least(1),
        default=10,
        metavar="N",
        help="how many of the latest results to print first (default 10; ignored with --from)",
    )
    tail.add_argument(
        "--from",
        dest="start",
        type=start_at,
        metavar="WHEN",
        help="start at earliest, latest, epoch seconds or an ISO date-time instead of the last N",
    )
    tail.add_argument("--follow", "-f", action="store_true", help="keep printing new results until Ctrl-C")
    tail.add_argument("--json", action="store_true", help="one JSON object per line instead of columns")


def format_line(record: ResultRecord) -> str:
    r = record.result
    when = datetime.fromtimestamp(record.timestamp_ms / 1000).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    items = " ".join(f"{s.item_id}:{s.score:.3f}" for s in r.items[:TOP_ITEMS_SHOWN])
    more = f" (+{len(r.items) - TOP_ITEMS_SHOWN})" if len(r.items) > TOP_ITEMS_SHOWN else ""
    return (
        f"{when}  {r.request_id}  user={r.user_id}  {r.path.value}  {r.latency_ms:.1f} ms  "
        f"{r.worker_id}  [{items}{more}]"
    )


async def tail(settings: Settings, *, last: int, start: StartAt | None, follow: bool, as_json: bool) -> None:
    topic = TopicRegistry(settings.topic_prefix, settings.partitions).name("results")
    cons, tps = await open_results(settings, topic)

    def show(record: ResultRecord) -> None:
        print(encode(record.result).decode() if as_json else format_line(record), flush=True)

    try:
        if start is None:
            # The last N of each partition hold the last N overall; sorting picks those.
            ends = await cons.end_offsets(tps)
            begins = await cons.beginning_offsets(tps)
            for tp in tps:
                cons.seek(tp, max(begins[tp], ends[tp] - last))
        else:
            await seek_results(cons, tps, start)
        backlog = [r async for r in read_results(cons, tps, until=await cons.end_offsets(tps))]
        backlog.sort(key=lambda r: r.timestamp_ms)
        for record in backlog if start is not None else backlog[-last:]:
            show(record)
        if follow:
            async for record in read_results(cons, tps, until=None):
                show(record)
    finally:
        await cons.stop()


def run(args: argparse.Namespace) -> int:
    settings = get_settings()
    try:
        if args.action == "get":
            found = asyncio.run(lookup_result(settings, args.request_id, wait_s=args.wait))
            if found is None:
                print(f"relaygr results get: no result for request {args.request_id!r}", file=sys.stderr)
                return 1
            print(found.model_dump_json(indent=2))
            return 0
        asyncio.run(tail(settings, last=args.n, start=args.start, follow=args.follow, as_json=args.json))
        return 0
    except (BrokerError, ClientError) as e:
        print(f"relaygr results {args.action}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from failing on exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
