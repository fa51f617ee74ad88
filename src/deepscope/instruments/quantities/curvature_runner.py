"""The curvature quantities' work at a step (the stateful side of `curvature`): one
`HessianOperator` on the step's mean loss, the Hessian diagonal by the configured estimator
("auto" chooses once, by measured cost), the layer traces and the top eigenvalue, and the
merge of gradient-accumulation micro-batches.

Distributed runs (a `Reducer`): the values mean the global batch of all ranks (see
DISTRIBUTED.md). The diagonal's estimators are linear in H with the same seeded probes on
every rank, so each rank computes additive partials of its micro-batch's summed loss
(n_r · diag H_r, or only its per-tensor sums when no TICDiag is due); the caller sums them
over ranks in its one packed all-reduce and `finalize` divides by N. HessMaxEV runs Lanczos
on the global Hessian, one all-reduce per iteration (`GlobalHessian`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...catalogue import needing
from ...distributed import Reducer
from ...hookstate import paused
from ..base import describe
from ..curvature import (
    Estimate,
    HessianOperator,
    OverBudget,
    exact_diagonal,
    hutchinson_diagonal,
)
from ..curvature.global_hessian import GlobalHessian, RankFailure, rank_failures, reason_codes
from ..curvature.operator import hvp_batch_size
from .curvature import (
    EXACT_MAX_DIM,
    choose_diagonal,
    hess_trace,
    hessian_diagonal,
    over_budget,
    top_eigenvalue,
)
from .norms import with_total

CPU_PLAIN_HVP_DIM = 2**16  # from this many parameters on, HVPs one at a time on CPU
MAX_EV_ACCUMULATED = (
    "HessMaxEV needs the Hessian of the whole step's loss at once; with several rec.loss "
    "calls (gradient accumulation) each micro-batch's graph is freed by its backward: "
    "schedule it on steps without accumulation")
FAILURES = "diagonal_failures"  # the partials' key of each rank's failure reason
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
        reducer: deepscope's collectives in a distributed run (values over the global
            batch: see `run` and `finalize`), or None.
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
        reducer: Reducer | None = None,
    ) -> None:
        self.mode, self.samples, self.lanczos_iter, self.seed = mode, samples, lanczos_iter, seed
        self._warn, self._timer, self._budget = warn, timer, budget
        self.reducer = reducer
        self._shapes: list[torch.Size] = []  # the parameters' shapes, for `finalize`
        self._step: dict[str, Any] = {}  # this rank's step so far: "diagonal_meta", "max_ev"
        self._auto_diagonal: tuple[str, str] | None = None  # "auto"'s (estimator, why)
        self._hvp_batched: bool | None = None  # vmapped HVPs verified on this model
        # the last run's parameters its loss does not reach (see HessianOperator.unreached)
        self.unreached: list[Tensor] = []
        self._ritz: Tensor | None = None  # the last HessMaxEV's top Ritz vector: a warm start

    def run(
        self, mean_loss: Tensor, params: list[Tensor], due: frozenset[str], step: int,
        forward_s: float, batch_size: int | None = None,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The curvature of the `due` quantities at `step` from the mean loss (its graph
        still alive): ({"diagonal": per tensor, "traces": (K + 1,), "diagonal_meta": {...},
        "max_ev": (value, meta)}, whichever were computed; quantity -> reason it failed).

        With a reducer, call it on every rank with the same `due` and `step`, and pass
        `batch_size` (n_r, this rank's samples in `mean_loss`). HessMaxEV is then the global
        batch's (one all-reduce per Lanczos iteration, here). The diagonal comes as
        "partials": float64 tensors whose keys and shapes depend only on the parameters and
        the due quantities, the same on every rank whatever fails (a rank's failure travels
        as its reason in them; {} when no diagonal is due); sum them over ranks, in one
        call with the step's other sums, and pass the sums to `finalize`. "auto" agrees on
        its estimator with one MAX all-reduce at its first step (when decided by time); it
        does not stop an exact diagonal over budget later.
        """
        due = due & needing("hessian")
        if self.reducer is not None:
            if batch_size is None:
                raise TypeError("CurvatureRunner.run needs batch_size= with a reducer")
            return self._run_global(mean_loss, params, due, step, forward_s, batch_size)
        curvature: dict[str, Any] = {}
        failed: dict[str, str] = {}
        seed = (self.seed + step) % 2**31  # fresh probes each step, reproducibly
        try:
            # paused: every deepscope hook (engine, recorder, monitor) ignores these passes
            # on CPU, vmapped HVPs only pay while per-pass overhead dominates (2.7e5
            # parameters: two vmapped 8.0 ms, two plain 6.8 ms)
            dim = sum(p.numel() for p in params)
            one_by_one = 1 if mean_loss.device.type == "cpu" and dim >= CPU_PLAIN_HVP_DIM else None
            self.unreached = []
            with paused(), HessianOperator(mean_loss, params, one_by_one,
                                           batched=self._hvp_batched) as op:
                self.unreached = [params[i] for i in op.unreached]
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
                        curvature["max_ev"] = self._max_ev(op, seed)
                    except Exception as error:
                        failed["HessMaxEV"] = describe(error)
                self._hvp_batched = op.batched  # checked once per model, not every step
        except Exception as error:  # e.g. the operator cannot be built
            failed.update(dict.fromkeys(due, describe(error)))
        return curvature, failed

    def _run_global(
        self, mean_loss: Tensor, params: list[Tensor], due: frozenset[str], step: int,
        forward_s: float, batch_size: int,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """`run` with a reducer. Every rank issues the same collectives whatever fails
        locally (a failure travels as its reason), so no rank waits for another in vain."""
        curvature: dict[str, Any] = {}
        failed: dict[str, str] = {}
        seed = (self.seed + step) % 2**31  # the same probes on every rank
        self._shapes = [p.shape for p in params]
        dim = sum(p.numel() for p in params)
        one_by_one = 1 if mean_loss.device.type == "cpu" and dim >= CPU_PLAIN_HVP_DIM else None
        op, reason = None, ""
        self.unreached = []
        with paused():
            try:
                op = HessianOperator(mean_loss, params, one_by_one, batched=self._hvp_batched)
                self.unreached = [params[i] for i in op.unreached]
            except Exception as error:
                reason = describe(error)
            try:
                if due & needing("diagonal"):
                    curvature.update(self._partials(
                        op, reason, due, seed, forward_s, batch_size,
                        one_by_one or hvp_batch_size(dim), dim, mean_loss.device))
                if "HessMaxEV" in due:
                    global_op = GlobalHessian(op, self.reducer, batch_size, dim,
                                              mean_loss.dtype, mean_loss.device, reason)
                    try:
                        curvature["max_ev"] = self._max_ev(global_op, seed)
                    except RankFailure as error:  # the same line on every rank
                        failed["HessMaxEV"] = str(error)
                    except Exception as error:
                        failed["HessMaxEV"] = describe(error)
            finally:
                if op is not None:
                    self._hvp_batched = op.batched
                    op.release()
        curvature.setdefault("partials", {})
        self._step = {k: v for k, v in curvature.items() if k != "partials"}
        return curvature, failed

    def _max_ev(self, op: HessianOperator | GlobalHessian, seed: int) -> tuple[float, dict]:
        """HessMaxEV's (value, meta), warm-started from the previous one's top Ritz vector.
        In a distributed run that vector comes from the same reduced products on every
        rank, so every rank starts, iterates and stops alike."""
        start = self._ritz if self._ritz is not None and self._ritz.shape == (op.dim,) \
            else None
        self._ritz = None  # a failure below leaves no stale start
        value, meta, self._ritz = top_eigenvalue(op, self.lanczos_iter, seed, start)
        return value, meta

    def _partials(
        self, op: HessianOperator | None, reason: str, due: frozenset[str], seed: int,
        forward_s: float, batch_size: int, one_pass: int, dim: int, device: torch.device,
    ) -> dict[str, Any]:
        """This rank's additive share of the global diagonal (or of its per-tensor sums)
        and its failure reason, as {"partials": {...}, "diagonal_meta": {...}}."""
        estimator: str | None = self.mode
        why = ""
        if self.mode == "auto":
            if self._auto_diagonal is None:
                estimator, why, reason = self._agree_on_diagonal(op, reason, forward_s,
                                                                 one_pass, dim)
            else:
                estimator, why = self._auto_diagonal
        local = torch.zeros(dim, dtype=torch.float64, device=device)
        if estimator is not None and not reason:
            try:  # no budget stop: ranks would stop at different blocks
                value = (exact_diagonal(op, max_dim=dim) if estimator == "exact"
                         else hutchinson_diagonal(op, self.samples, seed)).value
                local.copy_(value).mul_(batch_size)
            except Exception as error:
                reason = describe(error)
                local.zero_()
        share = local if "TICDiag" in due else torch.stack(
            [seg.sum() for seg in local.split([s.numel() for s in self._shapes])])
        meta = {"estimator": estimator or "undecided",
                "samples": dim if estimator == "exact" else self.samples,
                **({"choice": why} if why else {})}
        return {"partials": {
                    "diagonal" if "TICDiag" in due else "traces": share,
                    FAILURES: reason_codes(self.reducer.rank, self.reducer.world_size, reason)},
                "diagonal_meta": meta}

    def _agree_on_diagonal(
        self, op: HessianOperator | None, reason: str, forward_s: float, one_pass: int,
        dim: int,
    ) -> tuple[str | None, str, str]:
        """"auto"'s estimator, the same on every rank: decided by count, or by the slowest
        rank's HVP and forward (one MAX all-reduce, at the first curvature step only).
        Returns (estimator, why, this rank's failure reason); estimator None: undecided,
        as some rank could not time an HVP (its reason fails the diagonal on every rank)."""
        timed = max(self.samples, one_pass) < dim
        hvp_s = math.nan
        if timed and dim <= EXACT_MAX_DIM:
            if not reason:
                try:
                    hvp_s = self._timer(op)
                except Exception as error:
                    reason = describe(error)
            costs = torch.tensor([hvp_s if not reason else math.inf, forward_s,
                                  1.0 if reason else 0.0], dtype=torch.float64)
            try:
                (costs,) = self.reducer.max([costs])
            except Exception as error:
                return None, "", describe(error)
            if costs[2]:  # a rank could not time it: decide at a later step
                return None, "", reason
            hvp_s, forward_s = float(costs[0]), float(costs[1])
        self._auto_diagonal = choose_diagonal(dim, self.samples, hvp_s, forward_s,
                                              one_pass=one_pass)
        if self._auto_diagonal[0] == "hutchinson":
            self._warn(self._auto_diagonal[1] + ESTIMATE_WARNING)
        return (*self._auto_diagonal, reason)

    def finalize(self, reduced: dict[str, Tensor], total_samples: int) -> dict[str, Any]:
        """The global batch's curvature, the same on every rank, without collectives.

        Args:
            reduced: the step's "partials" (of `run`, or `merge` of several micro-batches)
                summed over ranks, same keys.
            total_samples: N, the global batch's samples.
        Returns:
            {"diagonal": per tensor (float64), "traces": (K + 1,), "diagonal_meta": {...},
            "max_ev": (value, meta)}, whichever this step computed (as `run` without a
            reducer).
        Raises:
            RuntimeError: the diagonal failed on some rank (one line naming the ranks and
                their reasons).
        """
        out = dict(self._step)
        if not reduced:
            return out
        failures = rank_failures(reduced[FAILURES])
        if failures:
            raise RuntimeError("the Hessian diagonal " + failures)
        if "diagonal" in reduced:
            flat = reduced["diagonal"] / total_samples
            out["diagonal"] = [seg.view(shape) for seg, shape in zip(
                flat.split([s.numel() for s in self._shapes]), self._shapes)]
            out["traces"] = with_total(torch.stack([seg.sum() for seg in out["diagonal"]]))
        else:
            out["traces"] = with_total(reduced["traces"] / total_samples)
        return out

    def merge(
        self, previous: dict[str, Any], current: dict[str, Any], before: int, added: int,
        due: frozenset[str],
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Fold a micro-batch's curvature (`current`, `added` samples) into that of the
        earlier ones (`previous`, `before` samples): the mean loss's Hessian over all samples
        is the sample-weighted mean of theirs, and the diagonal estimates are linear in it
        (with the same probes); the top eigenvalue is not. Returns (merged, failed)."""
        due = due & needing("hessian")
        failed: dict[str, str] = {}
        if "HessMaxEV" in due:
            failed["HessMaxEV"] = MAX_EV_ACCUMULATED
        if "partials" in current:  # distributed: sums over samples, which simply add
            merged = {key: previous["partials"][key] + value
                      for key, value in current["partials"].items() if key != FAILURES}
            if FAILURES in current["partials"]:  # the first failure's reason, not a sum
                earlier = previous["partials"][FAILURES]
                merged[FAILURES] = earlier if earlier.any() else current["partials"][FAILURES]
            self._step.pop("max_ev", None)  # not the whole step's
            kept = {key: value for key, value in current.items() if key != "max_ev"}
            return {**kept, "partials": merged}, failed
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
