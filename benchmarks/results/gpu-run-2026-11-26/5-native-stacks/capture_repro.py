import sys, tempfile, os
import torch, torch.distributed as dist
import torch_hca  # noqa
world = 1
tmp = tempfile.mkdtemp()
torch.cuda.set_device(0)
dist.init_process_group("hca", init_method=f"file://{tmp}/store", rank=0, world_size=1)
t = torch.ones(1000, device="cuda")
torch.cuda.synchronize()
if len(sys.argv) > 1 and sys.argv[1] == "warm":
    dist.all_reduce(t); torch.cuda.synchronize(); print("warm-up call done", flush=True)
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g):
        print("capturing: calling all_reduce", flush=True)
        dist.all_reduce(t)
except RuntimeError as e:
    print("refused:", str(e)[:300], flush=True)
dist.all_reduce(t)
torch.cuda.synchronize()
print("after:", t[:3].tolist(), flush=True)
dist.destroy_process_group()
