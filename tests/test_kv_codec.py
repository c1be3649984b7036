"""The disk format of a PrefixKV: exact round trip, and every damaged blob rejected with a reason."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch

from relaygr.workers.prefix_kv import Events, PrefixKV, history_fingerprint
from relaygr.workers.store import kv_codec
from relaygr.workers.store.kv_codec import CodecError, decode, encode, peek_header


def _prefix(n: int, *, layers: int = 3, dtype: torch.dtype = torch.float32, mv: str = "m1") -> PrefixKV:
    g = torch.Generator().manual_seed(n)
    history = Events.from_lists(list(range(n)), [1000.0 + i for i in range(n)])
    return PrefixKV(
        keys=[torch.randn(2, n, 8, generator=g).to(dtype) for _ in range(layers)],
        values=[torch.randn(2, n, 6, generator=g).to(dtype) for _ in range(layers)],
        positions=torch.arange(n, dtype=torch.int64),
        timestamps=history.timestamps.clone(),
        length=n,
        fingerprint=history_fingerprint(history),
        model_version=mv,
        meta={"chunk": "256"},
    )


def _assert_same(a: PrefixKV, b: PrefixKV) -> None:
    assert (a.length, a.fingerprint, a.model_version, a.meta) == (
        b.length,
        b.fingerprint,
        b.model_version,
        b.meta,
    )
    assert len(a.keys) == len(b.keys) and len(a.values) == len(b.values)
    for x, y in zip(
        [*a.keys, *a.values, a.positions, a.timestamps],
        [*b.keys, *b.values, b.positions, b.timestamps],
        strict=True,
    ):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 37])
def test_round_trip_is_exact(dtype: torch.dtype, n: int) -> None:
    p = _prefix(n, dtype=dtype)
    q = decode(encode(p), expected_model_version="m1")
    _assert_same(p, q)
    assert q.nbytes() == p.nbytes()
    # the decoded tensors are writable and independent of the blob
    if n:
        q.keys[0].add_(1)


def test_header_describes_the_blob() -> None:
    h = peek_header(encode(_prefix(5, dtype=torch.bfloat16)))
    assert h["format"] == kv_codec.FORMAT_VERSION
    assert h["kv_dtype"] == "bfloat16" and h["model_version"] == "m1" and h["length"] == 5
    assert h["checksum"] == "crc32"
    assert [t["shape"] for t in h["tensors"]][:1] == [[2, 5, 8]]


def test_truncation_anywhere_is_rejected() -> None:
    blob = encode(_prefix(9))
    for cut in sorted({0, 1, 5, 10, len(blob) // 3, len(blob) // 2, len(blob) - 5, len(blob) - 1}):
        with pytest.raises(CodecError) as e:
            decode(blob[:cut])
        assert e.value.reason in ("truncated", "checksum", "bad_header")


def test_flipped_bytes_fail_the_checksum() -> None:
    blob = bytearray(encode(_prefix(9)))
    for pos in (len(blob) // 2, len(blob) - 10, 40):
        bad = bytearray(blob)
        bad[pos] ^= 0x5A
        with pytest.raises(CodecError) as e:
            decode(bytes(bad))
        assert e.value.reason in ("checksum", "bad_header")


def test_bad_magic_version_and_model() -> None:
    blob = encode(_prefix(3))
    with pytest.raises(CodecError, match="bad_magic"):
        decode(b"XXXX" + blob[4:])
    with pytest.raises(CodecError, match="unsupported_version"):
        decode(blob[:4] + struct.pack("<H", 99) + blob[6:])
    with pytest.raises(CodecError) as e:
        decode(blob, expected_model_version="m2")
    assert e.value.reason == "model_version"


def test_well_framed_but_inconsistent_header_is_rejected() -> None:
    # A header that passes the checksum but lies about a tensor (e.g. written by a buggy build).
    blob = encode(_prefix(4))
    (hlen,) = struct.unpack_from("<I", blob, 6)
    header = json.loads(blob[10 : 10 + hlen])
    payload = blob[10 + hlen : -4]
    header["tensors"][0]["shape"] = [2, 4, 9]
    hb = json.dumps(header).encode()
    body = blob[:6] + struct.pack("<I", len(hb)) + hb + payload
    with pytest.raises(CodecError) as e:
        decode(body + struct.pack("<I", zlib.crc32(body)))
    assert e.value.reason == "bad_header"
