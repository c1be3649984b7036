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

XL = "xl"  # the production-sized preset the model step measures besides the check's own
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
    "preset", "dtype", "prefix_len", "relay_ms_p50", "relay_ms_p99", "relay_graphed_ms_p50", "graph_captured",
    "full_ms_p50", "full_ms_p99", "speedup", "flop_bound", "speedup_of_flop_bound", "relay_tokens_per_s", "full_tokens_per_s", "kv_bytes_per_layer",
)  # fmt: skip


USERS_FIELDS = (
    "dtype", "prefix_len", "users", "alone_ms_per_request_p50", "batched_ms_per_request_p50",
    "batched_graphed_ms_per_request_p50", "device_rankings_per_s", "batched_graphed_max_abs_diff",
)  # fmt: skip


def _model(rows: list[dict]) -> dict:
    ranks = [r for r in rows if r.get("bench") == "model" and r.get("kind") == "rank"]
    budgets = [r for r in rows if r.get("bench") == "model" and r.get("kind") == "budget"]
    users = [r for r in rows if r.get("bench") == "model" and r.get("kind") == "users"]
    # The targets are the check's preset's; xl (fewer lengths, bf16 only) is reported beside them.
    main = [r for r in ranks if r.get("preset") != XL]
    long = [r["speedup_of_flop_bound"] for r in main if r["prefix_len"] >= 8192]
    ratios = [b["ratio"] for b in budgets if b.get("ratio") is not None and b.get("preset") != XL]
    shapes = {
        r.get("preset"): {k: r.get(k) for k in ("device_name", "layers", "dim", "heads")} for r in ranks
    }
    return {
        "shape": shapes,
        "rows": [{k: r.get(k) for k in MODEL_FIELDS} for r in ranks],
        "budget": [
            {
                k: b.get(k)
                for k in ("preset", "dtype", "budget_ms", "relay_max_history", "full_max_history", "ratio")
            }
            for b in budgets
        ],
        # A ranking worker's batch: users' relay rankings in one forward, eager and replayed.
        "users": [{k: u.get(k) for k in USERS_FIELDS} for u in users],
        # A bucketed relay ranking whose CUDA graph capture failed (it ran eagerly): why.
        "graph_errors": sorted({r["graph_error"] for r in ranks + users if r.get("graph_error")}),
        "worst_speedup_of_flop_bound_from_8k": min(long) if long else None,
        "xl_speedup_of_flop_bound": [r["speedup_of_flop_bound"] for r in ranks if r.get("preset") == XL],
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
                "model": "{layers} layers, d={dim}".format(**r["model"]) if "model" in r else None,
                "length": r["length"],
                "prefix_mb": round(r["prefix_bytes"] / 1e6, 1),
                "recompute_ms": r["recompute"]["median_ms"],
                "device_hit_ms": r["device_hit"]["median_ms"],
                "host_to_device_ms": r["host_to_device"]["median_ms"],
                "disk_ms": r["disk"]["median_ms"],
                "speedup_host_to_device": round(r["speedup_host_to_device"], 1),
                "speedup_disk": round(r["speedup_disk"], 1),
                "host_pinned": r.get("host_pinned"),
                "expander_matches": r.get("meets", {}).get("expander_choice_matches_the_times"),
            }
        )
    return {"rows": out}


