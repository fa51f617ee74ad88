"""Compressed step parts: the codec chosen per part, the exact byte layout, lossless reads."""

from __future__ import annotations

import re
import sqlite3
import zlib

import numpy as np
import pytest
import torch

import deepscope
from deepscope.recorder.stats import array_views
from deepscope.store import codecs

FLOATS = (np.arange(2000, dtype="<f4") / 7).tobytes()
BFLOAT16 = torch.arange(2000, dtype=torch.float32).div(7).to(torch.bfloat16) \
    .view(torch.int16).numpy().astype("<i2").tobytes()
NOISE = np.random.default_rng(0).bytes(4096)
# Like a ReLU's output: half the values 0, and the words that must survive as they are
RELU = np.maximum(np.random.default_rng(1).standard_normal(999), 0).astype("<f4")
RELU[:3] = [-0.0, np.nan, -np.inf]
SPARSE = RELU.tobytes()


@pytest.mark.parametrize("data, itemsize, legacy, codec", [
    (FLOATS, 4, False, "zlib"), (BFLOAT16, 2, False, "split2-zlib"), (NOISE, 4, False, "raw"),
    (NOISE, 2, False, "raw"), (b"", 2, False, "raw"), (bytes(1000), 8, False, "zlib"),
    (SPARSE, 4, False, "sparse4"), (bytes(1000), 4, False, "sparse4"),
    (SPARSE, 4, True, "zlib"), (BFLOAT16, 2, True, "shuffle2-zlib"), (FLOATS, 4, True, "zlib"),
], ids=["float32", "bfloat16", "noise", "noise-2-byte", "empty", "zeros", "relu", "zeros-4",
        "relu-v3", "bfloat16-v3", "float32-v3"])
def test_each_part_gets_its_codec_and_reads_back_exactly(data, itemsize, legacy, codec):
    got_codec, stored = codecs.encode(data, itemsize, legacy)
    assert got_codec == codec
    assert len(stored) <= len(data)
    assert codecs.decode(got_codec, len(data), stored) == data


def test_the_byte_shuffle_is_low_bytes_then_high_bytes():
    """The layouts docs/format.md promises: readable with zlib and numpy alone."""
    _, stored = codecs.encode(BFLOAT16, 2, legacy=True)
    shuffled = zlib.decompress(stored)
    assert shuffled == BFLOAT16[0::2] + BFLOAT16[1::2]
    halves = np.frombuffer(shuffled, np.uint8).reshape(2, -1)
    assert halves.T.tobytes() == BFLOAT16
    _, stored = codecs.encode(BFLOAT16, 2)  # split: the low bytes raw, then the high ones
    half = len(BFLOAT16) // 2
    assert stored[:half] == BFLOAT16[0::2]
    assert zlib.decompress(stored[half:]) == BFLOAT16[1::2]


def test_sparse4_is_a_bitmap_then_the_nonzero_words():
    codec, stored = codecs.encode(SPARSE, 4)
    words = np.frombuffer(SPARSE, "<u4")
    head = (words.size + 7) // 8
    bits = np.unpackbits(np.frombuffer(stored[:head], np.uint8), bitorder="little")
    np.testing.assert_array_equal(bits[:words.size], words != 0)
    assert not bits[words.size:].any()
    np.testing.assert_array_equal(np.frombuffer(stored[head:], "<u4"), words[words != 0])
    out = np.frombuffer(codecs.decode(codec, len(SPARSE), stored), "<f4")
    assert np.signbit(out[0]) and out[0] == 0 and np.isnan(out[1]) and out[2] == -np.inf


@pytest.mark.parametrize("codec, raw_bytes, data, message", [
    ("sparse4", 8, b"\x03", "holds 0 bytes of words, not the 8"),
    ("sparse4", 8, b"\x01" + bytes(8), "holds 8 bytes of words, not the 4"),
    ("sparse4", 80, b"", "shorter (0 bytes) than its bitmap (3 bytes)"),
    ("sparse4", 6, b"\x01" + bytes(4), "not a whole number of 4-byte words"),
    ("split2-zlib", 7, bytes(8), "odd length"),
    ("split2-zlib", 8, bytes(3), "shorter (3 bytes) than its low bytes (4)"),
    ("split2-zlib", 8, bytes(4) + zlib.compress(bytes(5)), "holds 5 bytes, not the declared 4"),
    ("split2-zlib", 8, bytes(4) + zlib.compress(bytes(3)), "holds 3 bytes, not the declared 4"),
], ids=["bitmap-without-words", "more-words", "short-bitmap", "partial-word", "odd",
        "short-low", "high-too-long", "high-too-short"])
def test_new_codecs_refuse_damaged_parts_in_one_line(codec, raw_bytes, data, message):
    with pytest.raises(deepscope.CorruptRunError, match=re.escape(message)):
        codecs.decode(codec, raw_bytes, data)


@pytest.mark.parametrize("exact", [False, True], ids=["bfloat16-views", "exact-views"])
def test_every_view_reads_back_what_was_recorded(tmp_path, exact):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 40, generator=gen)
    h = x.round(decimals=1).relu()  # half zeros, like a ReLU's output: compressible
    w = torch.randn(12, 5, generator=gen)
    with deepscope.Scope(tmp_path, "r", schedule=1, max_samples=3, exact_views=exact) as scope:
        with scope.step(0) as rec:
            rec.tensor("x", x, role="input")
            rec.tensor("h", h)
            rec.tensor("w", w, role="parameter")
    run = deepscope.open_run(tmp_path / "r")
    for name, tensor, batch_dim in (("x", x, 0), ("h", h, 0), ("w", w, None)):
        want = array_views(tensor, batch_dim, max_samples=3)
        assert run.views(name, 0) == sorted(want)
        for view, expected in want.items():
            got = run.values(name, 0, view=view)
            if view == "samples":
                np.testing.assert_array_equal(got, expected.numpy())
            elif exact:
                np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-7)
            else:  # one bfloat16 rounding, nothing more
                np.testing.assert_allclose(got, expected.numpy(), rtol=2**-8, atol=1e-7)
    con = sqlite3.connect(tmp_path / "r" / "rank0.sqlite")
    stored = con.execute("SELECT part, codec FROM step_blobs ORDER BY part").fetchall()
    con.close()
    # mostly-zero samples compressed, dense float32 samples raw, views compressed
    assert stored == [(0, "sparse4"), (1, "raw"), (2, "zlib" if exact else "split2-zlib")]


def test_views_of_one_step_decompress_each_part_once(tmp_path, monkeypatch):
    with deepscope.Scope(tmp_path, "r", schedule=1) as scope:
        for step in range(2):
            with scope.step(step) as rec:
                rec.tensor("x", torch.zeros(8, 30), role="input")  # zeros: one samples part
    calls = []
    real = codecs.decode
    monkeypatch.setattr(codecs, "decode", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    run = deepscope.open_run(tmp_path / "r")
    for step in (0, 1, 0):
        for view in run.views("x", step):
            run.values("x", step, view=view)
    assert len(calls) == 4  # two parts per step; step 0 again comes from the cache
