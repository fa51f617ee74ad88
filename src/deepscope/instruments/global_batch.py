"""Instrument values over the global batch of a distributed run (see DISTRIBUTED.md): the
value on ranks with micro-batches b₁, …, b_W is the single-process value on their
concatenation.

Each rank computes additive statistics of its own micro-batch(es), and ONE packed SUM
all-reduce per instrumented step (`Reducer.sum`, "phase 1") carries them all: samples and
loss moments per rank, Σᵢgᵢ (D values), Σᵢ‖gᵢ‖² per layer, Σᵢgᵢ,ₐ² (D, when a quantity
needs it), histogram class counts, α's slope moments, the curvature runner's partial sums,
which parameters lack gᵢ on which rank, and which quantities failed on which rank. The
layout depends only on the due quantities, the parameter shapes and the bins, so it is the
same on every rank whatever failed locally: a rank whose statistic failed sends zeros and
raises its flag, and every rank reports that quantity missing, naming the rank.

InnerTest and OrthoTest need Σᵢ(gᵢᵀḡ)² with the global ḡ, unknown before the call. They
are taken with ḡ_spec = the parameters' `.grad` at finish() (under DDP the synced mean) and
kept when, after the call, ḡ_spec = c·ḡ on every rank for one factor c (loss scaling, 1/k,
clipping, a sum loss), rescaled by 1/c²; otherwise (unequal batch sizes, no `.grad`, a comm
hook) a second call carries them with the exact ḡ = ΣᵣΣᵢgᵢ / N. Distance and UpdateSize
need no collective: parameters are replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..catalogue import needing, spec
from ..distributed import CollectiveError, Reducer
from . import alpha
from .alpha import AlphaStart
from .base import QuantityValue, describe
from .histograms import EXTRAS, histogram_of_table, symmetric_bins
from .histograms.per_step import histogram_counters, histogram_values, local_abs_max
from .quantities import inner_test_of_sums, ortho_test_of_sums, with_total
from .quantities.norms import squared_norms
from .step import ZERO_MEAN, StepState, missing, rows, zero_mean

if TYPE_CHECKING:
    from .batch import Batch

ALPHA_END = "Alpha (end point)"  # the previous step's α, measured at this one
REPLICATED = frozenset({"Distance", "UpdateSize"})  # from the replicated parameters
# The statistics each quantity needs over the global batch ("moments": samples and the loss
# moments of each rank, always sent; "start" / "end": α's slopes along this step's / the
# previous step's update, in the same block).
NEEDS: dict[str, tuple[str, ...]] = {
    "Loss": ("moments",),
    "GradNorm": ("grad_sum",),
    "NormTest": ("grad_sum", "sq_norm_sums"),
    "InnerTest": ("grad_sum", "dots"),
    "OrthoTest": ("grad_sum", "sq_norm_sums", "dots"),
    "GradHist1d": ("hist1d",),
    "GradHist2d": ("hist2d",),
    "Alpha": ("moments", "start"),
    ALPHA_END: ("moments", "end"),
    "MeanGSNR": ("grad_sum", "second_moments"),
    "EarlyStopping": ("grad_sum", "second_moments"),
    "CABS": ("grad_sum", "sq_norm_sums", "moments"),
    "TICDiag": ("second_moments", "curvature"),
    "TICTrace": ("second_moments", "curvature"),
    "HessTrace": ("curvature",),
    "HessMaxEV": ("curvature",),
}
# moments block columns: samples, then (mean, M2) of ℓᵢ, of α's start slopes, of its end slopes
_N, _LOSS, _START, _END = 0, 1, 3, 5
_MOMENT_COLUMNS = 7
SPEC_ULPS = 256  # ḡ_spec = c·ḡ within this many units of round-off (norm-wise)
LOSS_NEEDS_PER_SAMPLE = ("the global Loss needs the per-sample losses on every rank, to weigh "
                         "the ranks by their samples: rec.loss(loss, per_sample=losses)")
NO_GLOBAL_CURVATURE = ("curvature over the global batch needs a curvature runner that leaves "
                       "partial sums (this one does not); it is not computed on one rank's "
                       "micro-batch instead")


def _not_global(name: str) -> str:
    return (f"{name} is not computed over the global batch of a distributed run (only "
            "the built-in quantities are); pass distributed=False for per-rank values")


@dataclasses.dataclass
class GlobalBatch:
    """What `Batch` offers the compute functions, over the global batch (float64).

    size: N, the samples of all ranks; grad_mean: ḡ per parameter tensor; sq_norm_sums:
    (K,) Σᵢ‖gᵢ‖²; second_moment_sums: Σᵢgᵢ² per tensor; lacking / lacking_sum: parameter
    -> why its gᵢ / its ḡ is missing on some rank.
    """

    size: int
    grad_mean: list[Tensor] | None
    sq_norm_sums: Tensor | None
    second_moment_sums: list[Tensor] | None
    lacking: dict[str, str]
    lacking_sum: dict[str, str]

    @cached_property
    def grad_sq_norms(self) -> Tensor:
        """(K,) ‖ḡ⁽ᵏ⁾‖²."""
        return squared_norms(self.grad_mean)

    def unavailable(self) -> dict[str, str]:
        return dict(self.lacking)

    def unavailable_sum(self) -> dict[str, str]:
        return dict(self.lacking_sum)


class _Pack:
    """The tensors of one packed SUM all-reduce, in a fixed order (float64 zeros, filled
    in place); a block has one row per rank and this rank fills its own."""

    def __init__(self, reducer: Reducer) -> None:
        self.reducer = reducer
        self.tensors: dict[str, Tensor] = {}

    def add(self, key: str, shape: tuple[int, ...], device: torch.device | str = "cpu") -> Tensor:
        self.tensors[key] = torch.zeros(shape, dtype=torch.float64, device=device)
        return self.tensors[key]

    def block(self, key: str, columns: int) -> Tensor:
        return self.add(key, (self.reducer.world_size, columns))[self.reducer.rank]

    def reduce(self) -> dict[str, Tensor]:
        return dict(zip(self.tensors, self.reducer.sum(list(self.tensors.values()))))


def _moments(values: Tensor) -> Tensor:
    """float64 [mean, M2] of a (B,) tensor, M2 = Σᵢ (xᵢ − mean)²."""
    values = values.reshape(-1).double()
    mean = values.mean()
    return torch.stack([mean, (values - mean).square().sum()])


def _merged(block: Tensor, column: int) -> Tensor:
    """[mean, M2] over every rank's samples from each rank's (n, mean, M2) (Chan et al.'s
    pairwise update, in rank order: the same result on every rank)."""
    n, mean, m2 = 0.0, 0.0, 0.0
    for row in block.tolist():
        count, row_mean, row_m2 = row[_N], row[column], row[column + 1]
        if count == 0:
            continue
        delta, total = row_mean - mean, n + count
        mean += delta * count / total
        m2 += row_m2 + delta * delta * n * count / total
        n = total
    return torch.tensor([mean, m2], dtype=torch.float64)


def common_factor(spec: list[Tensor], exact: list[Tensor]) -> float | None:
    """c with spec = c·exact up to round-off of spec's dtype (norm-wise over all tensors),
    or None; float64, tensor by tensor (no flat copies)."""
    pairs = [(s.reshape(-1).double(), e.reshape(-1).to(s.device, torch.float64))
             for s, e in zip(spec, exact)]
    se = sum(float(torch.dot(s, e)) for s, e in pairs)
    ee = sum(float(torch.dot(e, e)) for _, e in pairs)
    ss = sum(float(torch.dot(s, s)) for s, _ in pairs)
    if not math.isfinite(ee) or ee == 0:
        return None
    c = se / ee
    tolerance = min(SPEC_ULPS * torch.finfo(spec[0].dtype).eps, 1e-3)
    # the residual itself, not ss − 2c·se + c²·ee: that cancels far below this tolerance
    residual = math.sqrt(sum(float(torch.linalg.vector_norm(s - c * e)) ** 2 for s, e in pairs))
    if not math.isfinite(c) or c == 0 or not residual <= tolerance * math.sqrt(ss):
        return None
    return c


class GlobalStep:
    """One instrumented step of a distributed run: local statistics, the packed call(s),
    and every due quantity's value over the global batch (`values`).

    inst: the suite's `Instruments` (not imported here: it imports this module); state,
    batch, batch_error, update: its step; no_loss: the reason when rec.loss was not called;
    compute: its compute functions by quantity name.
    """

    def __init__(self, inst: Any, state: StepState, batch: Batch | None,
                 batch_error: str, update: list[Tensor] | None, no_loss: str,
                 compute: dict[str, Callable[..., list[QuantityValue]]]) -> None:
        assert inst.reducer is not None
        self.inst, self.state, self.batch, self.update = inst, state, batch, update
        self.no_loss, self.batch_error = no_loss, batch_error
        self.reducer: Reducer = inst.reducer
        self.compute = compute
        self.names = inst._names
        self.params = list(inst._params.values())
        due = state.due - REPLICATED
        self.unsupported = {q: _not_global(q) for q in due if q not in NEEDS}
        if not callable(getattr(inst._curvature, "finalize", None)):
            self.unsupported.update(dict.fromkeys(due & needing("hessian"), NO_GLOBAL_CURVATURE))
        self.items = sorted(due - set(self.unsupported))
        if state.alpha_end is not None:
            self.items.append(ALPHA_END)
        self.stats = {s for item in self.items for s in NEEDS[item]}
        self.local_failed: dict[str, str] = {}
        self.spec: list[Tensor] | None = None  # ḡ_spec per parameter tensor

    # -- the step's values ----------------------------------------------------------------
    def values(self) -> list[QuantityValue]:
        """Every due quantity over the global batch (then this rank's local values)."""
        out = [missing(q, self.state.step, why) for q, why in sorted(self.unsupported.items())]
        if self.items:
            out += self._global_values()
        return out + self._local_values()

    def _missing(self, item: str, reason: str) -> QuantityValue:
        if item == ALPHA_END:
            assert self.state.alpha_end is not None
            return missing("Alpha", self.state.alpha_end.step, reason)
        return missing(item, self.state.step, reason)

    def _global_values(self) -> list[QuantityValue]:
        try:
            if self.reducer.disabled is not None:
                raise CollectiveError(self.reducer.disabled)
            self._check_local()
            bound = self._histogram_bound()
            reduced = self._phase_one(bound)
        except CollectiveError as error:
            return [self._missing(item, str(error)) for item in self.items]
        failed = self._agreed_failures(reduced["flags"])
        engine = self.stats & {"grad_sum", "sq_norm_sums", "second_moments"}
        gbatch = self._global_batch(reduced) if engine else None
        dots: tuple[Tensor, Tensor] | str | None = None
        if {"InnerTest", "OrthoTest"} & set(self.items) - set(failed):  # same on every rank
            dots = self._dots(reduced, gbatch)
        curvature, curvature_failed = (self._curvature(reduced) if "curvature" in self.stats
                                       else ({}, {}))
        out = []
        for item in self.items:
            if item in failed or item in curvature_failed:  # each its own outcome
                out.append(self._missing(item, failed.get(item) or curvature_failed[item]))
                continue
            try:
                out.extend(self._value(item, reduced, gbatch, dots, curvature, bound))
            except Exception as error:  # the same inputs on every rank: the same failure
                out.append(self._missing(item, describe(error)))
        return out

    # -- before the call: this rank's failures and statistics -------------------------------
    def _check_local(self) -> None:
        """Quantities that cannot be computed on this rank's micro-batch, and why."""
        state = self.state
        for item in self.items:
            name = "Alpha" if item == ALPHA_END else item
            if state.loss is None:
                self.local_failed[item] = self.no_loss
            elif item in state.failed:
                self.local_failed[item] = state.failed[item]
            elif "engine" in spec(name).needs and self.batch is None:
                self.local_failed[item] = self.batch_error
            elif item in ("Loss", ALPHA_END, "Alpha", "CABS") and state.losses is None:
                self.local_failed[item] = LOSS_NEEDS_PER_SAMPLE

    def _fill(self, stat: str, fill: Callable[[], None]) -> None:
        """Run `fill` if a quantity still needs `stat`; its failure fails them all here."""
        users = [i for i in self.items if stat in NEEDS[i] and i not in self.local_failed]
        if not users:
            return
        try:
            with torch.no_grad():
                fill()
        except Exception as error:
            self.local_failed.update(dict.fromkeys(users, describe(error)))

    def _histogram_bound(self) -> float | None:
        """An "adaptive" GradHist1d range's bound over all ranks (one MAX call), or None."""
        if "hist1d" not in self.stats or self.inst._histograms.bins is not None:
            return None
        local = torch.zeros(1, dtype=torch.float64)

        def fill() -> None:
            local[0] = local_abs_max(self.batch)
        self._fill("hist1d", fill)
        (bound,) = self.reducer.max([local])
        return float(bound[0])

    def _phase_one(self, bound: float | None) -> dict[str, Tensor]:
        K, D = len(self.names), sum(p.numel() for p in self.params)
        device = self.params[0].device
        pack = _Pack(self.reducer)
        flags = pack.block("flags", len(self.items))
        moments = pack.block("moments", _MOMENT_COLUMNS)
        engine_due = any("engine" in spec("Alpha" if i == ALPHA_END else i).needs
                         for i in self.items)
        lacking = pack.block("lacking", 2 * K) if engine_due else None
        fields = {stat: pack.add(stat, shape, where) for stat, shape, where in (
            ("grad_sum", (D,), device), ("sq_norm_sums", (K,), device),
            ("dots", (2, K + 1), device), ("second_moments", (D,), device),
            ("hist1d", (K, 1, self.inst._histograms.count + len(EXTRAS)), device),
            ("hist2d", (K, *(b.count + len(EXTRAS) for b in self.inst._histograms.hist2d)),
             device),
        ) if stat in self.stats}
        fingerprint = pack.block("fingerprint", 2 * K + 1) if "dots" in self.stats else None
        partials = self._partials(pack) if "curvature" in self.stats else {}
        return self._reduce(pack, flags, lambda: self._fill_local(
            moments, fields, fingerprint, partials, lacking, bound))

    def _reduce(self, pack: _Pack, flags: Tensor, fill: Callable[[], None]) -> dict[str, Tensor]:
        """`fill` this rank's statistics into `pack`, raise the flag of each item that
        failed here, and reduce: whatever fails, this rank still joins the call (else the
        others stall)."""
        try:
            fill()
        except Exception as error:
            for item in self.items:
                self.local_failed.setdefault(item, describe(error))
        for j, item in enumerate(self.items):
            flags[j] = float(item in self.local_failed)
        return pack.reduce()

    def _fill_local(self, moments: Tensor, fields: dict[str, Tensor],
                    fingerprint: Tensor | None, partials: dict[str, Tensor],
                    lacking: Tensor | None, bound: float | None) -> None:
        """This rank's statistics into the packed tensors (a failing one: zeros there, and
        its quantities failed here)."""
        state, batch, names = self.state, self.batch, self.names
        if state.losses is not None:
            moments[_N] = state.losses.shape[0]
            self._fill("moments", lambda: moments[_LOSS:_LOSS + 2].copy_(
                _moments(state.losses)))
        self._want_dots(fields, fingerprint)
        self._fill("grad_sum", lambda: self._flat_into(fields["grad_sum"], batch.grad_mean,
                                                       batch.size))
        self._fill("sq_norm_sums", lambda: fields["sq_norm_sums"].copy_(batch.sq_norm_sums))
        if self.spec is not None:
            self._fill("dots", lambda: self._dot_sums(fields["dots"], "mean"))
        self._fill("start", lambda: self._slopes(moments, _START))
        self._fill("end", lambda: self._slopes(moments, _END))
        self._fill("second_moments", lambda: self._flat_into(fields["second_moments"],
                                                             batch.second_moment_sums))
        if "hist1d" in fields or "hist2d" in fields:
            self._histograms(fields, bound)
        for key, tensor in partials.items():
            self._fill("curvature", lambda t=tensor, key=key: t.copy_(
                state.curvature["partials"][key].reshape(t.shape)))
        if lacking is not None and batch is not None:  # last: complete once the engine ran
            with torch.no_grad():
                lacking.copy_(torch.tensor(
                    [float(n in batch.unavailable()) for n in names]
                    + [float(n in batch.unavailable_sum()) for n in names], dtype=torch.float64))

    def _flat_into(self, out: Tensor, tensors: list[Tensor], scale: float = 1.0) -> None:
        """out (D,) ← the parameter-shaped `tensors` flattened in order (float64), × scale."""
        at = 0
        for t in tensors:
            part = out[at:at + t.numel()]
            part.copy_(t.reshape(-1))
            if scale != 1.0:
                part.mul_(scale)
            at += t.numel()

    def _want_dots(self, fields: dict[str, Tensor], fingerprint: Tensor | None) -> None:
        """Register every gᵢ·v of this step before the first, so they share one pass: ḡ_spec
        (with its fingerprint: availability, Σ ḡ_spec² and Σ ḡ_spec per tensor), α's
        update of this step and of the previous one."""
        batch, state = self.batch, self.state
        if batch is None:
            return
        if fingerprint is not None:
            grads = [p.grad for p in self.params]
            if all(g is not None and g.shape == p.shape for g, p in zip(grads, self.params)):
                self.spec = [g.detach() for g in grads]
                batch.want("mean", dict(zip(self.names, self.spec)))
                squares = squared_norms(self.spec).cpu()
                sums = torch.stack([g.double().sum().cpu() for g in self.spec])
                fingerprint.copy_(torch.cat([torch.ones(1, dtype=torch.float64), squares, sums]))
        if "start" in self.stats and self.update is not None and self._tau > 0:
            batch.want("start", dict(zip(self.names, self.update)))
        if state.alpha_end is not None:
            batch.want("end", state.alpha_end.update)

    @property
    def _tau(self) -> float:
        return float(self.state.update_sizes[-1]) if self.state.update_sizes is not None else 0.0

    def _dot_sums(self, out: Tensor, key: str) -> None:
        """out ← [ΣᵢQᵢ, ΣᵢQᵢ²] per tensor and in total, Qᵢ = gᵢᵀv for the vectors `key`."""
        q = with_total(self.batch.dots(key))
        out.copy_(torch.stack([q.sum(1), q.square().sum(1)]))

    def _slopes(self, moments: Tensor, column: int) -> None:
        """α's slopes gᵢᵀd̂ (mean, M2) along this step's update (_START) or the previous
        step's (_END)."""
        if column == _START and self._tau == 0:
            return  # α = −1, no slopes needed
        key, tau = ("start", self._tau) if column == _START else ("end", self.state.alpha_end.tau)
        projections = self.batch.dots(key).sum(0) / tau
        self.batch.check_complete("Alpha")
        moments[column:column + 2] = _moments(projections)

    def _histograms(self, fields: dict[str, Tensor], bound: float | None) -> None:
        settings = self.inst._histograms
        theta = dict(zip(self.names, self.state.theta)) if self.state.theta is not None else None
        due = frozenset(n for n, stat in (("GradHist1d", "hist1d"), ("GradHist2d", "hist2d"))
                        if stat in fields)
        users = [i for i in self.items if i in due and i not in self.local_failed]
        if not users:
            return
        try:
            counters, _ = histogram_counters(settings, self.batch, frozenset(users), theta, bound)
            for name, stat in (("GradHist1d", "hist1d"), ("GradHist2d", "hist2d")):
                for k, pname in enumerate(self.names):
                    if pname in counters.get(name, {}):
                        fields[stat][k].copy_(counters[name][pname].table())
        except Exception as error:
            self.local_failed.update(dict.fromkeys(users, describe(error)))

    def _partials(self, pack: _Pack) -> dict[str, Tensor]:
        """Fields for the curvature runner's partial sums (`state.curvature["partials"]`),
        shaped as this rank's; when its curvature failed, as at the last step with the same
        curvature quantities due (zeros), so that the ranks' layouts still match. None left
        and none failed: the runner's values are taken as they are."""
        got = self.state.curvature.get("partials")
        due = frozenset(self.state.due & needing("hessian"))
        layouts = self.inst._partials_layouts
        if isinstance(got, dict) and all(isinstance(v, Tensor) for v in got.values()):
            layouts[due] = {k: tuple(v.shape) for k, v in sorted(got.items())}
            layout = layouts[due]
        else:
            layout = layouts.get(due) if due & set(self.state.failed) else None
        device = self.params[0].device
        return {k: pack.add(f"partials:{k}", shape, device) for k, shape in (layout or {}).items()}

    # -- after the call -------------------------------------------------------------------
    def _agreed_failures(self, flags: Tensor) -> dict[str, str]:
        """Quantity -> why, for each that failed on some rank (the same set on every rank)."""
        rank, failed = self.reducer.rank, {}
        for j, item in enumerate(self.items):
            ranks = [r for r in range(self.reducer.world_size) if flags[r, j] > 0]
            if not ranks:
                continue
            if rank in ranks:
                reason = self.local_failed[item]
                failed[item] = f"failed on rank {rank}: {reason}"
                if reason != self.no_loss:
                    name = "Alpha" if item == ALPHA_END else item
                    self.inst._warn(f"{name} failed on rank {rank}: {reason}", frozenset({name}))
            else:
                failed[item] = f"failed on rank {ranks[0]} (see its warnings)"
        return failed

    def _lacking(self, block: Tensor, offset: int, local: dict[str, str]) -> dict[str, str]:
        """Parameter -> why it lacks gᵢ (or ḡ) on some rank: this rank's reason, or which."""
        out = {}
        for k, name in enumerate(self.names):
            ranks = [r for r in range(self.reducer.world_size) if block[r, offset + k] > 0]
            if name in local:
                out[name] = local[name]
            elif ranks:
                out[name] = f"on rank {ranks[0]} (see its warnings)"
        return out

    def _global_batch(self, reduced: dict[str, Tensor]) -> GlobalBatch:
        size = int(reduced["moments"][:, _N].sum())
        batch, lacking, K = self.batch, reduced.get("lacking"), len(self.names)
        local = batch.unavailable() if batch is not None else {}
        local_sum = batch.unavailable_sum() if batch is not None else {}
        sums, second = reduced.get("grad_sum"), reduced.get("second_moments")
        return GlobalBatch(
            size, None if sums is None else self._split(sums / size if size else sums * math.nan),
            reduced.get("sq_norm_sums"), None if second is None else self._split(second),
            self._lacking(lacking, 0, local) if lacking is not None else {},
            self._lacking(lacking, K, local_sum) if lacking is not None else {})

    def _split(self, flat: Tensor) -> list[Tensor]:
        """A flat (D,) tensor as one tensor per parameter, parameter-shaped (views)."""
        return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in self.params]),
                                              self.params)]

    def _dots(self, reduced: dict[str, Tensor], gbatch: GlobalBatch) -> tuple[Tensor, Tensor] | str:
        """(Σᵢ gᵢᵀḡ, Σᵢ (gᵢᵀḡ)²) per tensor and in total over the global batch, or why not:
        from the speculative ḡ_spec when every rank had the same one and it is c·ḡ, else
        by a second call with the exact ḡ."""
        prints = reduced["fingerprint"]
        if bool((prints[:, 0] == 1).all()) and bool((prints == prints[0]).all()):
            c = common_factor(self.spec, gbatch.grad_mean) if self.spec is not None else None
            if c is not None:
                sums, squares = reduced["dots"]
                return sums / c, squares / (c * c)
        pack = _Pack(self.reducer)
        flag = pack.block("flags", 1)
        out = pack.add("dots", (2, len(self.names) + 1), self.params[0].device)
        try:
            with torch.no_grad():
                self.batch.want("exact", {n: g.to(p.dtype) for n, g, p in
                                          zip(self.names, gbatch.grad_mean, self.params)})
                self._dot_sums(out, "exact")
            reason = ""
        except Exception as error:
            flag[0], reason = 1.0, describe(error)
        try:
            reduced2 = pack.reduce()
        except CollectiveError as error:
            return str(error)
        ranks = [r for r in range(self.reducer.world_size) if reduced2["flags"][r, 0] > 0]
        if self.reducer.rank in ranks:
            return f"failed on rank {self.reducer.rank}: {reason}"
        if ranks:
            return f"failed on rank {ranks[0]} (see its warnings)"
        sums, squares = reduced2["dots"]
        return sums, squares

    def _curvature(self, reduced: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, str]]:
        """The curvature runner's values over the global batch (from the summed partial
        sums, or as the runner left them when it left none), and quantity -> why it has
        none: a failed diagonal fails the quantities that need it only (HessMaxEV's
        Lanczos does not use it and keeps its value)."""
        partials = {key.split(":", 1)[1]: value for key, value in reduced.items()
                    if key.startswith("partials:")}
        if not partials:
            return self.state.curvature, {}
        try:
            return self.inst._curvature.finalize(
                partials, int(reduced["moments"][:, _N].sum())), {}
        except Exception as error:
            reason = str(error) if isinstance(error, RuntimeError) else describe(error)
            kept = {k: v for k, v in self.state.curvature.items() if k == "max_ev"}
            return kept, dict.fromkeys(needing("diagonal"), reason)

    def _value(self, item: str, reduced: dict[str, Tensor], gbatch: GlobalBatch | None,
               dots: tuple[Tensor, Tensor] | str | None, curvature: dict[str, Any],
               bound: float | None) -> list[QuantityValue]:
        state, step = self.state, self.state.step
        moments = reduced["moments"]
        size = int(moments[:, _N].sum())
        loss = _merged(moments, _LOSS)
        if item == "Loss":
            return [QuantityValue("Loss", step, value=float(loss[0]),
                                  meta={"reduction": state.reduction, "samples": size})]
        if item == "Alpha":
            return self._alpha_start(size, loss, moments)
        if item == ALPHA_END:
            end = alpha.line_point_of_moments(size, loss, _merged(moments, _END))
            return [alpha.alpha_value(state.alpha_end, end, step)]
        if item in ("GradHist1d", "GradHist2d"):
            return self._histogram_values(item, reduced, gbatch, bound)
        if item in ("InnerTest", "OrthoTest"):
            if isinstance(dots, str):
                raise RuntimeError(dots)
            B, N = size, with_total(gbatch.grad_sq_norms)
            if B < 2:
                raise ValueError(f"{item} needs a batch of at least 2 samples, got {B}")
            sums, squares = dots
            value = (inner_test_of_sums(sums, squares, N, B) if item == "InnerTest" else
                     ortho_test_of_sums(with_total(gbatch.sq_norm_sums), squares, N, B))
            undefined = zero_mean(N, with_total(gbatch.sq_norm_sums), B, self.inst.grad_eps())
            return rows(item, step, self.names, value, {}, undefined, ZERO_MEAN,
                        gbatch.unavailable())
        whole = dataclasses.replace(state, loss=loss[0].clone(), curvature=curvature)
        return self.compute[item](self.inst, item, whole, gbatch, self.update)

    def _alpha_start(self, size: int, loss: Tensor, moments: Tensor) -> list[QuantityValue]:
        state, tau = self.state, self._tau
        if tau == 0:
            return [QuantityValue("Alpha", state.step, value=-1.0, meta={"tau": 0.0})]
        point = alpha.line_point_of_moments(size, loss, _merged(moments, _START))
        self.inst._pending = AlphaStart(state.step, point, dict(zip(self.names, self.update)),
                                        tau)
        return []

    def _histogram_values(self, name: str, reduced: dict[str, Tensor],
                          gbatch: GlobalBatch | None, bound: float | None) -> list[QuantityValue]:
        settings = self.inst._histograms
        lacking = gbatch.unavailable() if gbatch is not None else self._lacking(
            reduced["lacking"], 0, self.batch.unavailable() if self.batch else {})
        if name == "GradHist1d":
            bins = settings.bins or symmetric_bins(settings.count, bound or 0.0)
            param_bins, table = None, reduced["hist1d"]
        else:
            (param_bins, bins), table = settings.hist2d, reduced["hist2d"]
        per_layer = {n: histogram_of_table(table[k], bins, param_bins)
                     for k, n in enumerate(self.names) if n not in lacking}
        meta: dict[str, Any] = {}
        if name == "GradHist1d" and settings.bins is None:
            meta["range"] = "adaptive"
        if lacking:
            meta["excluded"] = sorted(lacking)
        return histogram_values(name, self.state.step, settings, {name: (per_layer, meta)},
                                lacking)

    # -- this rank's own values --------------------------------------------------------------
    def _local_values(self) -> list[QuantityValue]:
        """Loss (mean ℓᵢ), BatchSize and GradNorm (‖ḡ_r‖ of this rank's pre-sync mean
        gradient) of this rank's micro-batch(es), `local=True`."""
        state, step, out = self.state, self.state.step, []
        if state.loss is not None:
            out.append(QuantityValue("Loss", step, value=float(state.loss), local=True))
        if state.losses is not None:
            out.append(QuantityValue("BatchSize", step, value=float(state.losses.shape[0]),
                                     local=True))
        if self.batch is not None:
            try:
                norms = with_total(self.batch.grad_sq_norms).sqrt()
                out += [dataclasses.replace(v, local=True) for v in rows(
                    "GradNorm", step, self.names, norms, {}, None, "",
                    self.batch.unavailable_sum())]
            except Exception:  # the global GradNorm reports the failure
                pass
        return out
