"""GradHist2d keeps, beside its in-range counts, where Cockpit's clamping would count the
outside pairs (meta["clamped"]), so the Cockpit layer can show Cockpit's histogram."""

from __future__ import annotations

import numpy as np
import torch

from deepscope.instruments.histograms import Bins, histogram_2d

INF, NAN = float("inf"), float("nan")


def cockpit_reference(theta: np.ndarray, grads: np.ndarray) -> np.ndarray:
    """Brute force: every (θₐ, gᵢ,ₐ) pair with no NaN, each axis clamped to its outer bins'
    centres (θ: 4 bins on (−1, 1), g: 5 on (−2, 2)), then counted."""
    t = np.broadcast_to(theta, grads.shape).reshape(-1)
    g = grads.reshape(-1)
    keep = ~(np.isnan(t) | np.isnan(g))
    t, g = np.clip(t[keep], -0.75, 0.75), np.clip(g[keep], -1.6, 1.6)
    return np.histogram2d(t, g, bins=(4, 5), range=((-1, 1), (-2, 2)))[0].astype(np.int64)


def test_clamped_cells_complete_cockpits_histogram() -> None:
    theta = torch.tensor([-3.0, -0.5, 0.2, 0.9, INF, NAN])
    grads = torch.tensor([[5.0, -0.1, NAN, -7.0, 0.3, 1.0],
                          [-INF, 0.4, 1.9, 2.5, -0.2, 0.1],
                          [0.0, -2.5, 3.0, 1.0, INF, -1.0]])
    hist = histogram_2d(theta, grads, Bins(4, -1.0, 1.0), Bins(5, -2.0, 2.0))
    folded = hist.counts.copy()
    for (j, i), n in hist.clamped.items():
        assert j in (0, 3) or i in (0, 4)  # only edge bins receive clamped pairs
        folded[j, i] += n
    np.testing.assert_array_equal(folded, cockpit_reference(theta.numpy(), grads.numpy()))
    assert hist.counts.sum() < folded.sum()
    meta = (hist + hist).meta()["clamped"]
    assert meta == [[j, i, 2 * n] for (j, i), n in sorted(hist.clamped.items())]


def test_no_outside_pairs_no_clamped_meta() -> None:
    hist = histogram_2d(torch.tensor([0.1, -0.2]), torch.tensor([[0.5, -0.5]]),
                        Bins(4, -1.0, 1.0), Bins(5, -2.0, 2.0))
    assert hist.clamped == {} and "clamped" not in hist.meta()
