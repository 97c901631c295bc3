"""Benchmarks: step time, compile time, communication and memory of ``backend="dist"`` against
one process (eager, Inductor) and DTensor (eager, Inductor). See benchmarks/README.md."""
