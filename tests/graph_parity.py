"""The bucketed relay forward with the Triton kernel against the eager CPU backend, on the
small shapes of ``test_graph_relay``. Run as a script (``TRITON_INTERPRET=1`` on a CPU): it prints
one JSON object, the worst absolute score difference and the largest score."""

from __future__ import annotations

import json
import sys

import torch
from test_graph_relay import BLOCK, PAGES, POOL, _requests, model32

from relaygr.workers.kernels import use_backend
from relaygr.workers.model.runner import ModelRunner


def main(device: str) -> None:
    module = model32().model.to(device)
    module.refresh_version()
    model = ModelRunner(module, pool_tokens=PAGES, page_tokens=BLOCK)
    requests = _requests(model, [(15, 13, 9), (72, 61, 4), (2, 0, 1)], seed=5)
    with use_backend("cpu"):
        eager = [scores for scores, _ in model.rank_users(requests)]
    relay = model.use_graph_relay(True, prefix_tokens=POOL, capture=device == "cuda")
    with use_backend("triton"):
        graphed = [scores for scores, _ in model.rank_users(requests)]
    worst = max(float((a - b).abs().max()) for a, b in zip(eager, graphed, strict=True))
    scale = max(float(a.abs().max()) for a in eager)
    print(json.dumps({"worst": worst, "scale": scale, **relay.counters()}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
