"""Named model shapes: ``small`` (the default ranker, sized for a CPU), ``large`` (sized for an
accelerator: a 150k-parameter ranker cannot load a GPU), ``xl`` (HSTU's largest published
configuration, 24 layers of d=1024 over 8,192 events: there arithmetic, not launches, decides the
cost, and relay's saving is the paper's) and ``nvidia-block`` (NVIDIA's cached HSTU block in
recsys-examples: 8 layers, hidden 1024, 4 heads of 256, 4,096-event histories; ``relaygr bench
model --anchor`` runs its published shape, so that a GPU's figures read against NVIDIA's).

Primitives:
- ``ModelPreset``: layers, heads, model dimension and serving cap (``max_seq_len``) of a shape;
  ``config(**overrides)`` is its ``HSTUConfig`` (head dimension = dim / heads; far keys as
  ``relaygr train`` trains them).
- ``PRESETS``: name -> preset; ``preset(name)`` looks one up with a clear error.
- ``resolve_shape(preset_name, layers=, heads=, dim=, fallback=)``: the shape a command runs:
  a flag given explicitly wins over the preset, the preset over the command's own ``fallback``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from relaygr.workers.model.model import FAR_KEYS, NEAR_KEYS, HSTUConfig

SHAPE_FIELDS = ("layers", "heads", "dim", "max_seq_len")


@dataclass(frozen=True)
class ModelPreset:
    name: str
    layers: int
    heads: int
    dim: int
    max_seq_len: int
    note: str

    def shape(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k in SHAPE_FIELDS}

    def config(self, **overrides: Any) -> HSTUConfig:
        head = self.dim // self.heads
        base = {
            **self.shape(),
            "attn_dim": head,
            "linear_dim": head,
            "near_keys": NEAR_KEYS,
            "far_keys": FAR_KEYS,
        }
        return HSTUConfig(**(base | overrides))


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("small", 2, 2, 64, 8192, "the default ranker, about 150k parameters"),
        ModelPreset("large", 8, 4, 256, 32768, "for an accelerator, about 3.1M parameters"),
        ModelPreset("xl", 24, 8, 1024, 8192, "HSTU's largest published shape, about 128M parameters"),
        ModelPreset(
            "nvidia-block",
            8,
            4,
            1024,
            4096,
            "NVIDIA's cached HSTU block, about 44M parameters (4 heads of 256)",
        ),
    )
}


def preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"no model preset {name!r}; use one of {sorted(PRESETS)}") from None


def resolve_shape(
    preset_name: str | None,
    *,
    fallback: dict[str, int],
    **given: int | None,
) -> dict[str, int]:
    """``layers``, ``heads``, ``dim`` (and ``max_seq_len`` where given or in ``fallback``): each
    from ``given`` when not None, else from the preset, else from ``fallback``."""
    base = dict(fallback)
    if preset_name is not None:
        base.update({k: v for k, v in preset(preset_name).shape().items() if k in base or k in given})
    out = {**base, **{k: v for k, v in given.items() if v is not None}}
    if out["dim"] % out["heads"]:
        raise ValueError(f"dim {out['dim']} is not a multiple of heads {out['heads']}")
    return out
