"""dynamo_dist: a torch.compile backend that turns single-device-style PyTorch plus sharding
annotations into an SPMD program (local ops + functional collectives, compiled by Inductor).

    model = shard_module(model, mesh, TensorParallelPlanner().build_plan(model))
    compiled = torch.compile(model, backend="dist")
"""

from .annotations import with_sharding_constraint
from .backend import clear_compile_records, compile_records, dist_backend
from .errors import DistCompileError

__all__ = [
    "DistCompileError", "clear_compile_records", "compile_records", "dist_backend",
    "with_sharding_constraint",
]
