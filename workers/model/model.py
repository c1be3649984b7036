"""The HSTU ranker RelayGR serves: config, layers, the module and its checkpoint.

Primitives:
- ``HSTUConfig``: the typed model config (shape, buckets, normaliser, dtype, device, block sizes).
- ``HSTULayer``: one HSTU block. ``U, Q, K, V = silu(W x_norm)`` from one projection;
  pointwise attention ``silu(q.k / sqrt(d) + bias) v / N`` (no softmax, fixed ``N``) with a
  relative bias from the position difference and time gap of each token pair; the normalised
  attention output is gated by ``U`` and projected back into the residual stream.
- ``HSTURanker``: token = item embedding + action embedding. History tokens attend causally.
  A candidate is one more token (its item, the reserved candidate action) placed right after
  the history at the request's timestamp; it attends to every history token and to itself, never
  to another candidate. Its score is what the layers added to it (final residual stream minus
  its input embedding: the answer of the history to "how about this item?"), normalised and
  dotted with its item embedding. Leaving the input out keeps the item's own embedding norm
  from swamping the history's contribution.
  The module and its checkpoint only: serving it (``prefill``, ``extend``, ``rank``,
  ``rank_and_extend``, ``rank_many``, ``rank_users``, ``rank_full``, over the one attention
  interface ``kernels.hstu_mha``, and the buckets replayed from CUDA graphs) is the model runner's
  (``runner.ModelRunner``); the dense path that training differentiates, and the oracle of
  serving, is ``dense``. Here: the modules, ``model_version``, ``item_embeddings``, ``flops``
  (what one call computes) and the checkpoint, ``save`` / ``load``.

Relay exactness: every history token's keys and values depend only on the tokens before it
(causal), the bias depends only on absolute positions and timestamps of the pair, ``N`` is a
constant and the far-key factor (``near_keys``, ``far_keys``) depends only on the position of the
token that reads. So the cache of the first ``n`` events is the same whichever longer history they start,
and ``rank(prefill(h[:n]), h[n:], c) == rank_full(h, c)`` up to float rounding.

The last layer's history tokens only provide keys and values (no later layer reads their
outputs, and scores come from candidate tokens), so that layer computes just K and V for them,
on the cached and the full path alike.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors.torch import load_file, save_file
from torch import nn

from relaygr.workers.model.devices import resolve_device, resolve_dtype
from relaygr.workers.model.hstu_attention import is_bucket_boundary
from relaygr.workers.model.vocab import ItemVocab

NEAR_KEYS = 64
"""``near_keys`` of a model ``relaygr train`` trains and of the presets (``HSTUConfig``'s own
default, 0, keeps the checkpoints from before the option as they were)."""
FAR_KEYS = 128.0
"""``far_keys`` of a model ``relaygr train`` trains and of the presets."""

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class HSTUConfig(BaseModel):
    """Shape and runtime settings of an ``HSTURanker``; saved next to its weights."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    num_items: int = Field(1682, ge=1)
    """Items the model knows: model ids 1..num_items have embeddings; 0 and any other id share
    the padding/out-of-vocabulary embedding (row 0), so an unseen id never raises. Raw item ids
    become model ids through the checkpoint's ``ItemVocab`` (the identity without one)."""
    num_actions: int = Field(5, ge=1)
    """Behaviour types, ids 1..num_actions (MovieLens: the rating). 0 means none/unknown and
    num_actions + 1 is reserved for candidate tokens."""
    layers: int = Field(2, ge=1)
    """Number of HSTU layers."""
    heads: int = Field(2, ge=1)
    """Attention heads per layer."""
    dim: int = Field(64, ge=1)
    """Model (embedding and residual stream) dimension."""
    attn_dim: int = Field(32, ge=1)
    """Query/key dimension per head."""
    linear_dim: int = Field(32, ge=1)
    """Value/gate (U) dimension per head."""
    position_buckets: int = Field(64, ge=1)
    """Buckets of the position difference i - j: exact below 16, then four per doubling
    (64 buckets distinguish distances up to 65536)."""
    time_buckets: int = Field(64, ge=1)
    """Buckets of the time gap ts_i - ts_j in seconds: two per doubling, gaps under 1.5 s in
    bucket 0 (64 buckets cover about 70 years)."""
    max_len: int = Field(256, ge=2)
    """Training window in events. Inference takes histories of any length."""
    max_seq_len: int = Field(8192, ge=16)
    """Most events of a user's history that serving reads: the most recent ones, in a window
    whose start moves in steps of an eighth of it (see ``relaygr.workers.prefix_kv.served``)."""
    dropout: float = Field(0.2, ge=0.0, lt=1.0)
    """Dropout on embeddings and layer outputs during training."""
    attn_normaliser: float = Field(256.0, gt=0.0)
    """Fixed divisor of every attention sum. It never depends on a sequence's length, so a
    prefix's keys, values and outputs do not change when the history grows."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and activation dtype at inference (timestamps stay float64)."""
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?|npu(:\d+)?)$")
    """Device the model runs on: cpu, cuda[:N] or npu[:N] (npu needs torch_npu)."""
    attn_block: int = Field(512, ge=8)
    """Most events of one pre-inference forward (``prefill``/``extend`` run longer histories in
    chunks of this many: a chunk's scores are ``chunk x history``). Rankings are one forward."""
    candidate_batch: int = Field(128, ge=1)
    """Candidates a ranking usually scores: the unit the engine's pacing spreads a scoring's
    cost over. A ranking scores all its candidates in one forward whatever their number."""
    near_keys: int = Field(0, ge=0)
    """Keys at least this many positions before a query are far (``hstu_attention``): their terms
    are scaled so that together they weigh at most ``far_keys`` keys. 0: no key is far (every
    checkpoint from before the option). A position-bucket boundary: 1..16, then 20, 24, 28, 32,
    40, 48, 56, 64, 80, ... (four per doubling)."""
    far_keys: float = Field(128.0, gt=0.0)
    """How many keys' worth the far keys of a query weigh together at most."""

    @model_validator(mode="after")
    def _near_keys_on_a_bucket_boundary(self) -> HSTUConfig:
        if self.near_keys and not is_bucket_boundary(self.near_keys, self.position_buckets):
            raise ValueError(
                f"near_keys {self.near_keys}: must be 0 or a position-bucket boundary below the "
                f"last of the {self.position_buckets} buckets (1..16, 20, 24, 28, 32, 40, 48, 56, 64, 80, ...)"
            )
        return self


