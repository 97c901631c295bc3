"""dynamo_dist: a torch.compile backend that turns single-device-style PyTorch plus sharding
annotations into an SPMD program (local ops + functional collectives, compiled by Inductor).

    model = shard_module(model, mesh, TensorParallelPlanner().build_plan(model))
    compiled = torch.compile(model, backend="dist")
"""

import importlib

# Names resolve on first use: ``import dynamo_dist`` stays light, and Dynamo and DTensor are
# patched (``patches.install``) only once the backend is imported.
_EXPORTS = {
    "DistCompileError": "inductor_passes.core.errors",
    "PlannerConfig": "inductor_passes.sharding.config",
    "PlanMethod": "inductor_passes.sharding.config",
    "with_sharding_constraint": ".spmd",
    "mark_sharding": ".spmd",
    "clear_sharding": ".spmd",
    "enable_manual_sharding": ".spmd",
    "disable_manual_sharding": ".spmd",
    "local_map": ".spmd",
    "partition_spec_to_placements": ".spmd",
    "placements_to_partition_spec": ".spmd",
    "Mesh": ".mesh",
    "HybridMesh": ".mesh",
    "get_1d_mesh": ".mesh",
    "set_global_mesh": ".mesh",
    "get_global_mesh": ".mesh",
    "dist_backend": ".backend",
    "compile_records": ".backend",
    "clear_compile_records": ".backend",
    "ShardingPlan": ".plans",
    "PartitionSpec": ".plans",
    "TensorParallelPlanner": ".plans",
    "DataParallelPlanner": ".plans",
    "shard_module": ".plans",
    "explain": ".diagnose",
    "compile_blocks": ".blocks",
    "repeated_blocks": ".blocks",
    "backward_records": ".compiled_autograd",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'dynamo_dist' has no attribute {name!r}")
