"""NVIDIA Apex: detected by its modules (not the unrelated PyPI ``apex``), used only where it applies, and its
FusedAdam behaves like torch's AdamW for the rest of rapidlite (wrapper, checkpoints, resume).

There is no GPU and no Apex here: stand-in modules are put in ``sys.modules``. The stand-in FusedAdam keeps
Apex's interface and bookkeeping (per-group step count, ``zero_grad()`` without arguments) and does AdamW's
arithmetic, so runs through it can be compared with torch's AdamW."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from torch import nn

from rapidlite import optim
from rapidlite.checkpoint import dcp as ckpt
from rapidlite.config.sections import OptimizerConfig
from rapidlite.errors import ConfigError
from rapidlite.models.apex import nvidia_apex
from rapidlite.models.families.gpt import gpt_plan
from rapidlite.models.gpt import GPTConfig, GPTModel
from rapidlite.optim import RapidliteOptimizer, apex_adamw_class, build_optimizer, builders

APEX_MODULES = ("apex", "apex.optimizers", "apex.normalization")

# Checkpointing imports torch.distributed.optim, whose import-time torch.jit use warns (torch's own noise).
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")


class StandInFusedAdam(torch.optim.Optimizer):
    """Apex's FusedAdam interface on the CPU: step counted per group, zero_grad() takes no argument."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
    ):
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def zero_grad(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), step = group["betas"], group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p).float()
                    state["exp_avg_sq"] = torch.zeros_like(p).float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if self.adam_w_mode:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**step))


class StandInFusedLayerNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True):
        super().__init__()
        self.normalized_shape = (normalized_shape,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))

    def forward(self, x):
        return nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def _install(monkeypatch, **modules):
    for name in APEX_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def no_apex(monkeypatch):
    _install(monkeypatch, apex=None)  # None in sys.modules: ``import apex`` raises ImportError


@pytest.fixture
def unrelated_apex(monkeypatch):
    """The PyPI package ``apex``: a module of that name, but no optimizers or normalization in it."""
    _install(monkeypatch, apex=types.ModuleType("apex"))


@pytest.fixture
def fake_apex(monkeypatch):
    package, optimizers, normalization = (types.ModuleType(name) for name in APEX_MODULES)
    optimizers.FusedAdam = StandInFusedAdam
    normalization.FusedLayerNorm = StandInFusedLayerNorm
    package.optimizers, package.normalization = optimizers, normalization
    _install(monkeypatch, **dict(zip(APEX_MODULES, (package, optimizers, normalization), strict=True)))


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


CFG = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)


def train(model: nn.Module, optimizer: RapidliteOptimizer, steps: int, seed: int = 1) -> None:
    data = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(16, 4, generator=data)
        optimizer.backward(model(x).pow(2).mean())
        optimizer.step()


# ------------------------------------------------------------------------------------------ detection
def test_no_apex_is_not_detected(no_apex):
    assert nvidia_apex() is None
    assert apex_adamw_class("cuda", sharded=False) is None


def test_the_unrelated_pypi_apex_is_not_detected(unrelated_apex):
    assert nvidia_apex() is None
    assert apex_adamw_class("cuda", sharded=False) is None


def test_nvidia_apex_is_detected_by_its_modules(fake_apex):
    apex = nvidia_apex()
    assert apex is not None
    assert apex.fused_adam is StandInFusedAdam and apex.fused_layer_norm is StandInFusedLayerNorm


def test_fused_adam_only_for_plain_cuda_parameters(fake_apex):
    chosen = apex_adamw_class("cuda", sharded=False)
    assert chosen is not None and issubclass(chosen, StandInFusedAdam)
    assert apex_adamw_class("cpu", sharded=False) is None
    assert apex_adamw_class("mixed", sharded=False) is None
    assert apex_adamw_class("cuda", sharded=True) is None  # DTensor parameters or ZeRO-1


@pytest.mark.parametrize("installed", [False, True])
def test_on_cpu_build_optimizer_keeps_torchs_fused_adamw(request, installed):
    request.getfixturevalue("fake_apex" if installed else "no_apex")
    optimizer = build_optimizer(tiny_model(), CFG)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults["fused"] is True


# ------------------------------------------------------------------------------------------ the optimizer
@pytest.fixture
def apex_everywhere(fake_apex, monkeypatch):
    """build_optimizer as on a GPU with Apex: the CPU parameters here are treated as CUDA ones."""
    monkeypatch.setattr(builders, "apex_adamw_class", lambda device_type, sharded: apex_adamw_class("cuda", sharded))


def test_build_optimizer_hands_fused_adam_the_same_groups_and_hyperparameters(apex_everywhere):
    model = tiny_model()
    optimizer = build_optimizer(model, CFG)
    assert isinstance(optimizer, StandInFusedAdam) and optimizer.adam_w_mode
    reference = torch.optim.AdamW(optim.param_groups(tiny_model(), CFG.weight_decay), lr=CFG.lr)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [g["weight_decay"] for g in reference.param_groups]
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(g["params"]) for g in reference.param_groups]
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 and g["lr"] == 1e-2 for g in optimizer.param_groups)
    assert type(build_optimizer(tiny_model(), OptimizerConfig(optimizer="sgd"))) is torch.optim.SGD
    assert type(build_optimizer(tiny_model(), CFG, allow_apex=False)) is torch.optim.AdamW