class HSTULayer(nn.Module):
    """One HSTU layer: fused U/Q/K/V projection, pointwise attention with relative bias, gating."""

    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        self.heads, self.dqk, self.dv = cfg.heads, cfg.attn_dim, cfg.linear_dim
        self.num_pos, self.num_time = cfg.position_buckets, cfg.time_buckets
        self.normaliser = cfg.attn_normaliser
        self.scale = cfg.attn_dim**-0.5
        hv, hk = cfg.heads * cfg.linear_dim, cfg.heads * cfg.attn_dim
        self.splits = [hv, hk, hk, hv]  # u, q, k, v: k and v last so K/V-only projection is a slice
        self.norm = nn.LayerNorm(cfg.dim)
        self.uqkv = nn.Linear(cfg.dim, sum(self.splits))
        self.pos_bias = nn.Parameter(torch.zeros(cfg.position_buckets))
        self.time_bias = nn.Parameter(torch.zeros(cfg.time_buckets))
        self.attn_norm = nn.LayerNorm(hv)
        self.out = nn.Linear(hv, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def bias_table(self) -> torch.Tensor:
        """Flattened ``[position_buckets * time_buckets]`` relative bias."""
        return (self.pos_bias[:, None] + self.time_bias[None, :]).reshape(-1)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:  # [..., T, H*d] -> [..., H, T, d]
        return t.unflatten(-1, (self.heads, -1)).transpose(-2, -3)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [..., T, dim]`` -> ``u [..., T, H*dv]``, ``q`` (scaled), ``k``, ``v`` as ``[..., H, T, d]``."""
        u, q, k, v = F.silu(self.uqkv(self.norm(x))).split(self.splits, dim=-1)
        return u, self._heads(q) * self.scale, self._heads(k), self._heads(v)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Only ``k`` and ``v`` (what the last layer needs from history tokens)."""
        off = self.splits[0] + self.splits[1]
        kv = F.silu(F.linear(self.norm(x), self.uqkv.weight[off:], self.uqkv.bias[off:]))
        k, v = kv.split(self.splits[2:], dim=-1)
        return self._heads(k), self._heads(v)

    def finish(self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual update from the normalised attention output ``attn [..., H, T, dv]``."""
        a = attn.transpose(-2, -3).flatten(-2)
        return x + self.drop(self.out(self.attn_norm(a) * u))


class HSTURanker(nn.Module):
    """HSTU ranker with a relay-exact prefix KV cache and target-aware candidate scoring (served by
    ``runner.ModelRunner``)."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        self.item_emb = nn.Embedding(config.num_items + 1, d)
        self.action_emb = nn.Embedding(config.num_actions + 2, d)
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(d)
        self.emb_drop = nn.Dropout(config.dropout)
        nn.init.normal_(self.item_emb.weight, std=d**-0.5)
        nn.init.normal_(self.action_emb.weight, std=d**-0.5)
        self.to(device=resolve_device(config.device), dtype=resolve_dtype(config.dtype))
        # Raw item ids <-> model ids: what serving maps incoming ids through.
        self.vocab = ItemVocab.identity_of(config.num_items)
        self.model_version = ""
        self.refresh_version()

    # ----------------------------------------------------------------------------- basics
    @property
    def device(self) -> torch.device:
        return self.item_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.item_emb.weight.dtype

    @property
    def candidate_action(self) -> int:
        """Action id of candidate tokens."""
        return self.config.num_actions + 1

    def refresh_version(self) -> str:
        """Recompute ``model_version``: a short stable hash of the config (less the device) and
        the weights. Call after changing weights; ``load`` and training do."""
        h = hashlib.blake2b(digest_size=6)
        h.update(self.config.model_dump_json(exclude={"device"}).encode())
        if not self.vocab.identity:  # the same weights under another catalogue are another model
            h.update(json.dumps(self.vocab.raw_ids()).encode())
        for name, t in sorted(self.state_dict().items()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        self.model_version = h.hexdigest()
        return self.model_version

    def set_vocab(self, vocab: ItemVocab) -> None:
        """Attach the catalogue the model is trained on (its size must be ``num_items``)."""
        if len(vocab) != self.config.num_items:
            raise ValueError(f"vocabulary of {len(vocab)} items for a model of {self.config.num_items}")
        self.vocab = vocab
        self.refresh_version()

    def vocab_items(self, raw: torch.Tensor) -> torch.Tensor:
        """Model item ids -> embedding rows; ids outside 1..num_items map to 0 (out of vocabulary).
        Raw ids reach here through ``self.vocab`` first."""
        raw = raw.to(self.device, torch.int64)
        return torch.where((raw >= 1) & (raw <= self.config.num_items), raw, 0)

    def vocab_actions(self, raw: torch.Tensor) -> torch.Tensor:
        raw = raw.to(self.device, torch.int64)
        return torch.where((raw >= 1) & (raw <= self.config.num_actions), raw, 0)

    def item_embeddings(self) -> torch.Tensor:
        """The ``[num_items + 1, dim]`` item embedding table (row 0: unknown), for retrieval by
        inner product."""
        return self.item_emb.weight.detach()

    def flops(self, cached: int, new: int, candidates: int) -> int:
        """FLOPs (projections and attention) of computing ``new`` history tokens after ``cached``
        cached ones and scoring ``candidates`` candidates (``rank``: cached=prefix, new=suffix;
        ``rank_full``: cached=0; ``prefill``/``extend``: candidates=0)."""
        c = self.config
        hk, hv = c.heads * c.attn_dim, c.heads * c.linear_dim
        proj, proj_kv, out = 2 * c.dim * (2 * hk + 2 * hv), 2 * c.dim * (hk + hv), 2 * hv * c.dim
        pair = 2 * (hk + hv)  # q.k and s*v per visible (query, key) pair
        layers = len(self.layers)
        hist_pairs = new * cached + new * (new + 1) // 2
        total = new * ((layers - 1) * (proj + out) + proj_kv) + (layers - 1) * hist_pairs * pair
        return total + candidates * layers * (proj + out + (cached + new + 1) * pair)

    # ------------------------------------------------------------------------- checkpoints
    def save(self, directory: str | Path) -> Path:
        """Write ``model.safetensors`` (weights, with the model version in its metadata) and
        ``config.json``, and ``vocab.json`` unless the vocabulary is the identity."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: t.detach().to("cpu").contiguous() for k, t in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_FILE), metadata={"model_version": self.model_version})
        (out / CONFIG_FILE).write_text(self.config.model_dump_json(indent=2) + "\n")
        self.vocab.save(out)
        return out

    @classmethod
    def load(cls, directory: str | Path, device: str | None = None, dtype: str | None = None) -> HSTURanker:
        """A model from ``save``'s files, optionally on another device or in another dtype."""
        src = Path(directory)
        config = HSTUConfig.model_validate(json.loads((src / CONFIG_FILE).read_text()))
        updates = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
        if updates:
            config = HSTUConfig.model_validate({**config.model_dump(), **updates})
        model = cls(config)
        state = load_file(str(src / WEIGHTS_FILE), device="cpu")
        model.load_state_dict({k: t.to(model.dtype) for k, t in state.items()})
        model.vocab = ItemVocab.load(src, config.num_items)
        model.eval()
        model.refresh_version()
        return model
