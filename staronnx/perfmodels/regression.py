"""Execution time as a function of batch size, fitted from history means.

Serving forms batches of many sizes and the scheduler needs a prediction for each, so, like
StarPU's ``NL_REGRESSION_BASED`` models, we fit over one input-shape family's calibrated
(batch size, mean time) points::

    t(n) = a * n**b + c        (a >= 0, c >= 0, b in [0.1, 3])

``c`` is the fixed cost of a run, ``a * n**b`` what grows with the batch. No scipy: for a fixed
``b`` the fit is weighted linear least squares in ``(a, c)``; ``b`` comes from a grid refined by
nested finer grids (variable projection). Errors are *relative* (weights ``1/y**2``), so
small batches count as much as large ones. StarPU's ``alpha * size**beta`` is
:func:`fit_power_law`, with StarPU's validity rules; the history model does not use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

#: Exponent search range for ``b``; beyond it the fit is extrapolating nonsense anyway.
B_RANGE: tuple[float, float] = (0.1, 3.0)
#: Fewest distinct batch sizes for a three-parameter fit to mean anything (with three it is
#: exact, so it interpolates but cannot report a misfit).
MIN_SIZES = 3
_GRID_POINTS = 146  # 0.02 steps over B_RANGE
_REFINE_POINTS = 33  # each refinement round: a bracket of 2 steps cut into 32 steps
_REFINE_ROUNDS = 4  # shrinks the 0.04-wide bracket to steps of 3e-7


@dataclass(frozen=True)
class NLRegression:
    """A fitted ``t(n) = a * n**b + c`` (seconds), with its goodness of fit.

    ``r2`` is the coefficient of determination on the points themselves, ``rel_rmse`` the root
    mean square of the relative errors — the figure that tells how far off a prediction for a
    measured size is likely to be.
    """

    a: float
    b: float
    c: float
    r2: float
    rel_rmse: float
    npoints: int
    min_batch: int
    max_batch: int

    def predict(self, batch: float) -> float:
        """Predicted seconds for a batch of ``batch`` items (also for sizes never measured)."""
        if batch <= 0:
            return self.c
        scaled: float = float(batch) ** self.b  # a positive base: a float, never complex
        return self.a * scaled + self.c

    def to_dict(self) -> dict[str, float | int]:
        """JSON-able form (for files and display; loading refits rather than trusting it)."""
        return asdict(self)


def _solve_ac(u: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best ``(a, c)`` with ``a, c >= 0`` for each row of ``u`` (shape ``(nb, npts)``).

    Returns ``a``, ``c`` and the weighted squared error, all of shape ``(nb,)``. The
    constrained optimum of a two-variable convex quadratic is either the free optimum or lies
    on one of the two boundaries, so three closed forms cover it.
    """
    sw = w.sum()
    su = (w * u).sum(axis=1)
    sy = (w * y).sum()
    suu = (w * u * u).sum(axis=1)
    suy = (w * u * y).sum(axis=1)
    det = sw * suu - su * su
    safe = np.abs(det) > 1e-300
    with np.errstate(divide="ignore", invalid="ignore"):
        a_free = np.where(safe, (sw * suy - su * sy) / det, 0.0)
        c_free = np.where(safe, (suu * sy - su * suy) / det, sy / sw)
        a_only = np.where(suu > 0, suy / suu, 0.0)  # c = 0
    c_only = np.full_like(su, sy / sw)  # a = 0

    def err(a: np.ndarray, c: np.ndarray) -> np.ndarray:
        r = a[:, None] * u + c[:, None] - y[None, :]
        sq: np.ndarray = (w[None, :] * r * r).sum(axis=1)
        return sq

    feasible = safe & (a_free >= 0) & (c_free >= 0)
    a_only = np.maximum(a_only, 0.0)
    cands = [
        (np.where(feasible, a_free, 0.0), np.where(feasible, c_free, 0.0), feasible),
        (a_only, np.zeros_like(a_only), np.ones_like(feasible)),
        (np.zeros_like(c_only), c_only, np.ones_like(feasible)),
    ]
    best_a = np.zeros_like(su)
    best_c = np.zeros_like(su)
    best_e = np.full_like(su, np.inf)
    for a, c, ok in cands:
        e = np.where(ok, err(a, c), np.inf)
        better = e < best_e
        best_a = np.where(better, a, best_a)
        best_c = np.where(better, c, best_c)
        best_e = np.where(better, e, best_e)
    return best_a, best_c, best_e


