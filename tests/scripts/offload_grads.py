"""Gradients of one global batch with and without ``--offload-activations`` on the same composed model, under
the layout the flags give (run as ``python offload_grads.py --nproc-per-node 2 ...``); rank 0 prints JSON."""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from pretrain_custom_model import TinyCausalLM  # noqa: E402

from rapidlite import RapidliteEngine  # noqa: E402

engine = RapidliteEngine()
torch.manual_seed(0)
model, optimizer, _ = engine.compose(TinyCausalLM(vocab=64, hidden=32, layers=2, heads=4, seq=16, dropout=0.0))
strategy = engine.strategy
tokens = torch.randint(0, 64, (2, 2, 17), generator=torch.Generator().manual_seed(1 + engine.dist.rank))


def gradients() -> tuple[float, list[torch.Tensor]]:
    optimizer.zero_grad()
    steps = [lambda t=t: F.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten()) for t in tokens]
    loss, _ = strategy.forward_backward(model, optimizer, steps)
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
    return loss.item(), [g.clone() for g in local]


loss_on, grads_on = gradients()
packed, strategy.offload = strategy.offload.packed, None
loss_off, grads_off = gradients()
same = loss_on == loss_off and all(torch.equal(a, b) for a, b in zip(grads_on, grads_off, strict=True))
every_rank = torch.tensor(int(same))
torch.distributed.all_reduce(every_rank, op=torch.distributed.ReduceOp.MIN)  # every rank's shards agree
same = bool(every_rank)
if engine.is_main_process:
    print(json.dumps({"same": same, "packed": packed, "strategy": strategy.name}))
