"""Process-wide interpreter settings that several users hold at once.

The interpreter's switch interval (held short while a runtime with latency lanes is open) and
the cycle collector's thresholds (held at "young collections only" while a load generator
injects or ``staronnx serve`` serves) belong to the whole process, while the runtimes, servers
and runs that want them overlap and nest. Each such setting is counted: the first user applies
it, the last one to leave restores what the first found, so no user undoes another's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class SharedSetting:
    """A setting held by nested or concurrent users (process-wide ones here, and a runtime's
    driver pin in :mod:`staronnx.workers.colocate`): ``apply()`` changes it and returns what it
    found, which ``restore`` gets back once the last user leaves."""

    def __init__(self, apply: Callable[[], Any], restore: Callable[[Any], None]) -> None:
        self._apply = apply
        self._restore = restore
        self._lock = threading.Lock()
        self._saved: Any = None
        #: users inside :meth:`held` now
        self.users = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[Any]:
        """The setting applied while inside (by the first of overlapping users); yields what
        that ``apply()`` returned."""
        with self._lock:
            if not self.users:
                self._saved = self._apply()
            self.users += 1
            saved = self._saved
        try:
            yield saved
        finally:
            with self._lock:
                self.users -= 1
                if not self.users:
                    self._restore(self._saved)
