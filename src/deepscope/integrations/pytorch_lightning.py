"""`pytorch_lightning` namespace callback; the same as `deepscope.integrations.lightning`."""

from __future__ import annotations

from . import INTERRUPTED, require
from ._lightning_hooks import PER_SAMPLE_KEY, LightningHooks

_pl = require("pytorch_lightning", "lightning")

__all__ = ["INTERRUPTED", "PER_SAMPLE_KEY", "DeepscopeCallback"]


class DeepscopeCallback(LightningHooks, _pl.Callback):
    __doc__ = LightningHooks.__doc__
