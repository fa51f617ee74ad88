"""Compression of a step's array parts: how the bytes of one part are stored on disk.

A part is the raw little-endian bytes of arrays of one dtype (see `writer.StepSummary`). It is
stored under one of three codecs, named in the `step_blobs.codec` column:

- "raw": the bytes as they are;
- "zlib": a zlib stream (RFC 1950) of the bytes;
- "shuffle2-zlib": a zlib stream of the bytes byte-shuffled with element size 2 — all first
  (low) bytes of the 2-byte elements, then all second (high) bytes. The high bytes of
  bfloat16 values (sign and exponent) repeat a lot, so they compress about twice as well.

Decoding trusts nothing: the declared raw size bounds every allocation and is checked.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..errors import CorruptRunError

RAW, ZLIB, SHUFFLE2_ZLIB = "raw", "zlib", "shuffle2-zlib"
CODECS = (RAW, ZLIB, SHUFFLE2_ZLIB)
# Level 1: most of the gain of level 6 at a fraction of the time (about 1 ms per 50 kB).
LEVEL = 1
# Deflate cannot expand data more than about 1032-fold, so a larger declared size is a lie:
# what a file can make us inflate stays proportional to what it stores.
MAX_RATIO = 1032


def _shuffle2(data: bytes) -> bytes:
    """All even-indexed bytes, then all odd-indexed ones (`data` has an even length)."""
    return np.frombuffer(data, np.uint8).reshape(-1, 2).T.tobytes()


def _unshuffle2(data: bytes) -> bytes:
    """Inverse of `_shuffle2`."""
    return np.frombuffer(data, np.uint8).reshape(2, -1).T.tobytes()


def encode(data: bytes, itemsize: int) -> tuple[str, bytes]:
    """(codec, stored bytes) for a part whose elements are `itemsize` bytes each.

    2-byte elements are shuffled before zlib (shuffling does not help 4-byte floats, whose
    low mantissa bytes are noise); data that does not shrink is stored raw.
    """
    codec, stored = ZLIB, data
    if itemsize == 2 and len(data) % 2 == 0:
        codec, stored = SHUFFLE2_ZLIB, _shuffle2(data)
    packed = zlib.compress(stored, LEVEL)
    return (codec, packed) if len(packed) < len(data) else (RAW, data)


def decode(codec: object, raw_bytes: object, data: object, cap: int | None = None) -> bytes:
    """The raw bytes of a stored part; CorruptRunError (one line) if anything is off.

    cap: the most bytes the part may declare (the reader's `part_cap`); checked before
    anything is inflated.
    """
    if codec not in CODECS:
        raise CorruptRunError(f"stored step data has unknown codec {str(codec)[:32]!r}; the "
                              "file is corrupt or from a newer deepscope")
    if not isinstance(data, bytes):
        raise CorruptRunError("stored step data is not a blob; the file is corrupt")
    if not isinstance(raw_bytes, int) or raw_bytes < 0:
        raise CorruptRunError(f"stored step data declares an invalid size "
                              f"{str(raw_bytes)[:24]!r}; the file is corrupt")
    if cap is not None and raw_bytes > cap:
        raise CorruptRunError(f"stored step data declares {raw_bytes} bytes, more than the cap "
                              f"of {cap} for this file (see docs/LIMITATIONS.md); the file is "
                              "corrupt or crafted")
    if codec == RAW:
        out = data
    else:
        if raw_bytes > MAX_RATIO * len(data):
            raise CorruptRunError(f"stored step data declares {raw_bytes} bytes, more than "
                                  f"{len(data)} {codec} bytes can hold; the file is corrupt")
        inflater = zlib.decompressobj()
        try:
            # At most raw_bytes + 1 bytes come out: one more than declared proves a lie.
            out = inflater.decompress(data, raw_bytes + 1)
        except zlib.error as exc:
            raise CorruptRunError(f"stored step data is not a valid {codec} stream ({exc}); "
                                  "the file is corrupt") from None
        if len(out) == raw_bytes and not (inflater.eof and not inflater.unused_data):
            raise CorruptRunError(f"stored step data is a truncated {codec} stream or has "
                                  "bytes after it; the file is corrupt")
    if len(out) != raw_bytes:
        raise CorruptRunError(f"stored step data holds {len(out)} bytes, not the declared "
                              f"{raw_bytes}; the file is corrupt")
    if codec == SHUFFLE2_ZLIB:
        if raw_bytes % 2:
            raise CorruptRunError(f"stored step data has an odd length ({raw_bytes} bytes) for "
                                  "2-byte elements; the file is corrupt")
        out = _unshuffle2(out)
    return out