def test_an_apex_without_cuda_extensions_falls_back_to_torch(fake_apex, monkeypatch):
    def without_kernels(*args, **kwargs):
        raise RuntimeError("apex.optimizers.FusedAdam requires cuda extensions")

    monkeypatch.setattr(builders, "apex_adamw_class", lambda device_type, sharded: without_kernels)
    assert type(build_optimizer(tiny_model(), CFG)) is torch.optim.AdamW


def test_fused_adam_trains_like_torch_adamw_through_the_wrapper(apex_everywhere):
    model = tiny_model()
    torch_run = RapidliteOptimizer(build_optimizer(model, CFG, allow_apex=False), clip_grad=0.5)
    train(model, torch_run, 5)

    apex_model = tiny_model()
    apex_run = RapidliteOptimizer(build_optimizer(apex_model, CFG), clip_grad=0.5)
    assert isinstance(apex_run.optimizer, StandInFusedAdam)
    train(apex_model, apex_run, 5)  # zero_grad(set_to_none=True), clipping and the step through the wrapper
    for a, b in zip(model.parameters(), apex_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert all(p.grad is not None for p in apex_model.parameters())
    apex_run.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in apex_model.parameters())


def test_fused_adam_resumes_from_a_checkpoint_exactly(apex_everywhere, tmp_path):
    """Checkpoints keep tensors only: FusedAdam's step count (a per-group int) must come back, or the bias
    correction would restart at step 1 after a resume."""
    whole = tiny_model()
    whole_opt = RapidliteOptimizer(build_optimizer(whole, CFG))
    train(whole, whole_opt, 3, seed=1)
    train(whole, whole_opt, 4, seed=2)

    first = tiny_model()
    first_opt = RapidliteOptimizer(build_optimizer(first, CFG))
    train(first, first_opt, 3, seed=1)
    assert all(float(s["step"]) == 3 for s in first_opt.optimizer.state.values())
    ckpt.save_checkpoint(tmp_path, 3, first, first_opt.optimizer, {"trainer": {}})

    resumed = tiny_model(seed=7)
    resumed_opt = RapidliteOptimizer(build_optimizer(resumed, CFG))
    ckpt.load_checkpoint(tmp_path, resumed, resumed_opt.optimizer)
    assert all(g["step"] == 3 for g in resumed_opt.optimizer.param_groups)
    train(resumed, resumed_opt, 4, seed=2)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_checkpoints_move_between_fused_adam_and_torch_adamw(apex_everywhere, tmp_path):
    apex_model = tiny_model()
    apex_opt = RapidliteOptimizer(build_optimizer(apex_model, CFG))
    train(apex_model, apex_opt, 3)
    torch_opt = torch.optim.AdamW(optim.param_groups(apex_model, CFG.weight_decay), lr=CFG.lr)
    torch_opt.load_state_dict(apex_opt.optimizer.state_dict())
    assert all(float(s["step"]) == 3 for s in torch_opt.state.values())

    train(apex_model, RapidliteOptimizer(torch_opt), 2)
    back = build_optimizer(apex_model, CFG)
    back.load_state_dict(torch_opt.state_dict())
    assert all(g["step"] == 5 for g in back.param_groups)


# ------------------------------------------------------------------------------------------ LayerNorm
def test_gpt_layer_norm_is_torchs_when_built_on_the_cpu(fake_apex):
    model = GPTModel(GPTConfig(vocab_size=50, num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8))
    norms = [m for m in model.modules() if hasattr(m, "normalized_shape")]
    assert norms and all(type(m) is nn.LayerNorm for m in norms)


def test_gpt_layer_norm_is_apexs_when_built_on_cuda(fake_apex, monkeypatch):
    # Stands in for ``with torch.device("cuda"):``, which this machine cannot enter.
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("cuda"))
    config = GPTConfig(vocab_size=50, num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8)
    model = GPTModel(config)
    norms = [m for m in model.modules() if hasattr(m, "normalized_shape")]
    assert len(norms) == 3 and all(type(m) is StandInFusedLayerNorm for m in norms)
    assert all(torch.equal(m.weight, torch.ones(32)) for m in norms)
    model(torch.randint(0, 50, (1, 8)))
    # Apex's norm has no bias-free form; RMSNorm is torch's.
    for variant in ({"bias": False}, {"normalization": "RMSNorm"}):
        other = GPTModel(GPTConfig(**{**config.to_dict(), **variant}))
        assert not any(isinstance(m, StandInFusedLayerNorm) for m in other.modules())


def test_sequence_parallel_refuses_apexs_layer_norm_in_one_line(fake_apex, monkeypatch):
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("cuda"))
    model = GPTModel(GPTConfig(vocab_size=50, num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8))
    with pytest.raises(ConfigError, match="--sequence-parallel: .*build the model on the CPU"):
        gpt_plan(model, types.SimpleNamespace(size=lambda: 1), sequence_parallel=True)
