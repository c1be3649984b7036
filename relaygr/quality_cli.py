"""Quality of several training runs of one log, pooled user by user: is the whole history worth it?

One run's order between history lengths is decided by a few users (on a log of a few thousand
users, the gaps between lengths are smaller than the spread between seeds). ``relaygr quality
RUN [RUN ...]`` reads the output folders of ``relaygr train`` runs that ranked the same users'
test targets (seeds of one log, with ``test_ranks.npz``): it prints each run's HR@10 by history
length, then the mean over the runs with 95 % intervals and the whole history minus each
truncation, paired: per user, the metric averaged over the runs, then bootstrapped over users
(``relaygr.workers.training.quality.pooled``). Settings in which the runs differ are named, so that a
pooled table of different configurations is not taken for one of seeds.

Primitives: ``read_run`` (a run folder: its ``metrics.json`` and ranks), ``compare`` (the pooled
report, a dict), ``plot`` (``--plot``: the report as a PNG), ``add_arguments`` / ``run`` (the command).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# What a run measured rather than was given: never a difference between configurations.
OUTCOMES = {
    "epochs_run",
    "best_epoch",
    "validation_ndcg_per_epoch",
    "loss_per_epoch",
    "seconds",
    "cpu_seconds",
    "parameters",
    "seed",
}


def read_run(folder: Path) -> tuple[dict[str, Any], list[str], dict]:
    """``metrics.json``, the users ranked and their ranks per history length of one run folder."""
    from relaygr.workers.training.quality import RANKS_FILE, load_ranks

    metrics_path, ranks_path = folder / "metrics.json", folder / RANKS_FILE
    if not metrics_path.is_file():
        raise SystemExit(f"relaygr quality: {folder}: no metrics.json (not a `relaygr train` output folder)")
    if not ranks_path.is_file():
        raise SystemExit(
            f"relaygr quality: {folder}: no {RANKS_FILE} (trained before runs kept their ranks: train it again)"
        )
    try:
        metrics = json.loads(metrics_path.read_text())
        if not isinstance(metrics, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:  # (json's errors are ValueErrors)
        raise SystemExit(f"relaygr quality: {metrics_path}: unreadable: {e}") from e
    try:
        users, ranks = load_ranks(ranks_path)
    except Exception as e:  # a truncated or foreign file: numpy raises several kinds
        raise SystemExit(f"relaygr quality: {ranks_path}: unreadable ({type(e).__name__}: {e})") from e
    return metrics, users, ranks


def _same(runs: list[tuple[Path, dict, list[str]]], what: str, value) -> None:
    first = value(runs[0][1], runs[0][2])
    for folder, metrics, users in runs[1:]:
        if value(metrics, users) != first:
            raise SystemExit(
                f"relaygr quality: {folder} and {runs[0][0]} differ in {what}: pool only runs that ranked "
                "the same users' test targets (seeds of one log, one protocol, the same --users/--eval-users)"
            )


def compare(folders: list[Path]) -> dict[str, Any]:
    """The pooled report of ``folders``: each run's metrics, the settings they differ in, the
    pooled table and differences, and the best truncation by mean HR@10 against the whole history."""
    from relaygr.workers.training.quality import pooled

    read = [(f, *read_run(f)) for f in folders]
    runs = [(f, m, u) for f, m, u, _ in read]
    _same(runs, "the log", lambda m, u: m.get("dataset"))
    _same(runs, "the protocol", lambda m, u: (m.get("protocol"), m.get("test_events")))
    _same(runs, "the users ranked", lambda m, u: u)
    trains = [m.get("train", {}) for _, m, _ in runs]
    differ = sorted(
        k
        for k in set().union(*trains)
        if k not in OUTCOMES and len({json.dumps(t.get(k)) for t in trains}) > 1
    )
    table = pooled([r for *_, r in read])
    if not table["all_minus_truncation"]:
        raise SystemExit(
            "relaygr quality: the runs share no truncated history length to compare the whole one with"
        )
    best = max(table["all_minus_truncation"], key=lambda k: table["by_history_length"][k]["HR@10"])
    return {
        "dataset": runs[0][1].get("dataset"),
        "protocol": runs[0][1].get("protocol"),
        "users": len(runs[0][2]),
        "runs": [
            {
                "folder": str(f),
                "seed": m.get("train", {}).get("seed"),
                **{k: m.get("train", {}).get(k) for k in differ},
                "HR@10": {row["history"]: row["HR@10"] for row in m.get("by_history_length", [])},
            }
            for f, m, _ in runs
        ],
        "settings_that_differ": differ,
        **table,
        "best_truncation": best,
        "all_minus_best": table["all_minus_truncation"][best],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        type=Path,
        metavar="RUN",
        help="output folders of `relaygr train` (seeds of one log)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="also draw HR@10 by history length (each run, and the mean with its interval) and the whole "
        "history minus each truncation (pooled, with its interval) into this PNG",
    )


def plot(report: dict[str, Any], path: Path) -> Path:
    """Two panels: HR@10 by history length (each run thin, the mean with its 95 % interval), and
    the whole history minus each truncation, pooled, with its interval, against zero."""
    from relaygr.tools.report.plots import pyplot

    def bars(rows: list[dict]) -> tuple[list[float], list[list[float]]]:
        mid = [row["HR@10"] for row in rows]
        lo = [m - row["HR@10_ci95"][0] for m, row in zip(mid, rows, strict=True)]
        hi = [row["HR@10_ci95"][1] - m for m, row in zip(mid, rows, strict=True)]
        return mid, [lo, hi]

    plt = pyplot()
    fig, (by_length, minus) = plt.subplots(1, 2, figsize=(10, 4))
    lengths = list(report["by_history_length"])
    for i, r in enumerate(report["runs"]):
        by_length.plot(
            lengths,
            [r["HR@10"].get(k) for k in lengths],
            color="0.7",
            lw=1,
            label="each run" if i == 0 else None,
        )
    mid, err = bars([report["by_history_length"][k] for k in lengths])
    by_length.errorbar(
        lengths, mid, yerr=err, color="C0", lw=2, capsize=4, label=f"mean of {len(report['runs'])}, 95 % CI"
    )
    by_length.set(
        xlabel="history read (last N events)",
        ylabel="HR@10",
        title=f"{report['dataset']}: {report['users']} users",
    )
    truncations = list(report["all_minus_truncation"])
    mid, err = bars([report["all_minus_truncation"][k] for k in truncations])
    minus.errorbar(
        truncations, mid, yerr=err, fmt="o", color="C1", capsize=4, label="pooled over the runs, 95 % CI"
    )
    minus.axhline(0.0, color="0.3", lw=1)
    minus.set(
        xlabel="truncation (last N events)",
        ylabel="HR@10: whole history minus truncation",
        title="paired, per user",
    )
    for ax in (by_length, minus):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from relaygr.workers.training.quality import format_row

    report = compare(args.runs)
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
        return 0
    n, users = len(report["runs"]), report["users"]
    lengths = list(report["by_history_length"])
    print(f"{report['dataset']}: {n} run(s), {users} users; {report['protocol']}")
    if report["settings_that_differ"]:
        print(
            f"the runs differ in {', '.join(report['settings_that_differ'])}: a pool of configurations, not of seeds"
        )
    print("HR@10 by history length, each run:")
    print(f"  {'run':<40}" + "".join(f"{k:>9}" for k in lengths))
    for r in report["runs"]:
        label = f"{r['folder']} (seed {r['seed']})"
        extra = "".join(f" {k}={r[k]}" for k in report["settings_that_differ"])
        print(f"  {label + extra:<40}" + "".join(f"{r['HR@10'].get(k, float('nan')):>9.4f}" for k in lengths))
    print(f"mean over the runs, 95 % intervals over users (per user, the mean over the {n} run(s)):")
    for k, row in report["by_history_length"].items():
        print(f"  history {k:>4}: " + format_row(row))
    for k, row in report["all_minus_truncation"].items():
        print(f"  all - {k:>4}  : " + format_row(row))
    gap, (lo, hi) = report["all_minus_best"]["HR@10"], report["all_minus_best"]["HR@10_ci95"]
    verdict = "at least as good as" if gap >= 0 else "behind"
    print(
        f"the whole history is {verdict} the best truncation (the last {report['best_truncation']} events) by "
        f"HR@10: {gap:+.4f} [{lo:+.4f}, {hi:+.4f}], {gap * users:+.1f} users of {users} a run"
    )
    if args.plot:
        print(f"plot: {args.plot}")
    return 0
