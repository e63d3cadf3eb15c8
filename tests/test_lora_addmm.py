"""LoRA's update in one ``addmm`` (``rapidlite.models.lora_addmm``): the same outputs and gradients as peft's own
forward, peft's forward wherever the ``addmm`` would not compute its function, and fewer output-sized tensors
(counted as they are made)."""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rapidlite.models.lora_addmm import AddmmLoraLinear, fuse_lora_updates

peft = pytest.importorskip("peft")


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(24, 40), nn.Linear(40, 24, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def adapted(dropout: float = 0.0, dtype: torch.dtype = torch.float32, **config) -> nn.Module:
    """A peft model over ``TwoLayers``; its B matrices are random, so the update is not zero."""
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, lora_alpha=12, lora_dropout=dropout, target_modules=["up", "down"], **config)
    model = peft.get_peft_model(TwoLayers().to(dtype), lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.5)
    return model


def pair(**kwargs) -> tuple[nn.Module, nn.Module]:
    ref = adapted(**kwargs)
    fused = copy.deepcopy(ref)
    assert fuse_lora_updates(fused) == 2 and all(
        type(m) is AddmmLoraLinear for m in fused.modules() if isinstance(m, peft.tuners.lora.layer.Linear)
    )
    return ref, fused


def forward_backward(model: nn.Module, x: torch.Tensor, seed: int = 1):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    out = model(x)
    (out.float() ** 2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def assert_same(ref, fused, x, atol=1e-10, adapters=True):
    out_r, dx_r, g_r = forward_backward(ref, x)
    out_f, dx_f, g_f = forward_backward(fused, x)
    assert g_r.keys() == g_f.keys() and any("lora_A" in n for n in g_r) == adapters
    torch.testing.assert_close(out_f, out_r, atol=atol, rtol=atol)
    torch.testing.assert_close(dx_f, dx_r, atol=atol, rtol=atol)
    for name in g_r:
        torch.testing.assert_close(g_f[name], g_r[name], atol=atol, rtol=atol, msg=name)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_addmm_gives_peft_outputs_and_gradients(dropout):
    ref, fused = pair(dropout=dropout, dtype=torch.float64)  # float64: the sums differ only in their order
    assert_same(ref, fused, torch.randn(3, 5, 24, dtype=torch.float64))  # [batch, tokens, features]


def test_peft_forward_where_addmm_does_not_apply():
    ref, fused = pair(use_dora=True)  # a LoRA variant
    assert_same(ref, fused, torch.randn(2, 24), atol=0)
    ref, fused = pair()
    with ref.disable_adapter(), fused.disable_adapter():
        assert_same(ref, fused, torch.randn(2, 24), atol=0, adapters=False)
    # fp32 adapters over a bf16 base without autocast: peft adds in fp32 and casts back
    ref, fused = pair(dtype=torch.bfloat16)
    for model in (ref, fused):
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
    assert_same(ref, fused, torch.randn(2, 24, dtype=torch.bfloat16), atol=0)


def test_merged_adapters_run_the_base_alone():
    ref, fused = pair()
    x = torch.randn(2, 24)
    expected = ref(x)
    fused.merge_adapter()
    torch.testing.assert_close(fused(x), expected, atol=1e-5, rtol=1e-5)


def test_cpu_autocast_bf16_matches_peft():
    ref, fused = pair()
    x = torch.randn(4, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_r, out_f = ref(x), fused(x)
    assert out_f.dtype == out_r.dtype == torch.bfloat16
    torch.testing.assert_close(out_f.float(), out_r.float(), atol=5e-2, rtol=2e-2)


class OutputSized(TorchDispatchMode):
    """The memory blocks of ``numel`` elements (the layer's output size) the ops make: views share their base's,
    and every tensor is held, so no block is made twice at one address."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.held, self.blocks = numel, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel:
                self.held.append(t)
                self.blocks.add(t.untyped_storage().data_ptr())
        return out


def test_one_output_sized_tensor_where_peft_makes_three():
    ref, fused = pair()
    layer = {name: model.base_model.model.up for name, model in (("peft", ref), ("addmm", fused))}
    x = torch.randn(64, 24)
    counts = {}
    for name, module in layer.items():
        with OutputSized(64 * 40) as mode:
            module(x)
        counts[name] = len(mode.blocks)
    assert counts == {"peft": 4, "addmm": 2}, counts  # the base output, and B's output, its scaled copy, the sum


def test_rapidlite_prepare_fuses_the_adapters():
    from rapidlite.config.sections import LoraConfig
    from rapidlite.models.lora import prepare

    model = prepare(TwoLayers(), LoraConfig(lora_rank=4, lora_target_modules=["up"]), None, torch.device("cpu"))
    assert [type(m).__name__ for m in model.modules() if isinstance(m, peft.tuners.lora.layer.Linear)] == [
        "AddmmLoraLinear"
    ]
