"""On-disk format of a ``PrefixKV``: tensor bytes behind a small self-describing header.

Primitives:
- ``encode(prefix) -> bytes``: one blob holding every tensor of the prefix.
- ``decode(blob, expected_model_version=None, *, body_crc=None, owned=False) -> PrefixKV``: the
  inverse, on the CPU; raises ``CodecError`` (with a machine-readable ``reason``) for anything
  that is not a complete, intact blob of a known format version. ``body_crc``: the checksum of
  ``blob[:-4]`` already computed by the reader (``blob_files`` computes it while reading);
  ``owned``: the caller hands ``blob`` (writable) over, and the tensors view into it uncopied.
- ``peek_header(blob) -> dict``: the parsed header alone, without touching the payload.
- ``crc32(data, value=0)``: the blob's checksum (zlib's CRC-32, computed by ISA-L where the
  ``isal`` package is installed: several times faster, the same values).

Layout (all integers little-endian)::

    magic  b"RGKV"             4 bytes
    format version             u16
    header length H            u32
    header                     H bytes, UTF-8 JSON (padded with spaces so that the payload
                               starts at a 64-byte boundary): model version, prefix length, fingerprint,
                               meta, kv dtype, cold format (``kv_formats``: exact, bf16 or int8,
                               the dtype it decodes to, the number of int8 scale tensors), and
                               per tensor its dtype, shape, offset, size
    payload                    the tensors' raw bytes; a tensor whose dtype or shape differs from
                               the one before it starts at a 64-byte boundary, one like it follows
                               it directly (a run: the layers' keys and values, the int8 scales)
    crc32                      u32 over everything above

The checksum is for detecting torn writes and bit rot, not tampering. Decoding copies the payload
once into a fresh buffer (none with ``owned``) and views every tensor into it, so the result is
writable and owns its memory; the tensors of a run are views of one tensor (``kv_formats.to_warm`` decodes a run of
int8 blocks in one operation). This module imports only the standard library, torch and ``prefix_kv``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from relaygr.workers.prefix_kv import FINGERPRINT_BYTES, PrefixKV

try:  # the same CRC-32 as zlib's, at several GB/s (carry-less multiplication)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; a bare checkout still works
    from zlib import crc32

MAGIC = b"RGKV"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<4sHI")  # magic, format version, header length
_CRC = struct.Struct("<I")
_ALIGN = 64

# Only these dtypes may appear in a blob; a name outside the table is a corrupt header.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class CodecError(ValueError):
    """A blob that cannot be decoded. ``reason`` is one of: ``truncated``, ``bad_magic``,
    ``unsupported_version``, ``bad_header``, ``checksum``, ``model_version``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"kv_codec: unsupported dtype {dtype}") from None


def _tensors(prefix: PrefixKV) -> list[tuple[str, torch.Tensor]]:
    named = [(f"k{i}", k) for i, k in enumerate(prefix.keys)]
    named += [(f"v{i}", v) for i, v in enumerate(prefix.values)]
    named += [(f"s{i}", s) for i, s in enumerate(prefix.scales)]
    named += [("positions", prefix.positions), ("timestamps", prefix.timestamps)]
    return named


