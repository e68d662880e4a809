"""Evaluation: sweeps, plots, the batch-size optimizer, the simulator and the throughput bound.

- :mod:`staronnx.bench.sweep`: rates x batch sizes on the live runtime (one point:
  :mod:`~staronnx.bench.points`; rows and files: :mod:`~staronnx.bench.results`;
  over the network: :mod:`~staronnx.bench.remote`)
- :mod:`staronnx.bench.plots`: the papers' figures from sweep folders, and comparisons
- :mod:`staronnx.bench.optimize`: the batch size for a rate (simulated, then verified live)
- :mod:`staronnx.bench.simulator`: discrete-event what-if serving from the perf models, on a
  machine of :mod:`~staronnx.bench.machine` (workers, arch sources, GPUs, lanes, residency)
- :mod:`staronnx.bench.bound`: the LP upper bound on sustainable throughput
- :mod:`staronnx.bench.spec`: what each of them is asked, as values (:class:`~staronnx.bench.spec.SweepSpec`,
  :class:`~staronnx.bench.spec.SimSpec`, ...) beside the machine's
  :class:`~staronnx.workers.layout.MachineSpec`

Nothing is imported here, so a sweep does not pull in matplotlib.
"""
