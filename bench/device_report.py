"""The device check's report: each step's figures out of its JSON lines, and ``report.json`` /
``report.md`` written after every step (a check cut short still leaves what it measured).

Primitives:
- ``parse_json_lines(text)``: the JSON objects among a log's lines.
- ``summarise(step, rows, args)``: a step's figures (and its targets, where the issue sets one).
- ``write_report(out, doc)``: ``report.json`` and ``report.md`` in ``out``.
- ``TARGETS``: the accelerator targets: exactness, cached vs full against the FLOP bound, the
  history relay holds within the budget against full ranking's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from relaygr.tools.report.markdown import fmt, table

TARGETS = {
    "fp32_max_abs_diff": 1e-4,  # relay vs full, fp32
    "speedup_of_flop_bound_from_8k": 0.85,  # cached vs full speed-up / its FLOP bound, at 8k+
    "budget_history_ratio": 4.0,  # relay's longest history within the budget / full ranking's
}


def parse_json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _exactness(rows: list[dict]) -> dict:
    ranks = [r for r in rows if r.get("bench") == "model" and r.get("kind") == "rank"]
    out = [
        {
            "dtype": r["dtype"],
            "history": r["prefix_len"] + r["suffix_len"],
            "max_abs_diff": r["max_abs_diff"],
            "top10_agreement": r["top10_agreement"],
        }
        for r in ranks
    ]
    fp32 = [r["max_abs_diff"] for r in out if r["dtype"] == "float32"]
    worst = max(fp32) if fp32 else None
    return {
        "rows": out,
        "fp32_worst_abs_diff": worst,
        "meets_fp32_target": None if worst is None else worst <= TARGETS["fp32_max_abs_diff"],
    }


MODEL_FIELDS = (
    "dtype", "prefix_len", "relay_ms_p50", "relay_ms_p99", "full_ms_p50", "full_ms_p99", "speedup",
    "flop_bound", "speedup_of_flop_bound", "relay_tokens_per_s", "full_tokens_per_s", "kv_bytes_per_layer",
)  # fmt: skip


def _model(rows: list[dict]) -> dict:
    ranks = [r for r in rows if r.get("bench") == "model" and r.get("kind") == "rank"]
    budgets = [r for r in rows if r.get("bench") == "model" and r.get("kind") == "budget"]
    long = [r["speedup_of_flop_bound"] for r in ranks if r["prefix_len"] >= 8192]
    ratios = [b["ratio"] for b in budgets if b.get("ratio") is not None]
    first = ranks[0] if ranks else {}
    return {
        "shape": {k: first.get(k) for k in ("device_name", "layers", "dim", "heads", "preset")},
        "rows": [{k: r.get(k) for k in MODEL_FIELDS} for r in ranks],
        "budget": [
            {k: b.get(k) for k in ("dtype", "budget_ms", "relay_max_history", "full_max_history", "ratio")}
            for b in budgets
        ],
        "worst_speedup_of_flop_bound_from_8k": min(long) if long else None,
        # None: not measured (no length of 8k or more; no length that fits the budget on both paths).
        "meets_flop_bound_target": min(long) >= TARGETS["speedup_of_flop_bound_from_8k"] if long else None,
        "meets_budget_ratio_target": min(ratios) >= TARGETS["budget_history_ratio"] if ratios else None,
    }


def _store(rows: list[dict]) -> dict:
    out = []
    for r in rows:
        if r.get("bench") != "store":
            continue
        out.append(
            {
                "length": r["length"],
                "prefix_mb": round(r["prefix_bytes"] / 1e6, 1),
                "recompute_ms": r["recompute"]["median_ms"],
                "device_hit_ms": r["device_hit"]["median_ms"],
                "host_to_device_ms": r["host_to_device"]["median_ms"],
                "disk_ms": r["disk"]["median_ms"],
                "speedup_host_to_device": round(r["speedup_host_to_device"], 1),
                "speedup_disk": round(r["speedup_disk"], 1),
                "host_pinned": r.get("host_pinned"),
            }
        )
    return {"rows": out}


def _pipeline(rows: list[dict]) -> dict:
    train = [r for r in rows if "HR@10" in r and "model_version" in r]
    heads = [r for r in rows if "experiment" in r and "ratio" in r]
    keep = ("experiment", "slo_ms", "ratio", "met_target", "seconds", "cores")
    out: dict = {"experiments": []}
    for h in heads:
        key = "len" if h["experiment"] == "seq-len" else "qps"
        out["experiments"].append(
            {
                **{k: h.get(k) for k in keep},
                "relay_max": h.get(f"relay_max_{key}"),
                "baseline_max": h.get(f"baseline_max_{key}"),
                "points": h.get("points", []),
            }
        )
    if train:
        out["model"] = {k: train[-1].get(k) for k in ("HR@10", "NDCG@10", "model_version", "out")}
    return out


def summarise(step: str, rows: list[dict], args: argparse.Namespace) -> dict:
    if step == "environment":
        return next((r for r in rows if r.get("bench") == "device-probe"), {})
    return {"exactness": _exactness, "model": _model, "store": _store, "pipeline": _pipeline}[step](rows)


def _environment_md(s: dict) -> list[str]:
    if not s:
        return []
    dev = s.get("device", {})
    missing = [m for m, ok in s.get("modules", {}).items() if not ok]
    return [
        f"- Python {s.get('python')} ({s.get('python_executable')}), torch {s.get('torch')} "
        f"({s.get('torch_path')}); installed by the check: {s.get('installed_here') or 'nothing'}",
        f"- device: {dev.get('name')}, {dev.get('memory_total_gib', '–')} GiB ({dev.get('memory_free_gib', '–')} "
        f"free), CUDA {dev.get('cuda', '–')}; pinned memory works: {fmt(s.get('pinned_memory'))}, "
        f"host to device {fmt(s.get('h2d_gb_per_s'))} GB/s; matmul TFLOP/s {s.get('matmul_tflops')}",
        f"- {s.get('cpu_cores')} CPU cores; modules missing: {', '.join(missing) or 'none'}; "
        f"java: {s.get('java') or 'not found'}",
    ]


def _step_md(step: dict) -> list[str]:
    s = step.get("summary") or {}
    name = step["name"]
    if name == "environment":
        return _environment_md(s)
    if name == "exactness" and s.get("rows"):
        rows = [
            [r["dtype"], r["history"], f"{r['max_abs_diff']:.2e}", r["top10_agreement"]] for r in s["rows"]
        ]
        return [
            table(["dtype", "history (events)", "worst abs diff", "top-10 agreement"], rows, digits=2),
            f"\nfp32 worst {fmt(s['fp32_worst_abs_diff'], 8)}; target ≤ {TARGETS['fp32_max_abs_diff']:g}: "
            f"{fmt(s['meets_fp32_target'])}",
        ]
    if name == "model" and s.get("rows"):
        rows = [[r[k] for k in MODEL_FIELDS] for r in s["rows"]]
        budget = [[b[k] for k in b] for b in s["budget"]]
        return [
            f"model: {s['shape']}",
            table(list(MODEL_FIELDS), rows, digits=2),
            "",
            table(["dtype", "budget (ms)", "relay max history", "full max history", "ratio"], budget, 2),
            f"\ncached vs full against the FLOP bound at 8k+: worst {fmt(s['worst_speedup_of_flop_bound_from_8k'], 3)} "
            f"(target ≥ {TARGETS['speedup_of_flop_bound_from_8k']}: {fmt(s['meets_flop_bound_target'])}); "
            f"history ratio within the budget ≥ {TARGETS['budget_history_ratio']:g}: "
            f"{fmt(s['meets_budget_ratio_target'])}",
        ]
    if name == "store" and s.get("rows"):
        head = list(s["rows"][0])
        return [table(head, [[r[k] for k in head] for r in s["rows"]], digits=3)]
    if name == "pipeline" and s.get("experiments"):
        rows = [
            [e["experiment"], e["slo_ms"], e["relay_max"], e["baseline_max"], e["ratio"], e["seconds"]]
            for e in s["experiments"]
        ]
        model = s.get("model", {})
        return [
            f"model {model.get('model_version')} (HR@10 {fmt(model.get('HR@10'), 4)} after a short training)",
            table(["experiment", "B (ms)", "relay max", "baseline max", "ratio", "seconds"], rows, digits=2),
            f"\ncores: {s['experiments'][0].get('cores')}",
        ]
    return []


def markdown(doc: dict) -> str:
    lines = [
        f"# Device check: {doc['device']}{' (quick: tiny sizes)' if doc['quick'] else ''}",
        "",
        f"Started {doc['started']} (commit {fmt(doc.get('commit'))}), {fmt(doc.get('seconds'))} s of a "
        f"{doc['total_budget_s']:g} s budget; "
        f"model shape {doc['model_shape']}, ranking budget {doc['budget_ms']} ms.",
        "",
        table(
            ["step", "status", "seconds", "budget (s)", "CPU s", "load (1 min)", "reason", "log"],
            [
                [
                    s["name"],
                    s["status"],
                    s["seconds"],
                    s["budget_s"],
                    s.get("cpu_s"),
                    s.get("load_avg_1m"),
                    s["reason"],
                    s["log"],
                ]
                for s in doc["steps"]
            ],
        ),
    ]
    for step in doc["steps"]:
        body = _step_md(step)
        if body:
            lines += ["", f"## {step['name']}", "", *body]
    return "\n".join(lines) + "\n"


def write_report(out: Path, doc: dict) -> None:
    (out / "report.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(doc))
