"""Module sharding plans: which placement each parameter and input gets.

``ShardingPlan`` (``spec``) is plain data: fqn pattern -> placement spec. A planner builds one
from a module (``TensorParallelPlanner``: Megatron pairs from the program's dataflow;
``DataParallelPlanner``: batch split, FSDP or DDP); ``shard_module`` (``apply``) applies it:
parameters become DTensors, inputs get sharding constraints. The compiler then plans every other
value of the program.
"""

from ..annotations import validate_placements
from .apply import parameter_groups, shard_module
from .data_parallel import DataParallelPlanner
from .spec import ParamDecision, PartitionSpec, ShardingPlan, format_decisions, to_placements
from .tensor_parallel import ShardingPlanner, TensorParallelPlanner

__all__ = ["DataParallelPlanner", "ParamDecision", "PartitionSpec", "ShardingPlan",
           "ShardingPlanner", "TensorParallelPlanner", "format_decisions", "parameter_groups",
           "shard_module", "to_placements", "validate_placements"]
