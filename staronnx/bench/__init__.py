"""Evaluation: sweeps, plots, the batch-size optimizer, the simulator and the throughput bound.

- :mod:`staronnx.bench.sweep`: rates x batch sizes on the live runtime -> results.csv/json
- :mod:`staronnx.bench.plots`: the papers' figures from sweep folders, and comparisons
- :mod:`staronnx.bench.optimize`: the batch size for a rate (simulated, then verified live)
- :mod:`staronnx.bench.simulator`: discrete-event what-if serving from the perf models
- :mod:`staronnx.bench.bound`: the LP upper bound on sustainable throughput

Nothing is imported here, so ``import staronnx.bench.sweep`` does not pull in matplotlib or
SciPy.
"""