def encode(prefix: PrefixKV) -> bytes:
    """Serialise ``prefix`` (on any device; a paged one's tokens gathered) into one blob."""
    prefix = prefix.dense()
    if len(prefix.fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"kv_codec: fingerprint must be {FINGERPRINT_BYTES} bytes")
    if len(prefix.keys) != len(prefix.values):
        raise ValueError("kv_codec: keys and values must have one tensor per layer")
    parts: list[memoryview | bytes] = []
    specs: list[dict[str, Any]] = []
    offset = 0
    previous: tuple[torch.dtype, torch.Size] | None = None
    for name, t in _tensors(prefix):
        raw = t.detach().to("cpu").contiguous()
        nbytes = raw.numel() * raw.element_size()
        same = previous == (raw.dtype, raw.shape)
        previous = (raw.dtype, raw.shape)
        pad = 0 if same else (-offset) % _ALIGN
        if pad:
            parts.append(bytes(pad))
            offset += pad
        specs.append(
            {
                "name": name,
                "dtype": _dtype_name(raw.dtype),
                "shape": list(raw.shape),
                "offset": offset,
                "nbytes": nbytes,
            }
        )
        if nbytes:
            parts.append(memoryview(raw.view(torch.uint8).reshape(-1).numpy()))
        offset += nbytes
    header = {
        "format": FORMAT_VERSION,
        "model_version": prefix.model_version,
        "length": int(prefix.length),
        "fingerprint": prefix.fingerprint.hex(),
        "num_layers": len(prefix.keys),
        "kv_dtype": _dtype_name(prefix.dtype),
        "kv_format": prefix.kv_format,
        "exact_dtype": _dtype_name(prefix.exact_dtype) if prefix.exact_dtype is not None else None,
        "scales": len(prefix.scales),
        "meta": dict(prefix.meta),
        "payload_bytes": offset,
        "tensors": specs,
        "checksum": "crc32",
    }
    hbytes = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    hbytes += b" " * ((-(_PREAMBLE.size + len(hbytes))) % _ALIGN)  # the payload starts aligned
    blob = b"".join([_PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(hbytes)), hbytes, *parts])
    return blob + _CRC.pack(crc32(blob))


def _split(
    blob: bytes | bytearray | memoryview, body_crc: int | None = None
) -> tuple[dict[str, Any], memoryview]:
    """Checks framing and checksum (``body_crc``: that of ``blob[:-4]``, if known); returns the
    header and a view of the payload."""
    view = memoryview(blob)
    if len(view) < _PREAMBLE.size + _CRC.size:
        raise CodecError("truncated", f"{len(view)} bytes is shorter than the fixed framing")
    magic, version, hlen = _PREAMBLE.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError("bad_magic", f"magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise CodecError(
            "unsupported_version", f"format version {version}, this build reads {FORMAT_VERSION}"
        )
    hstart = _PREAMBLE.size
    if hstart + hlen + _CRC.size > len(view):
        raise CodecError("truncated", f"header of {hlen} bytes does not fit in {len(view)} bytes")
    try:
        header = json.loads(bytes(view[hstart : hstart + hlen]))
        if not isinstance(header, dict):
            raise TypeError("header is not an object")
        payload_bytes = int(header["payload_bytes"])
    except (ValueError, KeyError, TypeError) as e:
        raise CodecError("bad_header", f"unreadable header ({e})") from None
    end = hstart + hlen + payload_bytes
    if end + _CRC.size != len(view):
        kind = "truncated" if end + _CRC.size > len(view) else "bad_header"
        raise CodecError(kind, f"expected {end + _CRC.size} bytes, got {len(view)}")
    (crc,) = _CRC.unpack_from(view, end)
    if (crc32(view[:end]) if body_crc is None else body_crc) != crc:
        raise CodecError("checksum", "crc32 mismatch")
    return header, view[hstart + hlen : end]


