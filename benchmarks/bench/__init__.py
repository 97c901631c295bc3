"""The shared harness of the benchmarks: one module per job.

workload     what a workload is (model, batch, loss, plans, mesh)
contestants  the five ways to run one training step on a workload
runner       the phases of one run (compile, interleaved timing, collectives, memory, numerics)
comm         counts collectives at run time (a TorchDispatchMode)
memory       peak memory of one step per rank
stats        median / IQR / min / max of step times
report       markdown tables, ratios and targets; chart: the PNG
profiling    ``--profile CONTESTANT``: torch.profiler top ops and a chrome trace
machine      what the run ran on
"""
