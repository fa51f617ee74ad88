"""comgra's API over deepscope: `comgra.my_recorder = ComgraRecorder(...)` works unchanged."""

from typing import Any

my_recorder: Any = None  # comgra's module-global recorder slot
