"""When to record: schedules decide per step (and per kind) whether a step is recorded.

A schedule is any callable `(step, kind) -> bool`. The helpers here cover the usual cases;
`per_kind` keeps rare kinds recorded regularly, like comgra's per-type decision maker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Schedule = Callable[[int, str], bool]


class every:  # noqa: N801 - reads as a phrase: schedule=every(10)
    """Record steps start, start+n, start+2n, ... (of every kind)."""

    def __init__(self, n: int, start: int = 0) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"every(n) needs a positive integer n, got {n!r}")
        self.n, self.start = n, start

    def __call__(self, step: int, kind: str) -> bool:
        return step >= self.start and (step - self.start) % self.n == 0

    def __repr__(self) -> str:
        return f"every({self.n}, start={self.start})"


class at:  # noqa: N801
    """Record exactly the listed steps."""

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = frozenset(int(s) for s in steps)

    def __call__(self, step: int, kind: str) -> bool:
        return step in self.steps

    def __repr__(self) -> str:
        return f"at({sorted(self.steps)})"


class log_spaced:  # noqa: N801
    """Record about `per_decade` steps per power of ten: dense early, sparse late.

    Always records step 0. Steps are round(10**(k / per_decade)) for k = 0, 1, 2, ...
    """

    def __init__(self, per_decade: int = 10, max_step: int = 10**9) -> None:
        if per_decade < 1:
            raise ValueError(f"log_spaced(per_decade) needs per_decade >= 1, got {per_decade}")
        self.per_decade = per_decade
        steps = {0}
        k = 0
        while (s := round(10 ** (k / per_decade))) <= max_step:
            steps.add(s)
            k += 1
        self.steps = frozenset(steps)

    def __call__(self, step: int, kind: str) -> bool:
        return step in self.steps

    def __repr__(self) -> str:
        return f"log_spaced({self.per_decade})"


class per_kind:  # noqa: N801
    """Record a step when its kind was last recorded at least `n` steps ago (or never).

    Each kind is recorded regularly even if it is rare. Stateful: one instance per scope.
    """

    def __init__(self, n: int) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"per_kind(n) needs a positive integer n, got {n!r}")
        self.n = n
        self._last: dict[str, int] = {}

    def __call__(self, step: int, kind: str) -> bool:
        last = self._last.get(kind)
        if last is None or step - last >= self.n:
            self._last[kind] = step
            return True
        return False

    def __repr__(self) -> str:
        return f"per_kind({self.n})"


def never(step: int, kind: str) -> bool:
    """A schedule that records nothing (KPIs are still logged)."""
    return False


def as_schedule(value: Schedule | int | None, what: str = "schedule") -> Schedule:
    """Accept a schedule, an int n (= every(n)) or None (= never)."""
    if value is None:
        return never
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a schedule like deepscope.every(10), not a bool")
    if isinstance(value, int):
        return every(value)
    if callable(value):
        return value
    raise TypeError(f"{what} must be callable (step, kind) -> bool, e.g. deepscope.every(10); "
                    f"got {type(value).__name__}")


