"""GPU smoke check (run on a GPU machine): the dist backend on CUDA with Inductor's Triton path,
a 1-rank NCCL mesh (the sharded program, planned, lowered and compiled by Inductor to Triton),
checked against eager; prints compile stages and the median step time."""
import os, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
print("torch", torch.__version__, "cuda", torch.cuda.get_device_name(0))
import dynamo_dist
from dynamo_dist.plans import ShardingPlan, shard_module

class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc1 = torch.nn.Linear(1024, 4096); self.fc2 = torch.nn.Linear(4096, 1024)
    def forward(self, x):
        return torch.nn.functional.gelu(self.fc1(x)) @ self.fc2.weight.t()

os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29555")
dist.init_process_group("nccl", rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
torch.manual_seed(0)
ref = MLP().cuda()
m = MLP().cuda(); m.load_state_dict(ref.state_dict())
shard_module(m, mesh, ShardingPlan(plan={"fc1.weight": {"tp": Shard(0)}, "fc1.bias": {"tp": Shard(0)},
                                         "fc2.weight": {"tp": Shard(1)}}))
x = torch.randn(64, 1024, device="cuda")
t = time.time()
# "dist" is an entry point of the installed package; uninstalled, pass the function
backend = "dist" if "dist" in torch._dynamo.list_backends() else dynamo_dist.dist_backend
c = torch.compile(m, backend=backend)
out = c(x); out.sum().backward(); torch.cuda.synchronize()
print("compile+first step s", round(time.time() - t, 1))
r = ref(x); r.sum().backward()
o = out.full_tensor() if hasattr(out, "full_tensor") else out
print("max rel out diff", ((o - r).abs().max() / r.abs().max()).item())
g = m.fc1.weight.grad.full_tensor()
print("max rel grad diff", ((g - ref.fc1.weight.grad).abs().max() / ref.fc1.weight.grad.abs().max()).item())
rec = dynamo_dist.compile_records()[-1]
print("seconds", {k: round(v, 2) for k, v in rec.seconds.items()})

ts = []
for _ in range(20):
    torch.cuda.synchronize(); t = time.perf_counter(); c(x).sum().backward(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
ts.sort(); print("median step ms", round(ts[10] * 1000, 3))
