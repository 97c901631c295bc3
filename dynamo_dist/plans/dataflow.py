"""Which projection feeds which: one forward run that follows tensor provenance, for the
tensor-parallel planner.

A projection is any op that multiplies activations by a parameter matrix: ``F.linear``
(``nn.Linear``; a 3-D expert tensor indexed per expert), ``torch.addmm`` / ``matmul`` with a
parameter as the right operand (transformers' ``Conv1D``, weight ``[in, out]``), and
``torch._grouped_mm``. Megatron-LM's tensor parallelism (Shoeybi et al., 2019) pairs a
column-parallel projection (output features split) with the row-parallel projection that reads
its output (input features split), so that everything between them (activation, attention per
head, gating) runs on local shards and one all_reduce closes the pair.

The trace finds those pairs from the program itself rather than from module names: every
activation carries the set of column projections whose split output features it still holds.
Ops pass the set on, except ops that mix the features of a projection's full output width
(layer/RMS norm, softmax or a reduction over it): there the split would need a collective, so
the pair ends. A projection whose input carries such a set is row-parallel and its output
carries nothing (it is complete after the all_reduce); any other projection is a column
candidate. A column output split into equal parts along its full width (GPT-2's ``c_attn``
q|k|v by ``split``, Phi-3's ``qkv_proj`` by slices) is a fused projection, recorded with its
number of parts.

Everything is read on a real forward of the module on small example inputs, in eval mode, under
``no_grad``, with the RNG state restored after: the module is not changed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

# ops that normalise over their last dim(s)
_NORMALIZE = {"layer_norm", "rms_norm", "group_norm", "normalize"}
# ops whose ``dim`` argument names the dims they mix
_REDUCE = {"softmax", "log_softmax", "_softmax", "mean", "sum", "var", "std", "var_mean",
           "amax", "amin", "max", "min", "logsumexp", "norm", "topk", "argmax", "argmin",
           "cumsum", "sort", "argsort"}
_SPLIT = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes"}
# views that keep a parameter's identity (the weight a projection reads may be one)
_PARAM_VIEWS = {"__getitem__", "select", "transpose", "t", "__get__", "to", "contiguous",
                "float", "half", "bfloat16", "type_as", "detach"}
# ops that re-index or re-type their first argument: their result shares its root
_REINDEX = _PARAM_VIEWS | {"view", "reshape", "index_select", "permute", "unsqueeze", "squeeze",
                           "flatten", "expand", "narrow", "clone", "__get__"}


@dataclasses.dataclass
class Projection:
    """One parameter used as a projection weight. ``out_dim`` / ``in_dim``: the parameter's
    tensor dims that index output / input features; ``width``: the number of output features."""

    weight: nn.Parameter
    out_dim: int
    in_dim: int
    width: int
    bias: nn.Parameter | None = None
    role: str | None = None          # "column" | "row"
    feeds: list[int] = dataclasses.field(default_factory=list)   # ids of rows it feeds
    fed_by: list[int] = dataclasses.field(default_factory=list)  # ids of columns feeding it
    parts: int | None = None         # fused: output split into this many equal parts (0: unequal)
    cuts: set[int] = dataclasses.field(default_factory=set)  # last-dim slice bounds read of it
    conflict: str | None = None      # why the trace could not give it one role
    calls: int = 0
    heads: int | None = None         # its output viewed as [..., heads, head_dim]
    # per call, the activation its input was re-indexed from (ids): column projections that
    # read one root have their input gradients summed before Megatron's one all_reduce
    input_roots: list[int] = dataclasses.field(default_factory=list)


class _Provenance(TorchFunctionMode):
    def __init__(self, params: dict[int, nn.Parameter]) -> None:
        super().__init__()
        self.params = params
        self.tags: dict[int, frozenset[int]] = {}       # id(tensor) -> ids of column weights
        self.views: dict[int, tuple[int, bool, int]] = {}  # id(tensor) -> (param id, T, lead)
        self.alive: list[torch.Tensor] = []               # ids stay unique while tracing
        self.projections: dict[int, Projection] = {}
        self.roots: dict[int, int] = {}                    # id(tensor) -> id of its root
        # id(tensor) -> ids of embedding tables it was looked up from; and the tables whose
        # columns turn out to be attention heads (a relative position bias): table id -> heads
        self.lookups: dict[int, frozenset[int]] = {}
        self.head_tables: dict[int, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        call = _projection_call(name, args, kwargs, self._param_view)
        if call is not None:
            self._project(out, *call)
            return out
        self._follow_param_views(func, name, args, out)
        if name in _REINDEX and args and isinstance(args[0], torch.Tensor):
            root = self.roots.get(id(args[0]), id(args[0]))
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.roots[id(t)] = root
                    self.alive.append(t)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self._follow_lookups(name, args, kwargs, tensors, out)
        tags = frozenset().union(*(self.tags.get(id(t), frozenset()) for t in tensors))
        if tags:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            tags = self._surviving(name, x, args, kwargs, tags)
            if x is not None and name in _SPLIT:
                self._note_split(x, args, kwargs, out, tags)
            if x is not None and name == "__getitem__" and len(args) > 1:
                self._note_slice(x, args[1], tags)
            if x is not None and name in ("view", "reshape", "unflatten"):
                self._note_heads(x, out, tags)
        self._tag(out, tags)
        return out

    # -- parameters and their views ------------------------------------------------------------
    def _param_view(self, t: Any) -> tuple[nn.Parameter, bool, int] | None:
        """(parameter, last two dims swapped, leading dims indexed away) when ``t`` is a
        parameter or a view of one (``w[e]``, ``w.t()``)."""
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.params:
            return self.params[id(t)], False, 0
        view = self.views.get(id(t))
        return (self.params[view[0]], view[1], view[2]) if view else None

    def _follow_param_views(self, func, name: str, args, out) -> None:
        if name not in _PARAM_VIEWS or not args or not isinstance(out, torch.Tensor):
            return
        src = self._param_view(args[0])
        if src is None:
            return
        p, swapped, lead = src
        if name in ("__getitem__", "select"):
            index = args[1] if name == "__getitem__" else None
            if name == "select" or isinstance(index, int) or (
                    isinstance(index, torch.Tensor) and index.ndim == 0):
                lead += 1
            else:
                return
        elif name == "__get__":
            prop = getattr(getattr(func, "__self__", None), "__name__", None)
            if prop in ("T", "mT", "H", "mH"):
                swapped = not swapped
            elif prop not in ("data",):
                return
        elif name == "transpose":
            if {d % out.ndim for d in args[1:3]} != {out.ndim - 2, out.ndim - 1}:
                return
            swapped = not swapped
        elif name == "t":
            swapped = not swapped
        self.views[id(out)] = (id(p), swapped, lead)
        self.alive.append(out)

    # -- projections ---------------------------------------------------------------------------
    def _project(self, out, x: torch.Tensor, w: tuple[nn.Parameter, bool, int], out_axis: int,
                 bias: torch.Tensor | None) -> None:
        """``out_axis``: the dim of the weight AS THE OP READ IT that indexes output features
        (-2 for linear's [out, in], -1 for matmul's [in, out])."""
        p, swapped, lead = w
        if swapped:
            out_axis = -1 if out_axis == -2 else -2
        in_axis = -1 if out_axis == -2 else -2
        proj = self.projections.get(id(p))
        if proj is None:
            proj = self.projections[id(p)] = Projection(
                p, p.ndim + out_axis, p.ndim + in_axis, p.shape[out_axis])
            if bias is not None and id(bias) in self.params:
                proj.bias = self.params[id(bias)]
        proj.calls += 1
        proj.input_roots.append(self.roots.get(id(x), id(x)))
        self.alive.append(x)
        feeding = [c for c in self.tags.get(id(x), frozenset()) if c != id(p)]
        role = "row" if feeding else "column"
        if proj.role is not None and proj.role != role:
            proj.conflict = f"read as {proj.role}-parallel in one call and {role}-parallel in " \
                            f"another"
        proj.role = proj.role or role
        for c in feeding:
            if c not in proj.fed_by:
                proj.fed_by.append(c)
            col = self.projections[c]
            if id(p) not in col.feeds:
                col.feeds.append(id(p))
        self._tag(out, frozenset() if feeding else frozenset({id(p)}))

    def _surviving(self, name: str, x, args, kwargs, tags: frozenset[int]) -> frozenset[int]:
        """The tags that survive an op: it mixes a column's features when it normalises or
        reduces over a dim of exactly that column's output width."""
        if x is None:
            return tags
        mixed: list[int] = []
        if name in _NORMALIZE:
            mixed = [x.shape[-1]] if x.ndim else []
        elif name in _REDUCE:
            if len(args) > 1 and isinstance(args[1], torch.Tensor):
                return tags  # max(a, b), min(a, b): elementwise
            if name == "topk":
                dims = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            else:
                dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dims is None:
                return frozenset()  # a full reduction (a loss): nothing is split after it
            dims = dims if isinstance(dims, (list, tuple)) else [dims]
            mixed = [x.shape[d] for d in dims if isinstance(d, int) and -x.ndim <= d < x.ndim]
        if not mixed:
            return tags
        return frozenset(t for t in tags if self.projections[t].width not in mixed)

    def _note_split(self, x, args, kwargs, out, tags) -> None:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        if not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
            return
        pieces = out if isinstance(out, (tuple, list)) else [out]
        sizes = {p.shape[dim] for p in pieces if isinstance(p, torch.Tensor)}
        for t in tags:
            proj = self.projections[t]
            if x.shape[dim] == proj.width and dim % x.ndim == x.ndim - 1 and len(pieces) > 1:
                proj.parts = len(pieces) if len(sizes) == 1 else 0

    def _follow_lookups(self, name: str, args, kwargs, tensors, out) -> None:
        """Embedding lookups and what they flow into; a looked-up table whose columns meet the
        heads of an attention (its output is the mask SDPA adds, or is added to scores) is a
        head table."""
        if name == "embedding" and len(args) > 1 and id(args[1]) in self.params:
            found = frozenset({id(args[1])})
        else:
            found = frozenset().union(*(self.lookups.get(id(t), frozenset()) for t in tensors))
        if not found:
            return
        if name == "scaled_dot_product_attention":
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self._meet_heads(self.lookups.get(id(mask), frozenset()), mask, args[0])
        elif name in ("add", "__add__", "__radd__", "add_", "__iadd__") and len(tensors) == 2:
            a, b = tensors
            if self.tags.get(id(a)) and not self.tags.get(id(b)):
                a, b = b, a
            self._meet_heads(self.lookups.get(id(a), frozenset()), a, b)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.lookups[id(t)] = found
                self.alive.append(t)

    def _meet_heads(self, tables: frozenset[int], bias, scores) -> None:
        if not tables or not isinstance(bias, torch.Tensor) or bias.ndim < 3 or \
                not isinstance(scores, torch.Tensor) or scores.ndim < 3:
            return
        heads = [self.projections[t].heads for t in self.tags.get(id(scores), frozenset())]
        for table in tables:
            width = self.params[table].shape[-1]
            if width == bias.shape[-3] and width in heads:
                self.head_tables[table] = width

    def _note_slice(self, x, index, tags) -> None:
        """``x[..., a:b]`` of a column output's full width (Phi-3's q|k|v by slices): the cut
        points of every such read; the parts are the pieces between them (equal or not)."""
        idx = index if isinstance(index, tuple) else (index,)
        if not idx or not isinstance(idx[-1], slice) or idx[-1].step not in (None, 1):
            return
        if Ellipsis in idx:
            if idx.index(Ellipsis) != len(idx) - 2:
                return
        elif len(idx) != x.ndim or any(i != slice(None) for i in idx[:-1]):
            return
        start, stop, _ = idx[-1].indices(x.shape[-1])
        for t in tags:
            proj = self.projections[t]
            if x.shape[-1] != proj.width or stop <= start:
                continue
            proj.cuts.update((start, stop))
            bounds = sorted(proj.cuts | {0, proj.width})
            sizes = [b - a for a, b in zip(bounds, bounds[1:])]
            if len(sizes) > 1:
                proj.parts = len(sizes) if len(set(sizes)) == 1 else 0

    def _note_heads(self, x, out, tags) -> None:
        """A column output (or one part of a fused one) viewed as [..., heads, head_dim]."""
        if not isinstance(out, torch.Tensor) or out.ndim != x.ndim + 1 or \
                tuple(out.shape[:-2]) != tuple(x.shape[:-1]):
            return
        for t in tags:
            proj = self.projections[t]
            if proj.heads is None and x.shape[-1] in (proj.width, proj.width // (proj.parts or 1)):
                proj.heads = out.shape[-2]

    def _tag(self, out, tags: frozenset[int]) -> None:
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                if tags and t.is_floating_point():
                    self.tags[id(t)] = tags
                    self.alive.append(t)
                else:
                    self.tags.pop(id(t), None)


def _projection_call(name: str, args, kwargs, param_view: Callable) -> tuple | None:
    """(input, weight view, out axis of the weight as read, bias) if this call is a projection."""
    if name == "linear" and len(args) >= 2:
        w = param_view(args[1])
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        return (args[0], w, -2, bias) if w else None
    if name in ("addmm", "baddbmm") and len(args) >= 3:
        w = param_view(args[2])
        return (args[1], w, -1, args[0]) if w else None
    if name in ("matmul", "mm", "bmm", "__matmul__", "_grouped_mm") and len(args) >= 2:
        w = param_view(args[1])
        return (args[0], w, -1, None) if w and args[1].ndim >= 2 else None
    return None


def _norm_module_hook(mode: _Provenance):
    """Normalisation modules written by hand (transformers' RMSNorm classes: pow, mean, rsqrt)
    mix their input's last dim like ``F.layer_norm``; their output ends the pairs."""
    def hook(module, inputs, output):
        if "Norm" not in type(module).__name__ or not inputs or \
                not isinstance(inputs[0], torch.Tensor) or not isinstance(output, torch.Tensor):
            return
        tags = mode.tags.get(id(inputs[0]), frozenset())
        width = inputs[0].shape[-1] if inputs[0].ndim else None
        mode._tag(output, frozenset(t for t in tags if mode.projections[t].width != width))
    return hook


@dataclasses.dataclass
class Dataflow:
    """What one traced forward says: the projections by id of their weight, and the embedding
    tables (by id) whose columns are attention heads -> the number of heads (T5's relative
    position bias is looked up per (query, key) pair and added to each head's scores, so it
    splits with the heads and its gradient stays local)."""

    projections: dict[int, Projection]
    head_tables: dict[int, int]


def trace_projections(module: nn.Module, args: tuple, kwargs: dict) -> Dataflow:
    """Run ``module(*args, **kwargs)`` once and read its dataflow.

    Raises whatever the forward raises (the caller falls back to the module structure).
    """
    params = {id(p): p for p in module.parameters()}
    mode = _Provenance(params)
    was_training = module.training
    handle = nn.modules.module.register_module_forward_hook(_norm_module_hook(mode))
    try:
        module.eval()
        with torch.random.fork_rng(devices=[]), torch.no_grad(), mode:
            module(*args, **kwargs)
    finally:
        handle.remove()
        module.train(was_training)
    return Dataflow(mode.projections, mode.head_tables)


def example_inputs(module: nn.Module) -> tuple[tuple, dict] | None:
    """Small inputs for a transformers model (its ``dummy_inputs``; an image batch for models
    whose main input is ``pixel_values``), on the module's device; None for other modules."""
    config = getattr(module, "config", None)
    main = getattr(module, "main_input_name", None)
    if config is None or main is None:
        return None
    device = next(module.parameters()).device
    if main == "pixel_values":
        size = getattr(config, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        channels = getattr(config, "num_channels", 3)
        return (), {"pixel_values": torch.randn(2, channels, size, size, device=device)}
    try:
        dummy = module.dummy_inputs
    except (AttributeError, NotImplementedError):
        return None
    return (), {k: v.to(device) for k, v in dummy.items()}