def _positive_points(batches: Sequence[float], seconds: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The (batch size, seconds) points a fit can take the logarithm of: finite and positive."""
    x = np.asarray(batches, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError("batches and seconds must be 1-D sequences of equal length")
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    return x[keep], y[keep]


def fit_nl_regression(batches: Sequence[float], seconds: Sequence[float], *, min_sizes: int = MIN_SIZES,
                      b_range: tuple[float, float] = B_RANGE) -> NLRegression | None:
    """Fit ``t(n) = a*n**b + c`` to (batch size, seconds) points by relative least squares.

    Returns ``None`` when there are fewer than ``min_sizes`` distinct batch sizes: with fewer
    points than parameters the curve is not determined, and a wrong curve would mislead the
    scheduler more than an honest "uncalibrated".
    """
    x, y = _positive_points(batches, seconds)
    if len(np.unique(x)) < max(min_sizes, 2):
        return None
    w = 1.0 / (y * y)
    lnx = np.log(x)

    def profile(bs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _solve_ac(np.exp(bs[:, None] * lnx[None, :]), y, w)

    lo, hi = b_range
    grid = np.linspace(lo, hi, _GRID_POINTS)
    a_s, c_s, errs = profile(grid)
    k = int(np.argmin(errs))
    a, b, c, best = float(a_s[k]), float(grid[k]), float(c_s[k]), float(errs[k])
    # Refined between the grid neighbours of the best point by nested grids, each a single
    # vectorised solve: a fit runs on the serving path whenever a batch size's mean moves, and
    # golden-section search took 30 sequential solves of one point each (about 2 ms a fit here)
    left, right = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    for _ in range(_REFINE_ROUNDS):
        fine = np.linspace(left, right, _REFINE_POINTS)
        a_s, c_s, errs = profile(fine)
        j = int(np.argmin(errs))
        if errs[j] < best:
            a, b, c, best = float(a_s[j]), float(fine[j]), float(c_s[j]), float(errs[j])
        step = fine[1] - fine[0]
        left, right = max(fine[j] - step, lo), min(fine[j] + step, hi)

    pred = a * x**b + c
    ss_res = float(((pred - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    rel_rmse = float(np.sqrt((((pred - y) / y) ** 2).mean()))
    return NLRegression(a, b, c, r2=r2, rel_rmse=rel_rmse, npoints=int(len(x)), min_batch=int(x.min()),
                        max_batch=int(x.max()))


@dataclass(frozen=True)
class PowerLaw:
    """StarPU's linear-log model ``t(n) = alpha * n**beta``, trusted only near its data.

    StarPU uses it only within ``[0.9*minx, 1.1*maxx]`` of the sizes it was fitted on and
    returns NaN elsewhere, because a straight line in log-log space extrapolates badly.
    """

    alpha: float
    beta: float
    nsamples: int
    min_batch: float
    max_batch: float

    def predict(self, batch: float) -> float:
        """Predicted seconds, or NaN outside the trusted range (StarPU's rule)."""
        if not 0.9 * self.min_batch <= batch <= 1.1 * self.max_batch:
            return math.nan
        scaled: float = float(batch) ** self.beta  # batch > 0 in range: a float, never complex
        return self.alpha * scaled


def fit_power_law(batches: Sequence[float], seconds: Sequence[float], *, min_samples: int = 10) -> PowerLaw | None:
    """Least squares in log space over individual samples (StarPU's ``REGRESSION_BASED``).

    Valid, as in StarPU, only with at least ``min_samples`` samples and ``minx < 0.9*maxx``
    (otherwise the slope is noise); returns ``None`` when invalid.
    """
    x, y = _positive_points(batches, seconds)
    if len(x) < min_samples or not x.min() < 0.9 * x.max():
        return None
    lx, ly = np.log(x), np.log(y)
    n = len(x)
    sx, sy, sxx, sxy = lx.sum(), ly.sum(), (lx * lx).sum(), (lx * ly).sum()
    beta = float((n * sxy - sx * sy) / (n * sxx - sx * sx))
    alpha = float(math.exp((sy - beta * sx) / n))
    return PowerLaw(alpha, beta, nsamples=n, min_batch=float(x.min()), max_batch=float(x.max()))
