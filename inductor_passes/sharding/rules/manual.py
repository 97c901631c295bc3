"""Manual regions (``to_local`` ... ``from_local``): local values are planned Replicate, so nothing
moves between them and lowering runs local code as written."""

from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor.placement_types import Replicate

from ...core import roles
from ...core.annotation_ops import ENTER_OP, EXIT_OP, decode_spec
from .base import OpSpec, RuleKind, replicated_spec


def manual_strategy(node: fx.Node, ndim_mesh: int) -> OpSpec | None:
    """Manual regions (``to_local`` ... ``from_local``): a local value is planned as Replicate,
    so nothing moves between local values and lowering runs local code as written; the region's
    entry reads its input in the region's placements and the exit produces them."""

    rep = tuple(Replicate() for _ in range(ndim_mesh))
    if node.target is ENTER_OP:
        return OpSpec((decode_spec(node.args[1])[1],), rep, RuleKind.MANUAL)
    if node.target is EXIT_OP:
        return OpSpec((rep,), decode_spec(node.args[1])[1], RuleKind.MANUAL)
    if node.meta.get(roles.MANUAL):
        return replicated_spec(node, ndim_mesh, RuleKind.MANUAL)
    return None

