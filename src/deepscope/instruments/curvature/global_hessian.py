"""The Hessian of a distributed step's global mean loss as a linear map, for Lanczos.

With micro-batches of n_r samples on ranks r = 0..W-1 (N = Σ n_r), the Hessian of the mean
loss over the global batch is H = (1/N) Σ_r n_r H_r, H_r that of rank r's mean loss. Each
product H v is one packed all-reduce of the D values n_r H_r v, n_r and every rank's failure
reason (if any); every rank gets the same sum, so Lanczos runs the same iterations
everywhere. A rank whose local product fails still takes part (with zeros and its reason),
so all ranks stop at the same product instead of hanging.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...distributed import Reducer
from ..base import describe
from .operator import HessianOperator


class RankFailure(RuntimeError):
    """A product of the global Hessian failed on some rank; every rank raises it together."""


class GlobalHessian:
    """H v of the global mean loss; one all-reduce per product.

    Args:
        local: this rank's operator on its micro-batch's mean loss, or None when it could
            not be built (then `reason` says why, and this rank sends zeros and its reason).
        reducer: deepscope's collectives.
        batch_size: n_r, this rank's samples.
        dim, dtype, device: D and the flat vectors' dtype and device (the loss's), the same
            on every rank.
        reason: why `local` is None ("" when it is not).

    Attributes:
        total: N, the global batch (known after the first product), else None.
    """

    def __init__(self, local: HessianOperator | None, reducer: Reducer, batch_size: int,
                 dim: int, dtype: torch.dtype, device: torch.device, reason: str = "") -> None:
        self.local, self.reducer, self.batch_size = local, reducer, batch_size
        self.dim, self.dtype, self.device = dim, dtype, device
        self.reason = (reason or "no Hessian operator") if local is None else ""
        self.total: float | None = None

    def matvec(self, v: Tensor, out: Tensor | None = None) -> Tensor:
        """H v for a flat (D,) vector (identical on every rank), into `out` when given.

        Raises:
            RankFailure: on every rank when the product failed on any (names the ranks
                and their reasons).
            CollectiveError: the collective failed (the reducer is then off).
        """
        part = torch.zeros(self.dim, dtype=torch.float64, device=v.device)
        if not self.reason:
            try:
                part.copy_(self.local.matvec(v)).mul_(self.batch_size)
            except Exception as error:  # this rank's failure, shared with its reason
                self.reason = describe(error)
                part.zero_()
        count = torch.tensor([float(self.batch_size)], dtype=torch.float64)
        summed, count, codes = self.reducer.sum(
            [part, count, reason_codes(self.reducer.rank, self.reducer.world_size, self.reason)])
        failed = rank_failures(codes)
        if failed:
            raise RankFailure("a Hessian-vector product of the global batch " + failed)
        self.total = float(count)
        result = summed.div_(self.total).to(self.dtype)
        return result if out is None else out.copy_(result)


REASON_CHARS = 160  # characters of a rank's failure reason that travel with the sums


def reason_codes(rank: int, world_size: int, reason: str) -> Tensor:
    """(world_size, REASON_CHARS + 1) float64, zero but for row `rank` = (length, ASCII
    codes of `reason`): summed over ranks, every rank's reason arrives with the values."""
    text = reason.encode("ascii", "replace")
    if len(text) > REASON_CHARS:
        text = text[:REASON_CHARS - 3] + b"..."
    codes = torch.zeros(world_size, REASON_CHARS + 1, dtype=torch.float64)
    codes[rank, 0] = len(text)
    codes[rank, 1:1 + len(text)] = torch.tensor(list(text), dtype=torch.float64)
    return codes


def rank_failures(codes: Tensor) -> str:
    """From summed `reason_codes`: "failed on rank r (reason); ..." for every rank that
    sent a reason, or "" when none did."""
    reasons = [f"rank {r} ({bytes(int(c) for c in row[1:1 + int(row[0])].tolist()).decode()})"
               for r, row in enumerate(codes.cpu()) if row[0] > 0]
    return "failed on " + "; ".join(reasons) if reasons else ""
