"""Recognising collectives in an FX graph: the one matcher every stage uses.

Functional collectives (``torch.ops._c10d_functional``) are what lowering emits, what Dynamo
records for ``torch.distributed`` calls under compiled autograd, and what a rank's schedule is
compared by.
"""

from __future__ import annotations

import torch.fx as fx

_NAMESPACE = "_c10d_functional"


# _c10d_functional collective op -> ledger kind (wait_tensor is not a collective)
KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def collective_op(node: fx.Node) -> str | None:
    """The ``_c10d_functional`` op name of a collective node (``all_gather_into_tensor``, no
    overload), else None. Takes an OpOverload ("ns.op.overload") or an OpOverloadPacket
    ("ns.op"), as Dynamo's and AOTAutograd's graphs hold either."""
    if node.op != "call_function":
        return None
    ns, _, rest = str(node.target).partition(".")
    name = rest.split(".")[0]
    return name if ns == _NAMESPACE and name in KINDS else None


def collective_kind(node: fx.Node) -> str | None:
    """The ledger's kind of a functional collective node, else None."""
    op = collective_op(node)
    return KINDS[op] if op else None


def functional_collective_name(node: fx.Node) -> str | None:
    """The op name of any ``_c10d_functional`` op but ``wait_tensor`` (in-place and ``_out``
    variants included: a rank's schedule compares them all), else None."""
    if node.op != "call_function":
        return None
    ns, _, rest = str(node.target).partition(".")
    name = rest.split(".")[0]
    return name if ns == _NAMESPACE and name != "wait_tensor" else None
