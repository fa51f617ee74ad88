"""Compression of a step's array parts: how the bytes of one part are stored on disk.

A part is the raw little-endian bytes of arrays of one dtype (see `writer.StepSummary`). It is
stored under one of five codecs, named in the `step_blobs.codec` column:

- "raw": the bytes as they are;
- "zlib": a zlib stream (RFC 1950) of the bytes;
- "shuffle2-zlib": a zlib stream of the bytes byte-shuffled with element size 2 — all first
  (low) bytes of the 2-byte elements, then all second (high) bytes. The high bytes of
  bfloat16 values (sign and exponent) repeat a lot, so they compress about twice as well.
- "split2-zlib" (schema version 4): the low bytes of the 2-byte elements as they are, then a
  zlib stream of the high bytes. The low bytes (mantissa bits) hardly compress: leaving them
  out (and matching runs only) takes ~40% of the time of "shuffle2-zlib", for ~17% more bytes.
- "sparse4" (schema version 4): for the n 4-byte words of the part, a bitmap of ceil(n / 8)
  bytes (bit i, least significant first, set where word i is not all zero bits), then the
  words that are not, in order. Mostly-zero float32 values (ReLU outputs) shrink more than
  under zlib, at a tenth of the time; -0.0 and NaN words are kept as they are.

Files of schema versions 2 and 3 are written with the first three only (`legacy=True`), so
a deepscope that reads those versions still reads them after a resume.

Decoding trusts nothing: the declared raw size bounds every allocation and is checked.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..errors import CorruptRunError

RAW, ZLIB, SHUFFLE2_ZLIB = "raw", "zlib", "shuffle2-zlib"
SPLIT2_ZLIB, SPARSE4 = "split2-zlib", "sparse4"
CODECS = (RAW, ZLIB, SHUFFLE2_ZLIB, SPLIT2_ZLIB, SPARSE4)
# Level 1: most of the gain of level 6 at a fraction of the time (about 1 ms per 50 kB).
LEVEL = 1
# Deflate cannot expand data more than about 1032-fold, so a larger declared size is a lie:
# what a file can make us inflate stays proportional to what it stores.
MAX_RATIO = 1032
# A 4-byte part with at least this fraction of all-zero words is stored "sparse4" (below it,
# zlib finds more to gain than the bitmap costs).
SPARSE4_ZEROS = 0.125


def _shuffle2(data: bytes) -> bytes:
    """All even-indexed bytes, then all odd-indexed ones (`data` has an even length)."""
    return np.frombuffer(data, np.uint8).reshape(-1, 2).T.tobytes()


def _unshuffle2(data: bytes) -> bytes:
    """Inverse of `_shuffle2`."""
    return np.frombuffer(data, np.uint8).reshape(2, -1).T.tobytes()


def _sparse4(data: bytes) -> bytes | None:
    """The "sparse4" form of `data` (a multiple of 4 bytes), or None if too few words are 0."""
    words = np.frombuffer(data, np.uint32)
    nonzero = words != 0
    kept = int(np.count_nonzero(nonzero))
    if kept > (1 - SPARSE4_ZEROS) * words.size:
        return None
    return np.packbits(nonzero, bitorder="little").tobytes() + words[nonzero].tobytes()


def _unsparse4(data: bytes, raw_bytes: int) -> bytes:
    """Inverse of `_sparse4`, for a part of `raw_bytes` bytes; checked against `data`."""
    if raw_bytes % 4:
        raise CorruptRunError(f"stored step data has a length ({raw_bytes} bytes) that is not "
                              "a whole number of 4-byte words; the file is corrupt")
    n = raw_bytes // 4
    head = (n + 7) // 8
    if len(data) < head:
        raise CorruptRunError(f"stored {SPARSE4} step data is shorter ({len(data)} bytes) than "
                              f"its bitmap ({head} bytes); the file is corrupt")
    nonzero = np.unpackbits(np.frombuffer(data, np.uint8, head), count=n,
                            bitorder="little").view(bool)
    kept = int(np.count_nonzero(nonzero))
    if len(data) != head + 4 * kept:
        raise CorruptRunError(f"stored {SPARSE4} step data holds {len(data) - head} bytes of "
                              f"words, not the {4 * kept} its bitmap marks; the file is corrupt")
    words = np.zeros(n, np.uint32)
    words[nonzero] = np.frombuffer(data, np.uint32, kept, head)
    return words.tobytes()


def encode(data: bytes, itemsize: int, legacy: bool = False) -> tuple[str, bytes]:
    """(codec, stored bytes) for a part whose elements are `itemsize` bytes each.

    2-byte elements: their high bytes go through zlib, the low ones (noise) are kept as they
    are; 4-byte elements with enough zero words are stored as a bitmap and the other words;
    the rest through zlib. Data that does not shrink is stored raw. legacy: only the codecs
    of schema versions 2 and 3 (2-byte elements shuffled, then zlib).
    """
    if itemsize == 2 and len(data) % 2 == 0:
        if legacy:
            return _smaller(SHUFFLE2_ZLIB, zlib.compress(_shuffle2(data), LEVEL), data)
        pairs = np.frombuffer(data, np.uint8).reshape(-1, 2)
        # Run-length matches only: the high bytes (sign, exponent) repeat in runs; a tenth
        # more bytes than a full search, at two thirds of the time.
        packer = zlib.compressobj(LEVEL, zlib.DEFLATED, zlib.MAX_WBITS, 8, zlib.Z_RLE)
        high = packer.compress(np.ascontiguousarray(pairs[:, 1])) + packer.flush()
        return _smaller(SPLIT2_ZLIB, b"".join((pairs[:, 0].tobytes(), high)), data)
    if itemsize == 4 and len(data) % 4 == 0 and not legacy:
        sparse = _sparse4(data)
        if sparse is not None:
            return _smaller(SPARSE4, sparse, data)
    return _smaller(ZLIB, zlib.compress(data, LEVEL), data)


def _smaller(codec: str, stored: bytes, data: bytes) -> tuple[str, bytes]:
    """(codec, stored) if that is smaller than the raw `data`, else (RAW, data)."""
    return (codec, stored) if len(stored) < len(data) else (RAW, data)


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
    if codec in (SHUFFLE2_ZLIB, SPLIT2_ZLIB) and raw_bytes % 2:
        raise CorruptRunError(f"stored step data has an odd length ({raw_bytes} bytes) for "
                              "2-byte elements; the file is corrupt")
    if codec == RAW:
        out = data
    elif codec == SPARSE4:
        out = _unsparse4(data, raw_bytes)
    elif codec == SPLIT2_ZLIB:
        half = raw_bytes // 2
        if len(data) < half:
            raise CorruptRunError(f"stored {codec} step data is shorter ({len(data)} bytes) "
                                  f"than its low bytes ({half}); the file is corrupt")
        out = data[:half] + _inflate(codec, half, data[half:])
    else:
        out = _inflate(codec, raw_bytes, data)
    if len(out) != raw_bytes:
        raise CorruptRunError(f"stored step data holds {len(out)} bytes, not the declared "
                              f"{raw_bytes}; the file is corrupt")
    if codec in (SHUFFLE2_ZLIB, SPLIT2_ZLIB):
        out = _unshuffle2(out)
    return out


def _inflate(codec: str, raw_bytes: int, data: bytes) -> bytes:
    """The bytes of the zlib stream `data`, which must hold exactly `raw_bytes` of them."""
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
    return out
