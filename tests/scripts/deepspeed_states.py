"""DeepSpeed's own buffers on rank 0 against the plan's ZeRO rules (``rapidlite.planning.deepspeed``), after one
step of a composed model (run as ``python deepspeed_states.py --nproc-per-node 2 --deepspeed --zero-N-...``);
rank 0 prints JSON of (planned, engine's) pairs."""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from pretrain_custom_model import TinyCausalLM  # noqa: E402

from rapidlite import RapidliteEngine  # noqa: E402
from rapidlite.planning.deepspeed import deepspeed_states  # noqa: E402

engine = RapidliteEngine()
torch.manual_seed(0)
# 384 x 384 weights (147k elements) are partitioned under ZeRO-3; norms and biases stay whole (under 100k).
bare = TinyCausalLM(vocab=64, hidden=384, layers=2, heads=4, seq=16, dropout=0.0)
shapes = [
    p.detach().clone().requires_grad_(p.requires_grad) for p in bare.parameters()
]  # before DeepSpeed flattens or partitions them
model, optimizer, _ = engine.compose(bare)
tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1 + engine.dist.rank))
loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
model.backward(loss)
zero = model.optimizer
planned = deepspeed_states(engine.strategy.config, shapes, engine.dist.dp_size)
module = model.module
if engine.strategy.topology.zero_stage >= 3:  # a persistent tensor is whole; a partitioned one its ds_tensor
    held = sum((p.ds_tensor.numel() if not p.ds_persist else p.ds_numel) * 4 for p in module.parameters())
    fp32 = zero.fp32_partitioned_groups_flat
else:
    held = sum(p.numel() * 4 for p in module.parameters())
    fp32 = zero.single_partition_of_fp32_groups
out = {
    "params": (planned.params, held),
    "master": (planned.master, sum(t.numel() * 4 for t in fp32)),
    "stepped": (planned.stepped, sum(t.numel() for t in fp32)),
}
model.step()
if engine.dist.rank == 0:
    print(json.dumps(out), flush=True)
