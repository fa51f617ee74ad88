"""What the monitor reports: `Finding` rows, and `StopTraining` to end a run from a callback."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """One row of the store's `anomalies` table.

    step: the training step it was found at. tensor: where to look — a module path named as
    the recorder names activations (`prefix.module.path`, the root is `root_name`), a dotted
    parameter name, or the loss name. detector: `nonfinite`, `exploding_gradient`,
    `vanishing_gradient`, `loss_spike`, `dead_units`, `saturation`, `update_ratio` or a custom
    detector's name. value / threshold: the measured quantity and the limit it crossed (None
    where there is no number, e.g. for `nonfinite`). message: one readable sentence or two.
    """

    step: int
    tensor: str
    detector: str
    value: float | None
    threshold: float | None
    message: str

    def as_row(self) -> tuple[int, str, str, float | None, float | None, str]:
        """The tuple `StoreWriter.submit_anomalies` takes."""
        return (self.step, self.tensor, self.detector, self.value, self.threshold, self.message)


class StopTraining(BaseException):
    """Raise it from an `on_anomaly` callback to stop training.

    It is a BaseException (like KeyboardInterrupt) so that `except Exception` blocks — yours
    and deepscope's own guard around recording — let it through. The monitor holds it back
    until the findings of the step are handed over to be stored, and raises it from the next
    `start()`, i.e. on entry of the next `with scope.step(...)`. Catch it around your loop::

        def stop_on_nan(f):
            if f.detector == "nonfinite":
                raise StopTraining(f)
        try:
            for step, batch in enumerate(loader):
                with scope.step(step) as rec: ...
        except StopTraining as stop:
            print("stopped:", stop.finding.message)
    """

    def __init__(self, finding: Finding | None = None) -> None:
        super().__init__(finding.message if finding is not None else "training stopped")
        self.finding = finding
