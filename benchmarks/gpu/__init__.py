"""The GPU check (`python -m benchmarks.gpu`, docs/gpu.md): one section per module, run by `runner`."""
