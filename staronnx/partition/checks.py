"""Cuts that run but do not mean what was asked, said before anyone serves them.

A plan can be valid (every part runs, the chain computes the model) and still be a poor answer
to the request: a part that computes nothing is a task that only hands tensors on (a model whose
body is one ``If`` cuts into the ``If`` and its output ``Identity`` nodes); a crossing tensor of
0 bytes per sample is one whose size shape inference could not tell, so its transfer was never
weighed; achieved shares far from the targets are not the split the user sized the workers
for. Partition warns of each with a way out (:class:`PartitionWarning`: one line each, through
Python's warnings, which the CLI prints as ``staronnx: warning: ...``).

A caller that cuts to targets of its own choosing (``staronnx.InferenceSession``'s 85/15 when
its user named no shares) runs partition under :func:`targets_by_default`: these findings are
then logged, not warned, since they are about a choice the user never made and has nothing to
change (the user who names shares hears them again).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

from staronnx.plan import Plan

#: ops that compute nothing: a part made only of them is a task that hands its inputs on
FREE_OPS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Shape", "Size", "Constant",
                      "Dropout"})
#: a part below this share of the model's cost has no cost worth a task of its own
NO_COST_SHARE = 1e-3
#: warnings point at the caller's line, past every frame of the package (whichever door it took)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: true while partition cuts to a caller's default targets (per thread: sessions open in parallel)
_DEFAULT_TARGETS: ContextVar[bool] = ContextVar("staronnx_default_targets", default=False)

log = logging.getLogger(__name__)


class PartitionWarning(UserWarning):
    """A partition that ran but may not mean what was asked; ``cli`` words it with the CLI's flags."""

    def __init__(self, message: str, cli: str | None = None) -> None:
        super().__init__(message)
        self.cli = cli if cli is not None else message


@dataclass(frozen=True)
class CutIssue:
    """One finding: the Python API's words and the command line's."""

    message: str
    cli: str


def _fmt(shares: Sequence[float]) -> str:
    return ",".join(f"{s:.2f}" for s in shares)


def suggested_shares(achieved: Sequence[float]) -> list[float] | None:
    """The achieved shares rounded to two decimals and summing to exactly 1 (what ``--shares``
    accepts), or None where a part would round to nothing."""
    rounded = [round(s, 2) for s in achieved[:-1]]
    rounded.append(round(1.0 - sum(rounded), 2))
    return rounded if all(s > 0 for s in rounded) else None


def _no_cost(plan: Plan) -> list[CutIssue]:
    issues = []
    total = sum(p.cost_us for p in plan.parts)
    for p in plan.parts:
        free = set(p.op_counts) <= FREE_OPS
        if not free and p.share >= NO_COST_SHARE:
            continue
        ops = ", ".join(f"{op}×{n}" for op, n in p.op_counts.items())
        what = "computes nothing" if free else "has no measurable cost"
        why = (f"part {p.index} {what} ({ops}; {p.cost_us:.3g} of {total:.3g} µs): a task that only "
               "hands tensors on")
        issues.append(CutIssue(f"{why}; cut into fewer parts (parts={plan.k - 1})",
                               f"{why}; cut into fewer parts (--parts {plan.k - 1})"))
    return issues


def _empty_cut(plan: Plan) -> list[CutIssue]:
    if not plan.crossing:
        why = f"the cut carries nothing: the {plan.k} parts share no tensor (each is a model of its own)"
        return [CutIssue(f"{why}; partition with parts=1 and serve them as one", f"{why}; use --parts 1")]
    empty = [t for t in plan.crossing if t.bytes_per_sample == 0]
    if not empty:
        return []
    names = ", ".join(f"{t.name!r} (part {t.producer} to {','.join(map(str, t.consumers))})" for t in empty)
    why = (f"crossing tensor(s) {names} carry 0 bytes per sample as far as shape inference can tell "
           "(a size it could not read, or an empty tensor): the cut's transfers were not weighed")
    return [CutIssue(f"{why}; other shares or parts=1 avoid them", f"{why}; other --shares or --parts 1 avoid them")]


def _missed_shares(plan: Plan, tolerance: float) -> list[CutIssue]:
    targets = [p.target_share for p in plan.parts]
    achieved = [p.share for p in plan.parts]
    worst = max(plan.parts, key=lambda p: abs(p.share - p.target_share))
    miss = abs(worst.share - worst.target_share)
    if miss <= tolerance:
        return []
    why = (f"achieved shares {_fmt(achieved)} miss the targets {_fmt(targets)} by more than the tolerance "
           f"{tolerance:g} (part {worst.index} by {miss:.2f}): the nodes' costs do not split closer here")
    near = suggested_shares(achieved)
    ask, flag = ((f"shares={near}, ", f"--shares {_fmt(near)}, ") if near is not None else ("other shares, ", "other --shares, "))
    return [CutIssue(f"{why}; ask for {ask}a larger tolerance, or parts=1",
                     f"{why}; ask for {flag}a larger --tolerance, or --parts 1")]


def cut_issues(plan: Plan, tolerance: float, *, shares_cut: bool = True) -> list[CutIssue]:
    """What is wrong with a cut of more than one part: parts with no cost, crossing tensors of
    0 bytes (or none at all), and (for a cut to target shares, ``shares_cut``) an achieved share
    further than ``tolerance`` from its target."""
    if plan.k < 2:
        return []
    issues = _no_cost(plan) + _empty_cut(plan)
    if shares_cut:
        issues += _missed_shares(plan, tolerance)
    return issues


@contextlib.contextmanager
def targets_by_default() -> Iterator[None]:
    """Within: the targets partition cuts to are the caller's default, not its user's choice, so
    :func:`warn_cut` logs what the cut missed of them (at INFO) instead of warning."""
    token = _DEFAULT_TARGETS.set(True)
    try:
        yield
    finally:
        _DEFAULT_TARGETS.reset(token)


def warn_cut(plan: Plan, tolerance: float, *, shares_cut: bool = True) -> list[CutIssue]:
    """:func:`cut_issues`, each as a :class:`PartitionWarning` (logged instead within
    :func:`targets_by_default`); returned as well."""
    issues = cut_issues(plan, tolerance, shares_cut=shares_cut)
    for issue in issues:
        if _DEFAULT_TARGETS.get():
            log.info("the default cut of %s: %s", plan.root, issue.message)
        else:
            say(issue.message, issue.cli)
    return issues


def say(message: str, cli: str) -> None:
    """One :class:`PartitionWarning`, attributed to the first caller outside staronnx."""
    warnings.warn(PartitionWarning(message, cli=cli), skip_file_prefixes=(_PACKAGE,))
