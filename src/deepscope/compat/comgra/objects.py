"""comgra's decision makers, as deepscope schedules (callables (step, kind) -> bool)."""

from __future__ import annotations

from collections.abc import Iterable

from ...recorder.schedule import at, per_kind


class DecisionMakerForRecordingsFrequencyPerType(per_kind):
    """Record a step when its type was last recorded at least `min_training_steps_difference`
    steps ago, separately for each type of execution (comgra semantics)."""

    def __init__(self, min_training_steps_difference: int, **_: object) -> None:
        super().__init__(min_training_steps_difference)


class DecisionMakerForRecordingsHardcoded(at):
    """Record exactly the given training steps."""

    def __init__(self, fixed_training_steps: Iterable[int], **_: object) -> None:
        super().__init__(fixed_training_steps)