def never_held(e: dict, plan: dict | None) -> str:
    """Why an experiment has no ratio: which side never held the SLO, at the point easiest for it
    (its first: the shortest length or the lowest rate), and what the calibration predicted there.
    '' when the ratio is defined."""
    if e.get("ratio") is not None:
        return ""
    key = "len" if e["experiment"] == "seq-len" else "qps"
    sides = [m for m in ("baseline", "relay") if e.get(f"{m}_max") is None]
    if not sides:
        return f"no ratio: relay held up to {e['relay_max']} and the baseline up to {e['baseline_max']}"
    out = []
    for mode in sides:
        tried = sorted((p for p in e.get("points", []) if p["mode"] == mode and p.get("counted", True)),
                       key=lambda p: p["x"])  # fmt: skip
        path = "full ranking" if mode == "baseline" else "relay ranking"
        if not tried:
            out.append(f"the {mode} never ran a point (the step ended first)")
            continue
        first = tried[0]
        where = f"{first['x']} events" if key == "len" else f"{first['x']}/s"
        missed = f"{first.get('k')} of {first.get('n')} requests over B = {e.get('slo_ms')} ms, P99 {fmt(first.get('p99_ms'))} ms"
        length = first["x"] if key == "len" else (plan or {}).get("history")
        predicted = (
            (plan or {}).get(f"predicted_{'full' if mode == 'baseline' else 'relay'}_ms", {}).get(str(length))
        )
        why = (
            f"; {path} alone was predicted at {predicted} ms there, so "
            + ("the device is too slow for it even at the easiest point" if predicted >= (e.get("slo_ms") or 0)
               else "the rest of the time went to queueing and the pipeline's stages")
            if predicted is not None else ""
        )  # fmt: skip
        out.append(f"the {mode} never held: at its easiest point ({where}) {missed}{why}")
    return f"{e['experiment']}: no ratio, " + "; ".join(out)


def _pipeline(rows: list[dict]) -> dict:
    train = [r for r in rows if "HR@10" in r and "model_version" in r]
    heads = [r for r in rows if "experiment" in r and "ratio" in r]
    plan = next((r for r in rows if r.get("bench") == "device-points"), None)
    keep = ("experiment", "slo_ms", "ratio", "met_target", "seconds", "cores")
    out: dict = {"experiments": []}
    if plan:
        out["points"] = {k: plan.get(k) for k in ("requests", "lengths", "seq_len_qps", "history", "rates",
                                                  "seconds", "dropped", "why", "predicted_full_ms", "predicted_relay_ms")}  # fmt: skip
    for h in heads:
        key = "len" if h["experiment"] == "seq-len" else "qps"
        e = {
            **{k: h.get(k) for k in keep},
            "relay_max": h.get(f"relay_max_{key}"),
            "baseline_max": h.get(f"baseline_max_{key}"),
            "points": h.get("points", []),
        }
        e["never_held"] = never_held(e, plan)
        out["experiments"].append(e)
    if train:
        out["model"] = {k: train[-1].get(k) for k in ("HR@10", "NDCG@10", "model_version", "out")}
    return out


PROFILE_FIELDS = ("preset", "length", "path", "ranking_ms_p50", "wall_ms", "device_busy_ms", "busy_share",
                  "kernels", "floor_eager_ms", "floor_graph_ms", "floor_kernels")  # fmt: skip


def _profile(rows: list[dict]) -> dict:
    prof = [r for r in rows if r.get("bench") == "profile"]
    return {
        "rows": [{k: r.get(k) for k in PROFILE_FIELDS} for r in prof if "error" not in r],
        "top_kernels": {
            f"{r['path']} @ {r['length']}": r.get("top_kernels", []) for r in prof if "error" not in r
        },
        "errors": [r["error"] for r in prof if "error" in r]
        + [
            f"{r['path']} @ {r['length']}: the floor's CUDA graph: {r['floor_graph_error']}"
            for r in prof
            if r.get("floor_graph_error")
        ]
        + [f"{r['path']} @ {r['length']}: {r['graph_error']}" for r in prof if r.get("graph_error")],
    }


def summarise(step: str, rows: list[dict], args: argparse.Namespace) -> dict:
    if step == "environment":
        return next((r for r in rows if r.get("bench") == "device-probe"), {})
    steps = {
        "kernels": _kernels,
        "exactness": _exactness,
        "model": _model,
        "store": _store,
        "profile": _profile,
        "pipeline": _pipeline,
    }
    return steps[step](rows)


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


def _kernels(rows: list[dict]) -> dict:
    bench = next((r for r in rows if r.get("bench") == "kernels"), None)
    return {"rows": bench["rows"], "dtype": bench.get("dtype")} if bench else {}


