"""Process-wide fixes of Inductor defects still present in the pinned torch (2.11, 2.13).

Installed at import of this module (the graph passes that hand graphs to Inductor import it),
as upstream's fixes would be: Inductor compiles a backward lazily, outside any scope of ours.
"""

from __future__ import annotations

import functools


# Inductor's C++ backend aligns two nodes' loop ranges before fusing them by recomputing a node's
# loop body (``SchedulerNode.recompute_size_and_body``). That re-reads the node's dependencies
# from the body, which names a buffer an extern kernel mutated in place (the ``bernoulli_`` of a
# dropout mask, a max-pool backward's scatter) by its pre-mutation name, and re-applies the
# node's ``mutation_renames`` only when the node also has fake deps. The reader then no longer
# depends on the mutation and can be fused ahead of it: it reads the buffer before the kernel
# fills it (uninitialised memory: NaN losses in T5 on a dp x tp mesh). Fixed upstream by
# pytorch/pytorch#185873 (issue #185509); torch 2.13 still has it. Installed process-wide, as
# upstream's fix is: Inductor compiles a backward lazily, outside any scope of ours.
def install_inductor_mutation_order_fix() -> bool:
    """Make ``recompute_size_and_body`` re-apply mutation renames (see above). Idempotent;
    returns False where this torch has no such method. (2.11, 2.13)"""
    from torch._inductor.scheduler import SchedulerNode

    original = getattr(SchedulerNode, "recompute_size_and_body", None)
    if original is None:
        return False
    if getattr(original, "_dynamo_dist_patch", False):
        return True

    @functools.wraps(original)
    def recompute_size_and_body(self, *args, **kwargs):
        original(self, *args, **kwargs)
        renames = getattr(self, "mutation_renames", None)
        if renames:  # idempotent: a name already renamed is not a key
            self.set_read_writes(self.read_writes.rename(renames))

    recompute_size_and_body._dynamo_dist_patch = True
    SchedulerNode.recompute_size_and_body = recompute_size_and_body
    return True


install_inductor_mutation_order_fix()
