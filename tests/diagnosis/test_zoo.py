"""The bug zoo: every code's bug is the top diagnosis (or second, behind a symptom it
genuinely causes), and its healthy twin gets no diagnosis above the reporting threshold."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepscope.diagnosis import CODES, THRESHOLD, diagnose

from .zoo import cases, train

CASES = cases()
# Codes a bug genuinely also causes, that may rank above it: a too-high learning rate kills
# ReLU units; raw pixels saturate the first layer they feed.
ALSO = {"lr_too_high": {"dead_units"}, "bad_input_scale": {"saturation"}}


def test_every_code_has_a_case() -> None:
    assert set(CASES) == set(CODES)


@pytest.mark.parametrize("code", list(CASES))
def test_bug_named_and_healthy_twin_clean(code: str, tmp_path: Path) -> None:
    _, bugged, healthy = CASES[code]
    torch.manual_seed(0)  # the same weights whichever cases run before
    with train(tmp_path, "bug", bugged()) as run:
        found = diagnose(run)
    codes = [d.code for d in found]
    assert codes, f"{code}: nothing diagnosed"
    top = codes[:2] if codes[0] in ALSO.get(code, set()) else codes[:1]
    assert code in top, (code, [(d.code, round(d.confidence, 2), d.where) for d in found])
    named = next(d for d in found if d.code == code)
    assert named.confidence >= THRESHOLD and named.evidence and named.fix and named.where
    torch.manual_seed(0)
    with train(tmp_path, "ok", healthy()) as run:
        clean = diagnose(run)
    assert not clean, (code, [(d.code, round(d.confidence, 2), d.summary) for d in clean])