def peek_header(blob: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The header of ``blob`` after checking framing and checksum."""
    return _split(blob)[0]


_Spec = tuple[str, torch.dtype, list[int], int, int, int]  # name, dtype, shape, offset, bytes, count


def _checked_spec(spec: Any, payload_bytes: int) -> _Spec:
    try:
        name = str(spec["name"])
        dtype = _DTYPES[spec["dtype"]]
        shape = [int(s) for s in spec["shape"]]
        offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise CodecError("bad_header", f"tensor spec {spec!r} ({e})") from None
    count = 1
    for s in shape:
        count *= s
    if (
        min(shape, default=0) < 0
        or count * dtype.itemsize != nbytes
        or offset < 0
        or offset + nbytes > payload_bytes
    ):
        raise CodecError("bad_header", f"tensor {name} does not fit the payload")
    return name, dtype, shape, offset, nbytes, count


def _runs(specs: list[_Spec]) -> list[list[_Spec]]:
    """Consecutive tensors of one dtype and shape that lie back to back: each run is read as one."""
    runs: list[list[_Spec]] = []
    for spec in specs:
        last = runs[-1][-1] if runs else None
        if last is not None and last[1:3] == spec[1:3] and last[3] + last[4] == spec[3]:
            runs[-1].append(spec)
        else:
            runs.append([spec])
    return runs


def decode(
    blob: bytes | bytearray | memoryview,
    expected_model_version: str | None = None,
    *,
    body_crc: int | None = None,
    owned: bool = False,
) -> PrefixKV:
    """Rebuild the ``PrefixKV`` in ``blob`` as CPU tensors (see the module docstring)."""
    header, payload = _split(blob, body_crc)
    if header.get("format") != FORMAT_VERSION:
        raise CodecError("unsupported_version", f"header format {header.get('format')!r}")
    try:
        model_version = str(header["model_version"])
        length = int(header["length"])
        fingerprint = bytes.fromhex(header["fingerprint"])
        num_layers = int(header["num_layers"])
        meta = {str(k): str(v) for k, v in dict(header["meta"]).items()}
        specs = list(header["tensors"])
        # Blobs written before the cold formats existed have none of these fields: exact.
        kv_format = str(header.get("kv_format", "exact"))
        num_scales = int(header.get("scales", 0))
        exact_name = header.get("exact_dtype")
        exact_dtype = None if exact_name is None else _DTYPES[exact_name]
    except (KeyError, TypeError, ValueError) as e:
        raise CodecError("bad_header", f"missing or malformed field ({e})") from None
    if expected_model_version is not None and model_version != expected_model_version:
        raise CodecError(
            "model_version", f"blob of model {model_version!r}, wanted {expected_model_version!r}"
        )
    if (
        len(fingerprint) != FINGERPRINT_BYTES
        or len(specs) != 2 * num_layers + num_scales + 2
        or length < 0
        or kv_format not in ("exact", "bf16", "int8")
        or num_scales != (2 * num_layers if kv_format == "int8" else 0)
        or (kv_format == "exact") != (exact_dtype is None)
    ):
        raise CodecError("bad_header", "inconsistent layer count, fingerprint, length or format")

    if owned and payload.readonly:
        raise ValueError("kv_codec: an owned blob must be writable")
    # At most one copy; every tensor views into it. An older blob's payload may start unaligned.
    aligned = owned and (len(blob) - len(payload) - _CRC.size) % _ALIGN == 0
    buf = payload if aligned else bytearray(payload)
    tensors: dict[str, torch.Tensor] = {}
    for run in _runs([_checked_spec(spec, len(buf)) for spec in specs]):
        _, dtype, shape, offset, _, count = run[0]
        if count == 0:
            tensors.update((r[0], torch.empty(shape, dtype=dtype)) for r in run)
            continue
        block = torch.frombuffer(buf, dtype=dtype, count=count * len(run), offset=offset)
        tensors.update(zip((r[0] for r in run), block.view(len(run), *shape).unbind(0), strict=True))
    try:
        keys = [tensors[f"k{i}"] for i in range(num_layers)]
        values = [tensors[f"v{i}"] for i in range(num_layers)]
        scales = [tensors[f"s{i}"] for i in range(num_scales)]
        positions, timestamps = tensors["positions"], tensors["timestamps"]
    except KeyError as e:
        raise CodecError("bad_header", f"missing tensor {e}") from None
    return PrefixKV(
        keys=keys,
        values=values,
        positions=positions,
        timestamps=timestamps,
        length=length,
        fingerprint=fingerprint,
        model_version=model_version,
        meta=meta,
        kv_format=kv_format,
        scales=scales,
        exact_dtype=exact_dtype,
    )
