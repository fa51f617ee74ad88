"""The curvature quantities' work at a step (the stateful side of `curvature`): one
`HessianOperator` on the step's mean loss, the Hessian diagonal by the configured estimator
("auto" chooses once, by measured cost), the layer traces and the top eigenvalue, and the
merge of gradient-accumulation micro-batches."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...catalogue import needing
from ...hookstate import paused
from ..base import describe
from ..curvature import Estimate, HessianOperator, OverBudget, exact_diagonal
from .curvature import (
    EXACT_MAX_DIM,
    choose_diagonal,
    hess_max_ev,
    hess_trace,
    hessian_diagonal,
    over_budget,
)

CPU_PLAIN_HVP_DIM = 2**16  # from this many parameters on, HVPs one at a time on CPU
ESTIMATE_WARNING = ("; HessTrace and TIC are estimates: pass curvature='exact' "
                    "(instrument_options={'curvature': 'exact'}) to force the exact diagonal")


def hvp_seconds(op: HessianOperator, repeats: int = 5) -> float:
    """Seconds of one Hessian-vector product: the fastest of `repeats` timed ones, after one
    untimed (its first pass pays one-off costs; a busy machine only slows some)."""
    v = torch.ones(op.dim, dtype=op.dtype, device=op.device)
    times = []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        op.matvec(v).sum().item()  # waits for the device: the product's time, not its launch
        times.append(time.perf_counter() - began)
    return min(times[1:])


class CurvatureRunner:
    """HessTrace / HessMaxEV / the diagonal for TIC, step by step, for one model.

    Args:
        mode: "auto" | "exact" | "hutchinson" (see `Instruments`).
        samples: Hutchinson probes per step; lanczos_iter: Lanczos iterations per step.
        seed: base seed (step t uses seed + t).
        warn: called with a one-line message when "auto" settles for Hutchinson.
        timer, budget: "auto"'s yardsticks: seconds of one HVP (`hvp_seconds`) and the
            exact diagonal's budget from the forward's seconds (`diagonal_budget`).
    """

    def __init__(
        self,
        mode: str,
        samples: int,
        lanczos_iter: int,
        seed: int,
        warn: Callable[[str], None],
        timer: Callable[[HessianOperator], float],
        budget: Callable[[float], float],
    ) -> None:
        self.mode, self.samples, self.lanczos_iter, self.seed = mode, samples, lanczos_iter, seed
        self._warn, self._timer, self._budget = warn, timer, budget
        self._auto_diagonal: tuple[str, str] | None = None  # "auto"'s (estimator, why)
        self._hvp_batched: bool | None = None  # vmapped HVPs verified on this model

    def run(
        self, mean_loss: Tensor, params: list[Tensor], due: frozenset[str], step: int,
        forward_s: float,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The curvature of the `due` quantities at `step` from the mean loss (its graph
        still alive): ({"diagonal": per tensor, "traces": (K + 1,), "diagonal_meta": {...},
        "max_ev": (value, meta)}, whichever were computed; quantity -> reason it failed)."""
        due = due & needing("hessian")
        curvature: dict[str, Any] = {}
        failed: dict[str, str] = {}
        seed = (self.seed + step) % 2**31  # fresh probes each step, reproducibly
        try:
            # paused: every deepscope hook (engine, recorder, monitor) ignores these passes
            # on CPU, vmapped HVPs only pay while per-pass overhead dominates (2.7e5
            # parameters: two vmapped 8.0 ms, two plain 6.8 ms)
            dim = sum(p.numel() for p in params)
            one_by_one = 1 if mean_loss.device.type == "cpu" and dim >= CPU_PLAIN_HVP_DIM else None
            with paused(), HessianOperator(mean_loss, params, one_by_one,
                                           batched=self._hvp_batched) as op:
                if due & needing("diagonal"):
                    try:
                        diagonal, choice = self._diagonal(op, seed, step, forward_s)
                        curvature["diagonal"] = op.split(diagonal.value)
                        curvature["traces"] = hess_trace(op, diagonal.value)
                        curvature["diagonal_meta"] = {
                            "estimator": diagonal.estimator, "samples": diagonal.samples,
                            **({"choice": choice} if choice else {})}
                    except Exception as error:
                        failed.update(dict.fromkeys(due & needing("diagonal"), describe(error)))
                if "HessMaxEV" in due:
                    try:
                        curvature["max_ev"] = hess_max_ev(op, self.lanczos_iter, seed)
                    except Exception as error:
                        failed["HessMaxEV"] = describe(error)
                self._hvp_batched = op.batched  # checked once per model, not every step
        except Exception as error:  # e.g. the operator cannot be built
            failed.update(dict.fromkeys(due, describe(error)))
        return curvature, failed

    @staticmethod
    def merge(
        previous: dict[str, Any], current: dict[str, Any], before: int, added: int,
        due: frozenset[str],
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Fold a micro-batch's curvature (`current`, `added` samples) into that of the
        earlier ones (`previous`, `before` samples): the mean loss's Hessian over all samples
        is the sample-weighted mean of theirs, and the diagonal estimates are linear in it
        (with the same probes); the top eigenvalue is not. Returns (merged, failed)."""
        due = due & needing("hessian")
        failed: dict[str, str] = {}
        if "HessMaxEV" in due:
            failed["HessMaxEV"] = (
                "HessMaxEV needs the Hessian of the whole step's loss at once; with several "
                "rec.loss calls (gradient accumulation) each micro-batch's graph is freed by "
                "its backward: schedule it on steps without accumulation")
        if "diagonal" not in previous or "diagonal" not in current:
            return {}, failed  # the failing micro-batch's reason is in the failures already
        if previous["diagonal_meta"] != current["diagonal_meta"]:
            failed.update(dict.fromkeys(due & needing("diagonal"), (
                "the micro-batches' Hessian diagonals were estimated differently "
                f"({previous['diagonal_meta']} and {current['diagonal_meta']})")))
            return {}, failed
        w0, w1 = before / (before + added), added / (before + added)
        return {
            "diagonal": [w0 * a + w1 * b for a, b in zip(previous["diagonal"],
                                                          current["diagonal"])],
            "traces": w0 * previous["traces"] + w1 * current["traces"],
            "diagonal_meta": current["diagonal_meta"],
        }, failed

    def _diagonal(
        self, op: HessianOperator, seed: int, step: int, forward_s: float
    ) -> tuple[Estimate, str]:
        """diag(H) by the configured estimator, and (for "auto") why.

        "auto" decides at its first step by the measured cost of an HVP against the
        training step (see `choose_diagonal`), and still stops an exact diagonal that
        overruns its budget, then takes Hutchinson's from there on; it warns when it
        settles for Hutchinson.
        """
        samples = self.samples
        if self.mode != "auto":
            return hessian_diagonal(op, self.mode, samples, seed), ""
        timed = max(samples, op.batch_size) < op.dim  # else exact by count: one pass
        if self._auto_diagonal is None:
            hvp_s = self._timer(op) if timed and op.dim <= EXACT_MAX_DIM else math.nan
            self._auto_diagonal = choose_diagonal(op.dim, samples, hvp_s, forward_s,
                                                  one_pass=op.batch_size)
            if self._auto_diagonal[0] == "hutchinson":
                self._warn(self._auto_diagonal[1] + ESTIMATE_WARNING)
        mode, why = self._auto_diagonal
        if mode == "exact":
            try:
                budget = self._budget(forward_s) if timed else None
                return exact_diagonal(op, max_dim=op.dim, budget_s=budget), why
            except OverBudget as over:
                why = over_budget(op.dim, step, samples, over.projected_s, forward_s)
                self._auto_diagonal = "hutchinson", why
                self._warn(why + ESTIMATE_WARNING)
        return hessian_diagonal(op, "hutchinson", samples, seed), why
