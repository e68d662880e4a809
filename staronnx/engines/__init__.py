"""Optional engines that run a plan's task graph on another runtime than the native one.

Nothing here is imported by ``import staronnx``: an engine's module is loaded only when a
:class:`~staronnx.runtime.runtime.Runtime` asks for it, so staronnx installs and imports where
the engine's native library (StarPU for :mod:`staronnx.engines.starpu`) is absent.
"""