KERNEL_FIELDS = (
    "preset",
    "kind",
    "keys",
    "reference_ms",
    "triton_ms",
    "triton_tflops",
    "speedup",
    "worst_diff",
)


def _kernels_md(s: dict) -> list[str]:
    rows = [[r.get(k) for k in KERNEL_FIELDS] for r in s["rows"]]
    return [f"one layer's attention call, {s.get('dtype')}:", table(list(KERNEL_FIELDS), rows, digits=4)]


def _step_md(step: dict) -> list[str]:
    s = step.get("summary") or {}
    name = step["name"]
    if name == "environment":
        return _environment_md(s)
    if name == "kernels" and s.get("rows"):
        return _kernels_md(s)
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
            table(
                ["preset", "dtype", "budget (ms)", "relay max history", "full max history", "ratio"],
                budget,
                2,
            ),
            f"\ncached vs full against the FLOP bound at 8k+: worst {fmt(s['worst_speedup_of_flop_bound_from_8k'], 3)} "
            f"(target ≥ {TARGETS['speedup_of_flop_bound_from_8k']}: {fmt(s['meets_flop_bound_target'])}); "
            f"history ratio within the budget ≥ {TARGETS['budget_history_ratio']:g}: "
            f"{fmt(s['meets_budget_ratio_target'])}",
            *(
                ["", table(list(USERS_FIELDS), [[u[k] for k in USERS_FIELDS] for u in s["users"]], 3)]
                if s.get("users")
                else []
            ),
            *(f"- relay_graphed: the CUDA graph was not captured: {e}" for e in s.get("graph_errors", [])),
        ]
    if name == "store" and s.get("rows"):
        head = list(s["rows"][0])
        return [table(head, [[r[k] for k in head] for r in s["rows"]], digits=3)]
    if name == "profile" and s.get("rows"):
        return _profile_md(s)
    if name == "pipeline" and (s.get("experiments") or s.get("points")):
        return _pipeline_md(s)
    return []


def _profile_md(s: dict) -> list[str]:
    head = ["preset", "events", "path", "ranking ms (P50)", "profiled wall ms", "device busy ms", "busy share",
            "kernels", "floor eager ms", "floor graph ms", "floor kernels"]  # fmt: skip
    rows = [[r[k] for k in PROFILE_FIELDS] for r in s["rows"]]
    top = [
        f"- {what}: " + "; ".join(f"{k['name'][:60]} ×{k['count']} {k['ms']:.2f} ms" for k in kernels[:3])
        for what, kernels in s["top_kernels"].items()
    ]
    return [
        table(head, rows, digits=3),
        "\nThe floor: a plain transformer of the same shape whose attention is fused "
        "(scaled_dot_product_attention), eager and replayed from a CUDA graph. Top kernels by device time:",
        *top,
        *(f"- error: {e}" for e in s.get("errors", [])),
    ]


def _pipeline_md(s: dict) -> list[str]:
    out = []
    pts = s.get("points")
    if pts:
        out += [f"points sized from the device's calibration: {pts['requests']} requests a point; lengths "
                f"{pts['lengths']} at {pts['seq_len_qps']}/s; rates {pts['rates']}/s at {pts['history']} events "
                f"(sending predicted at {pts['seconds']} s; dropped: {', '.join(pts['dropped']) or 'none'})",
                *(f"- {w}" for w in pts.get("why") or []), ""]  # fmt: skip
    if s.get("experiments"):
        rows = [
            [e["experiment"], e["slo_ms"], e["relay_max"], e["baseline_max"], e["ratio"], e["seconds"]]
            for e in s["experiments"]
        ]
        model = s.get("model", {})
        out += [
            f"model {model.get('model_version')} (HR@10 {fmt(model.get('HR@10'), 4)} after a short training)",
            table(["experiment", "B (ms)", "relay max", "baseline max", "ratio", "seconds"], rows, digits=2),
            *(f"\n{e['never_held']}" for e in s["experiments"] if e.get("never_held")),
            f"\ncores: {s['experiments'][0].get('cores')}",
        ]
    return out


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
