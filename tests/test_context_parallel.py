"""Context parallelism's attention (``rapidlite.parallel.context_parallel``) against SDPA on the whole sequence."""

import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO
from rapidlite.parallel.context_parallel import segments_from_positions, shard, shard_indices, unshard

# Every case on N forked ranks over gloo: each rank attends its load-balanced shard and compares its output and
# its shard of the input gradients with SDPA on the whole sequence (fp32); rank 0 prints the largest errors.
ATTENTION = r"""
import json, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
import torch.nn.functional as F
from rapidlite.parallel.context_parallel import context_parallel_attention, shard, segments_from_positions

def reference(q, k, v, causal, segments):
    mask = None
    if segments is not None:
        mask = (segments[:, :, None] == segments[:, None, :])[:, None]
        if causal:
            mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])

def run(rank, n):
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=n)
    group = dist.new_group(list(range(n)))
    errors = {}
    for comm in ("p2p", "a2a"):
        for causal in (True, False):
            for kv_heads in (4, 2):
                for packed in (False, True):
                    if comm == "a2a" and kv_heads % n:
                        continue
                    g = torch.Generator().manual_seed(0)
                    b, s, d = 2, 8 * n, 8
                    q = torch.randn(b, 4, s, d, generator=g, requires_grad=True)
                    k = torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True)
                    v = torch.randn(b, kv_heads, s, d, generator=g, requires_grad=True)
                    grad = torch.randn(b, 4, s, d, generator=g)
                    segments = None
                    if packed:  # documents of 3..9 tokens, crossing the shards' borders
                        positions = torch.cat([torch.arange(s) % 5, (torch.arange(s) + 2) % 7]).view(b, s)
                        segments = segments_from_positions(positions)
                    want = reference(q, k, v, causal, segments)
                    want.backward(grad)
                    expected = [want] + [t.grad for t in (q, k, v)]
                    local = [shard(t.detach(), n, rank, dim=2).requires_grad_() for t in (q, k, v)]
                    out = context_parallel_attention(*local, group, comm, causal=causal,
                        segment_ids=None if segments is None else shard(segments, n, rank, dim=1))
                    out.backward(shard(grad, n, rank, dim=2))
                    got = [out] + [t.grad for t in local]
                    errors[f"{comm} causal={causal} kv_heads={kv_heads} packed={packed}"] = max(
                        (a - shard(e, n, rank, dim=2)).abs().max().item() for a, e in zip(got, expected))
    gathered = [None] * n
    dist.all_gather_object(gathered, errors)
    if rank == 0:
        print(json.dumps({case: max(e[case] for e in gathered) for case in errors}))
    dist.destroy_process_group()

n = int(sys.argv[2])
mp.start_processes(run, args=(n,), nprocs=n, start_method="fork")
"""


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_and_ulysses_attention_equal_sdpa_on_the_whole_sequence(tmp_path, ranks):
    """Outputs and the gradients of q, k and v within 1e-5 of one process's SDPA: causal and not, with grouped
    key/value heads, with packed documents whose borders fall inside and across the shards."""
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", ATTENTION, str(tmp_path / "store"), str(ranks)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.splitlines()[-1])
    expected_cases = 16 if ranks == 2 else 12  # a2a needs the 2 key/value heads divisible by the ranks
    assert len(errors) == expected_cases, errors
    assert all(error < 1e-5 for error in errors.values()), errors


def test_the_split_balances_causal_work_and_reassembles():
    """Rank i holds chunks i and 2N-1-i; every token is held once; under a causal mask each rank's queries see
    the same number of keys."""
    assert shard_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for n in (2, 4):
        seen = [(shard_indices(32, n, r) + 1).sum().item() for r in range(n)]  # keys seen by the rank's queries
        assert len(set(seen)) == 1, seen
        x = torch.arange(64).view(2, 32)
        assert torch.equal(unshard([shard(x, n, r) for r in range(n)]), x)
    with pytest.raises(ValueError, match="not divisible by 2 x context-parallel size 4"):
        shard_indices(12, 4, 0)
    assert segments_from_positions(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist() == [[1, 1, 1, 2, 2, 3]]
