"""Performance models the scheduler reads: execution-time histories, regressions, the bus.

Pure Python and numpy (no ONNX Runtime), so the simulator can replay the very same models.
All times are seconds; bandwidths are bytes per second. See ``history`` for StarPU's rules
(first sample dropped, ±50 % outliers, NaN until 10 samples), ``regression`` for the
``a*n**b + c`` batch-size fit, ``bus`` for transfer times, ``host`` for what serving costs the
host beyond the parts' time, and ``store`` for the on-disk layout.
"""

from staronnx.perfmodels.bus import BusModel, Link, LinkCost, calibrate_host_numa, calibrate_link, host_numa_nodes
from staronnx.perfmodels.history import (
    CALIBRATE_MINIMUM, HISTORY_MAX_ERROR, Footprint, HistoryEntry, HistoryModel, PendingSample,
    PerfModelFormatError, PerfRow, SampleOutcome,
)
from staronnx.perfmodels.host import HostCosts, HostModel
from staronnx.perfmodels.regression import NLRegression, PowerLaw, fit_nl_regression, fit_power_law
from staronnx.perfmodels.store import (
    ModelKey, PerfModelCorruptWarning, PerfModelStore, PerfModelStoreReadOnly, atomic_write_json,
    default_host, default_root,
)

__all__ = [
    "CALIBRATE_MINIMUM", "HISTORY_MAX_ERROR", "BusModel", "Footprint", "HistoryEntry", "HistoryModel",
    "HostCosts", "HostModel", "Link", "LinkCost", "ModelKey", "NLRegression", "PendingSample",
    "PerfModelCorruptWarning", "PerfModelFormatError", "PerfModelStore", "PerfModelStoreReadOnly", "PerfRow",
    "PowerLaw", "SampleOutcome", "atomic_write_json", "calibrate_host_numa", "calibrate_link", "default_host",
    "default_root", "fit_nl_regression", "fit_power_law", "host_numa_nodes",
]
