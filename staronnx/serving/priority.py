"""Priority levels and queue policies: which queued request a batch takes first, how many of a
level may wait, and what happens to one that waits too long (Triton's dynamic batcher's
``priority_levels`` and ``ModelQueuePolicy``, as values the batcher and the served model read).

A model with ``P`` priority levels keeps its queue ordered by level, level 1 first (the highest),
and in arrival order within a level: a batch takes the first requests of that order, so a
request of level 1 leaves before every request of level 2 still waiting, whenever it came. A
request that names no level gets the model's default one. Each level has its policy
(:class:`LevelPolicy`): a capacity of its own (a request of a full level is refused, whatever
room the others have), a timeout counted from its arrival, and what happens past it: REJECT (the
request is refused if it has not left in a batch by then) or DELAY (it is moved behind the
requests of its level that are still within their timeouts, before every lower level's: it
still runs, later). A request may shorten its level's timeout with a timeout of its own where
the policy allows it (``allow_timeout_override``), never lengthen it.

A model without priority levels is one level; its policy still applies (a DELAY policy keeps
its queue ordered, the requests past their timeout behind the others).
"""

from __future__ import annotations

from dataclasses import dataclass

from staronnx.errors import StaronnxError

#: the most priority levels a model may have (each level costs the batcher a count per request)
MAX_LEVELS = 256


class QueueRequestError(StaronnxError, ValueError):
    """A request's priority or timeout that its model's queue policy does not allow."""


@dataclass(frozen=True)
class LevelPolicy:
    """One priority level's queue policy (Triton's ``ModelQueuePolicy``)."""

    #: requests of this level that may wait at once; None: only the model's queue capacity
    capacity: int | None = None
    #: seconds a request of this level may wait for its batch; None: as long as it takes
    timeout: float | None = None
    #: past its timeout a request is moved behind the others (DELAY), not refused (REJECT)
    delay: bool = False
    #: a request may give a shorter timeout of its own (``allow_timeout_override``)
    allow_override: bool = False

    def __post_init__(self) -> None:
        if self.capacity is not None and self.capacity < 1:
            raise StaronnxError(f"a priority level's capacity must be >= 1 or None, got {self.capacity}")
        if self.timeout is not None and not self.timeout > 0:
            raise StaronnxError(f"a priority level's timeout must be above 0 seconds or None, got {self.timeout}")


@dataclass(frozen=True)
class QueuePolicy:
    """A model's queue: its priority levels' policies (level 1 first) and the level of a
    request that names none. ``priority_levels`` 0: the model has no levels (one queue, the
    one policy in ``levels``), and a request may not name one."""

    levels: tuple[LevelPolicy, ...] = (LevelPolicy(),)
    default_level: int = 1
    priority_levels: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.priority_levels <= MAX_LEVELS:
            raise StaronnxError(f"priority_levels must lie between 0 and {MAX_LEVELS}, got {self.priority_levels}")
        if len(self.levels) != max(self.priority_levels, 1):
            raise StaronnxError(f"{len(self.levels)} level policies for {self.priority_levels} priority levels")
        if not 1 <= self.default_level <= len(self.levels):
            raise StaronnxError(f"default priority level {self.default_level} must lie between 1 and "
                                f"{len(self.levels)}")

    @property
    def ordered(self) -> bool:
        """Whether the queue is kept in an order other than arrival (levels, or a DELAY policy)."""
        return self.priority_levels > 0 or any(p.delay for p in self.levels)

    @property
    def overridable(self) -> bool:
        """Whether some level lets a request give its own timeout."""
        return any(p.allow_override for p in self.levels)

    def level_of(self, priority: int, model: str) -> int:
        """The level (1 the highest) a request asking for ``priority`` waits at: the default one
        for 0; refused, naming the model's levels, out of range."""
        if priority == 0:
            return self.default_level
        if self.priority_levels == 0:
            raise QueueRequestError(f"model {model!r} has no priority levels (dynamic_batching.priority_levels); "
                                    f"send the request without a priority (or priority 0), got {priority}")
        if not 1 <= priority <= self.priority_levels:
            raise QueueRequestError(f"model {model!r}: priority {priority} is out of range: its levels are 1 (the "
                                    f"highest) to {self.priority_levels}, and 0 means its default level "
                                    f"({self.default_level})")
        return priority

    def timeout_of(self, level: int, requested_us: int | None, model: str) -> float | None:
        """Seconds a request of ``level`` may wait for its batch: its level's timeout, or the
        shorter one the request gives (``requested_us``, microseconds; None or 0: none) where the
        level allows it; a timeout the level does not let a request give is refused."""
        policy = self.levels[level - 1]
        if not requested_us:
            return policy.timeout
        if not policy.allow_override:
            where = ("dynamic_batching.default_queue_policy" if self.priority_levels == 0
                     else f"the queue policy of priority level {level}")
            raise QueueRequestError(f"model {model!r} does not let a request set its own queue timeout "
                                    f"({where} has no allow_timeout_override); send the request without a "
                                    "timeout")
        asked = requested_us / 1e6
        return asked if policy.timeout is None else min(asked, policy.timeout)
