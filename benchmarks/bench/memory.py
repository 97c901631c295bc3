"""Peak memory of one training step on this rank, in bytes.

CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the caching
allocator's own counter; it includes everything resident).

CPU has no allocator peak counter. We run the step under ``torch.profiler`` with
``profile_memory=True``: the CPU allocator reports every allocation (+bytes) and free (-bytes)
made while the profiler is on, Inductor's buffers and DTensor/FSDP2 storage resizes included.
The peak of the running sum over time is the step's peak ABOVE what was live when it started
(frees of older blocks are not reported, so it is an upper bound on that rise). What was live is
the contestant's resident state: its parameters, gradients and optimizer state on this rank
(local shards for DTensors), counted from the tensors themselves. Peak = resident + rise.
Allocations outside torch's allocator (gloo's own buffers, Python objects) are not counted.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held on this rank by ``tensors`` (a DTensor counts its local shard), each storage
    counted once."""
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        try:
            key = t.untyped_storage().data_ptr()
            size = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            key, size = id(t), t.numel() * t.element_size()
        if key in seen and key != 0:
            continue
        seen.add(key)
        total += size
    return total


def resident_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer):
    """Parameters, gradients, buffers and optimizer state: what lives across steps."""
    yield from model.parameters()
    yield from (p.grad for p in model.parameters() if p.grad is not None)
    yield from model.buffers()
    for state in opt.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def step_peak(step: Callable[[], object], device: torch.device, resident: int) -> dict:
    """Run ``step()`` once and return {"method", "resident_bytes", "rise_bytes", "peak_bytes"}."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        return {"method": "torch.cuda.max_memory_allocated", "resident_bytes": base,
                "rise_bytes": peak - base, "peak_bytes": peak}

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU)
    running = rise = 0
    for _, nbytes in events:
        running += nbytes
        rise = max(rise, running)
    return {"method": "torch.profiler profile_memory: resident + peak of running alloc-free sum",
            "resident_bytes": resident, "rise_bytes": rise, "peak_bytes": resident + rise}
