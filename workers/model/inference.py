"""The eager serving forward of the HSTU ranker: what the model runner (``runner.ModelRunner``)
runs on CPU and NPU, and on CUDA for a shape no captured bucket holds.

Primitives:
- ``LayerPass(runner, plan, sv)``: one forward over a ``jagged.ForwardPlan``, a layer per step
  (``steps``, ``run``); then ``scores`` per user and ``new_kv`` (per layer, the keys and values of
  every new row). The bucketed forward (``graph_runner.BucketRunner``) runs its layers too.
- ``UserRanking``: one user's request to ``ModelRunner.rank_users``.
- ``ServingRunner``: what a forward reads of its runner (the config, the device, the weights'
  serving form): the runner's protocol, so that the forwards import nothing of it.

How a call runs: the users, their cached prefixes, new events and candidates are planned into one
jagged batch (``jagged.ForwardPlan``); the forward then loops over the layers only, and each
layer is a fixed handful of operations (a norm and one projection with SiLU, the keys and values
of every user in one tensor, one ``kernels.hstu_mha_gated`` call: attention, its norm and the
gate; the output projection with the residual), whatever the number of users or the history length.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from relaygr.workers.kernels import hstu_mha_gated
from relaygr.workers.model.inference_state import LayerWeights, Serving
from relaygr.workers.model.jagged import ForwardPlan
from relaygr.workers.prefix_kv import Events, PrefixKV


class ServingRunner(Protocol):
    """What a forward reads of the runner that serves the model (``runner.ModelRunner``)."""

    @property
    def config(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def serving(self) -> Serving: ...


@dataclass(frozen=True)
class UserRanking:
    """One user's ranking for ``rank_users``: ``history`` starts with ``prefix`` (``None``: no
    cached prefix); only the events after it and the candidates are computed."""

    prefix: PrefixKV | None
    history: Events
    candidates: torch.Tensor
    request_ts: float


class LayerPass:
    """One forward over a plan, a layer per step (``steps``); then ``scores`` per user and
    ``new_kv`` (per layer, the keys and values ``[rows, H, d]`` of every new row)."""

    def __init__(self, runner: ServingRunner, plan: ForwardPlan, sv: Serving) -> None:
        self.runner, self.plan, self.sv = runner, plan, sv
        self.new_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scores: list[torch.Tensor] = []

    def _kv(self, li: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every user's keys and values, packed: its prefix's, then the rows it sees."""
        pieces = [p for user in self.plan.key_pieces for p in user]
        if len(pieces) == 1:
            a, b = pieces[0]
            return k_new[a:b], v_new[a:b]
        if self.plan.cached.tail is not None:  # one user: its new rows written after its prefix's
            return self.plan.cached.tail_layer(li, k_new, v_new)
        ks, vs = [], []
        for user, (slot, user_pieces) in enumerate(zip(self.plan.slots, self.plan.key_pieces, strict=True)):
            for piece in user_pieces:
                if piece is None:  # its cached prefix's (gathered from its pages once per forward)
                    k, v = self.plan.cached.layer(slot, user, li)
                    ks.append(k)
                    vs.append(v)
                else:
                    ks.append(k_new[piece[0] : piece[1]])
                    vs.append(v_new[piece[0] : piece[1]])
        return torch.cat(ks), torch.cat(vs)

    def _layer(self, li: int, x: torch.Tensor, gate_buf: torch.Tensor) -> torch.Tensor:
        """Layer ``li`` on the activations ``x`` of every row; returns the next activations (of
        the candidate rows only, on the last layer)."""
        w: LayerWeights = self.sv.layers[li]
        hv, hq, hk, _ = self.sv.splits
        cfg = self.runner.config
        heads, dqk, dv = cfg.heads, cfg.attn_dim, cfg.linear_dim
        rows = x.shape[0]
        h = F.layer_norm(x, x.shape[-1:], *w.norm[:2], eps=w.norm[2])
        p = F.glu(F.linear(h, w.proj_weight, w.proj_bias), dim=-1)  # SiLU, the query scale on q
        u, q = p[:, :hv], p[:, hv : hv + hq].view(rows, heads, dqk)
        k_new = p[:, hv + hq : hv + hq + hk].view(rows, heads, dqk)
        v_new = p[:, hv + hq + hk :].view(rows, heads, dv)
        self.new_kv.append((k_new, v_new))
        last = li == len(self.sv.layers) - 1
        batch = self.plan.last if last else self.plan.batch
        if batch is None:  # a prefill's last layer: keys and values only
            return x
        if last and batch is not self.plan.batch:
            u, q, x = self._candidate_rows(u), self._candidate_rows(q), self._candidate_rows(x)
        k, v = self._kv(li, k_new, v_new)
        # Attention, its norm and the gate by ``u`` into the gated rows (one pass on Triton).
        gated = gate_buf[: q.shape[0]]
        hstu_mha_gated(q, k, v, batch, w.bias_table, self.sv.params, w.attn_norm, u, gated[:, :hv])
        return torch.addmm(x, gated, w.out_weight)

    def _candidate_rows(self, t: torch.Tensor) -> torch.Tensor:
        if self.plan.cand_index is not None:
            return t.index_select(0, self.plan.cand_index)
        return t[t.shape[0] - self.plan.candidates :]

    def steps(self) -> Iterator[None]:
        """Runs the layers, yielding after each; then fills ``scores``."""
        runner, plan = self.runner, self.plan
        device = runner.device
        # A token: its item's row plus its action's (after the items) of one table, one bag each.
        bags = np.stack([plan.items, plan.actions + runner.config.num_items + 1], axis=1).reshape(-1)
        bags_t = torch.from_numpy(bags).to(device, non_blocking=True)
        starts = torch.from_numpy(np.arange(0, len(bags), 2)).to(device, non_blocking=True)
        x = x0 = F.embedding_bag(bags_t, self.sv.tokens, starts, mode="sum")
        hv = self.sv.splits[0]
        # The gated attention output, then a column of ones: the output projection's bias row.
        gate_buf = x.new_empty(plan.rows, hv + 1)
        gate_buf[:, hv].fill_(1.0)
        for li in range(len(self.sv.layers)):
            x = self._layer(li, x, gate_buf)
            yield
        if plan.last is None:
            self.scores = [torch.empty(0, dtype=torch.float32, device=device) for _ in plan.slots]
            return
        if x.shape[0] != plan.candidates:
            x = self._candidate_rows(x)
        x0 = self._candidate_rows(x0)
        cand_items = torch.from_numpy(plan.items[plan.candidate_rows()]).to(device, non_blocking=True)
        e = F.embedding(cand_items, self.sv.items)
        norm_w, norm_b, eps = self.sv.final_norm
        out = torch.linalg.vecdot(F.layer_norm(x - x0, x.shape[-1:], norm_w, norm_b, eps), e)
        out = out.float()
        at = 0
        for a, b in plan.cand_rows:
            self.scores.append(out[at : at + b - a])
            at += b - a

    def run(self) -> LayerPass:
        for _ in self.steps():
            pass
        return self
