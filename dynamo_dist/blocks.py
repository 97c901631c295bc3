"""Per-block compile: each repeated block of a model compiled on its own (torchtitan's way).

    shard_module(model, mesh, plan)
    dynamo_dist.compile_blocks(model)            # every decoder layer: block.compile("dist")
    loss = model(ids, labels=ids).loss           # blocks compiled, the rest eager on DTensors

Dynamo compiles one block and reuses it for every layer with the same code and input
placements, so compile time does not grow with depth. The code between the blocks (embedding,
final norm, head, a convolutional stem) runs eagerly on DTensors; ``shard_module`` gives it the
hooks that make that work under any plan (``plans/apply.py``, ``eager_conv``).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch.nn as nn

from inductor_passes.core.errors import DistCompileError

log = logging.getLogger("dynamo_dist")


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the entries of every ``nn.ModuleList`` of two or more that
    is not inside another such list's entry (decoder layers, not a MoE layer's experts), in
    module order."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList) and len(child) >= 2:
                found.extend(child)
            else:
                visit(child)

    visit(model)
    return found


def compile_blocks(model: nn.Module, blocks: Sequence[nn.Module] | None = None, *,
                   backend: str = "dist", options: dict | None = None,
                   **compile_kwargs: Any) -> list[nn.Module]:
    """Compile each of ``blocks`` (default: ``repeated_blocks(model)``) in place with
    ``Module.compile(backend=..., options=..., **compile_kwargs)``; returns the blocks.

    ``Module.compile`` keeps each block's module hooks and parameters where they are (the
    optimizer and ``state_dict`` see the same module); its hooks run inside the compiled
    region. Call it after ``shard_module``: a block's parameters are then DTensors and the
    block's program is planned with their placements.

    Raises DistCompileError when there are no blocks (no ``nn.ModuleList`` of two or more
    entries: a one-layer model, or layers held otherwise), since compiling nothing would
    silently run the whole model eagerly; pass ``blocks=`` explicitly, or compile the model
    whole.

    Logs a warning for a model in training mode whose ``config.use_cache`` is on (transformers'
    default): the model hands its KV cache to every layer, Dynamo guards on that layer's own
    cache state, and the block is compiled once per layer (past Dynamo's recompile limit the
    rest run uncompiled). The fix is ``model.config.use_cache = False`` for training.
    """
    chosen = list(repeated_blocks(model) if blocks is None else blocks)
    if not chosen:
        raise DistCompileError(
            f"compile_blocks: {type(model).__name__} has no repeated blocks (no nn.ModuleList "
            f"of two or more entries), so nothing would be compiled",
            fix="pass the blocks to compile (compile_blocks(model, blocks=[...])), or compile "
                "the whole model: torch.compile(model, backend='dist')")
    if model.training and getattr(getattr(model, "config", None), "use_cache", False):
        log.warning(
            "compile_blocks: %s.config.use_cache is True, so each layer gets the KV cache and "
            "Dynamo compiles the block once per layer (%d layers; past "
            "torch._dynamo.config.recompile_limit the rest run uncompiled). For training set "
            "model.config.use_cache = False (or call the model with use_cache=False).",
            type(model).__name__, len(chosen))
    for block in chosen:
        block.compile(backend=backend, options=options, **compile_kwargs)
    return chosen
