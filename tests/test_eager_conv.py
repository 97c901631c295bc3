"""Eager DTensor convolutions with split weights (``dynamo_dist.eager_conv``) and
``compile_blocks``: what runs between compiled blocks computes what one device computes."""

import logging

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dynamo_dist
from conftest import FULL
from dynamo_dist import eager_conv
from inductor_passes.core.errors import DistCompileError


@pytest.fixture(scope="module")
def sim():
    """(LocalTensorMode over a fake process group of 4 ranks: every rank in this process,
    meshes by shape: (4,) named dp, (2, 2) named dp x tp)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    eager_conv.install()
    mode = LocalTensorMode(frozenset(range(4)))
    with mode:  # (meshes made once: a new mesh makes new process groups)
        meshes = {(4,): init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)),
                  (2, 2): init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}
    yield mode, meshes
    dist.destroy_process_group()


def _value(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's value of a (global) tensor computed under LocalTensorMode."""
    from torch.distributed._local_tensor import LocalTensor

    return t._local_tensors[0] if isinstance(t, LocalTensor) else t


def _placement(ndim: int):
    return st.sampled_from([Replicate(), *(Shard(d) for d in range(ndim))])


# (conv dims, groups, transposed): conv1d / conv2d, grouped, a transposed 2-D convolution
_KINDS = st.sampled_from([(1, 1, False), (2, 1, False), (2, 2, False), (2, 1, True)])


@settings(max_examples=200 if FULL else 30, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=_KINDS, two_d=st.booleans(), bias=st.booleans(), data=st.data())
def test_any_placement_of_a_convolution_computes_what_one_device_computes(sim, kind, two_d,
                                                                          bias, data):
    """Input, weight and bias in random placements (a weight split over output or input
    channels, an input split over batch, channels or height, on a 1-D mesh of 4 or a 2 x 2 one):
    the output and the three gradients equal one device's. An input split over its last dim
    with a replicated weight is DTensor's own halo-exchange path and is not drawn."""
    dims, groups, transposed = kind
    torch.manual_seed(0)
    spatial = (8,) * dims
    cin, cout = 4, 8
    x = torch.randn(4, cin, *spatial)
    conv_cls = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d}[dims]
    if transposed:
        conv_cls = torch.nn.ConvTranspose2d
    ref = conv_cls(cin, cout, 3, padding=1, groups=groups, bias=bias)
    x1 = x.clone().requires_grad_()
    want_out = ref(x1)
    want_out.square().sum().backward()
    shape = (2, 2) if two_d else (4,)
    xp = [data.draw(_placement(x.ndim - 1)) for _ in shape]  # never the last (width) dim
    wp = [data.draw(_placement(ref.weight.ndim)) for _ in shape]
    bp = [data.draw(_placement(1)) for _ in shape]
    mode, meshes = sim
    with mode:
        mesh = meshes[shape]
        w = torch.nn.Parameter(distribute_tensor(ref.weight.detach(), mesh, wp))
        b = torch.nn.Parameter(distribute_tensor(ref.bias.detach(), mesh, bp)) if bias else None
        xd = distribute_tensor(x, mesh, xp).requires_grad_()
        fn = {(1, False): torch.nn.functional.conv1d, (2, False): torch.nn.functional.conv2d,
              (2, True): torch.nn.functional.conv_transpose2d}[(dims, transposed)]
        out = fn(xd, w, b, padding=1, groups=groups)
        out.square().sum().backward()
        got = {"out": out.full_tensor(), "x": xd.grad.full_tensor(),
               "w": w.grad.full_tensor(), **({"b": b.grad.full_tensor()} if bias else {})}
    want = {"out": want_out, "x": x1.grad, "w": ref.weight.grad,
            "b": ref.bias.grad if bias else None}
    for key, value in got.items():
        torch.testing.assert_close(_value(value), want[key].detach(), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, k=key: f"{k} {xp} {wp} {bp}: {m}")


def test_a_split_weight_is_gathered_and_its_gradient_is_a_pending_sum(sim):
    """FSDP's layout: input split over the batch, weight over output channels, on dp: the
    output stays split over the batch and the weight's gradient is a pending sum over dp
    (``shard_module``'s hook reduce_scatters it to the weight's placement)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    mode, meshes = sim
    with mode:
        mesh = meshes[(4,)]
        w = torch.nn.Parameter(distribute_tensor(conv.weight.detach(), mesh, [Shard(0)]))
        b = torch.nn.Parameter(distribute_tensor(conv.bias.detach(), mesh, [Shard(0)]))
        x = distribute_tensor(torch.randn(8, 3, 6, 6), mesh, [Shard(0)])
        out = torch.nn.functional.conv2d(x, w, b, padding=1)
        assert isinstance(out, DTensor) and out.placements == (Shard(0),)
        assert out.shape == (8, 8, 6, 6) and out.to_local().shape == (2, 8, 6, 6)
        out.sum().backward()
        assert w.grad.placements[0].is_partial() and b.grad.placements[0].is_partial()


def test_compile_blocks_finds_the_layers_and_refuses_a_model_without_any():
    from dynamo_dist.testing.models import LlamaSize, build_llama

    model = build_llama(LlamaSize(layers=3))
    assert dynamo_dist.repeated_blocks(model) == list(model.model.layers)
    one = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    with pytest.raises(DistCompileError, match="no repeated blocks") as err:
        dynamo_dist.compile_blocks(one)
    assert "blocks=" in str(err.value)


def test_compile_blocks_warns_of_a_kv_cache_in_training(caplog):
    """transformers' default ``use_cache=True`` compiles the block once per layer in training:
    warned, with the fix; not in eval mode (generation wants the cache) nor with the cache off."""
    from dynamo_dist.testing.models import LlamaSize, build_llama

    model = build_llama(LlamaSize(layers=2))
    model.config.use_cache = True
    with caplog.at_level(logging.WARNING, logger="dynamo_dist"):
        dynamo_dist.compile_blocks(model)
    warned = [r.getMessage() for r in caplog.records if "use_cache" in r.getMessage()]
    assert len(warned) == 1 and "LlamaForCausalLM" in warned[0] and "use_cache = False" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dynamo_dist"):
        dynamo_dist.compile_blocks(model.eval())
        model.train().config.use_cache = False
        dynamo_dist.compile_blocks(model)
    assert not [r for r in caplog.records if "use_cache" in r.getMessage()]


def test_a_plain_input_with_a_replicated_weight_runs_forward_and_backward(sim):
    """ViT's pixels are a plain tensor (a global value) and a tensor-parallel plan may leave the
    patch embedding replicated: DTensor's backward handler asserts on a plain input."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 2, stride=2, bias=False)
    x = torch.randn(2, 3, 4, 4)
    mode, meshes = sim
    with mode:
        mesh = meshes[(4,)]
        w = torch.nn.Parameter(distribute_tensor(conv.weight.detach(), mesh, [Replicate()]))
        out = torch.nn.functional.conv2d(x, w, stride=2)
        out.square().sum().backward()
        got = w.grad.full_tensor()
    conv(x).square().sum().backward()
    torch.testing.assert_close(_value(got), conv.weight.grad, rtol=1e-5, atol=1e-5)
