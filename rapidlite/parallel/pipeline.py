"""Pipeline parallelism (``--pipeline-model-parallel-size``) on ``torch.distributed.pipelining``.

The transformer blocks are split into stages (evenly, or by ``--pipeline-split``): the embedding goes
with the first stage, the final norm and output layer with the last. Each rank keeps the model object it
was given, pruned in place to its own stages, so parameter names (and checkpoints) stay those of the
whole model: ``layers`` becomes a ``ModuleDict`` keyed by the global block index (``layers.5.…`` is the
same name either way). The stages themselves are thin modules over the same blocks, run by the schedule
(``--pipeline-schedule gpipe | 1f1b | interleaved-1f1b``; the interleaved one with
``--num-layers-per-virtual-pipeline-stage``, rank r holding stages r, r + pp, r + 2pp, ...).

The forward step a user wrote for one process runs unchanged. For each micro-batch of a global batch
the engine first runs the step with a stand-in model that records the call (``model(tokens,
position_ids=..., labels=...)``) and stops it there; the schedule then runs the stages on the recorded
inputs, and on the last stage the step runs again with the stand-in returning what the whole model would
have returned (logits, or the loss when labels were passed), so the user's own loss code computes the
loss the schedule back-propagates. Where the step takes its loss through the chunked output layer (the
built-in GPT called with labels; ``rapidlite.models.head``'s log-probabilities, whose output-layer forward is
recorded with the call), the last stage computes that in place of the logits, so they never exist there.
The micro-batches of a global batch are the pipeline's micro-batches, as in Megatron
(``--num-micro-batches`` is the accumulation), and the loss reported is the last stage's, shared with the
pipeline's other ranks.

How a model comes apart into stages is its family's pipeline split (``ModelSpec.pipeline``, declared in
``rapidlite/models/families/`` with the building blocks of ``rapidlite.models.staging``); a family without
one is refused with one line.

A mixture of experts' router loss (the built-in MoE GPT's, ``models.moe``) is each layer's, so each stage sums its
routers' and passes the running sum on with its activations (two numbers: load-balancing and z-loss). The last
stage adds it to the micro-batch's loss, weighted as that loss is (by its item count for a summed loss), so
the schedule's backward brings each router its gradient, as on one process. Its metrics are summed over the
stages once per step.

A tied input/output embedding (the built-in GPT's default, GPT-2) lives on the first and the last stage,
as in Megatron: both copies start equal, their gradients are summed over the two stages before each
step, and the gradient norm counts the weight once, so they stay equal and train as one weight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from rapidlite.errors import ConfigError
from rapidlite.models.head import logps_override
from rapidlite.models.losses import loss_parallel_context, unpack_loss
from rapidlite.models.spec import families_with, spec_of
from rapidlite.models.staging import Call, PipelineSplit


# ------------------------------------------------------------------------------------------ layout
def stage_layer_ids(num_layers: int, num_stages: int, split: Sequence[int] | None = None) -> list[list[int]]:
    """The block indices of each stage: ``split`` (layers per stage) or as even as possible, earlier stages
    taking one more when the layers do not divide."""
    if split is not None:
        if len(split) != num_stages:
            raise ConfigError(
                f"--pipeline-split gives {len(split)} stages but the pipeline has {num_stages} "
                "(pipeline size x virtual stages per rank): give one layer count per stage"
            )
        if sum(split) != num_layers or min(split) < 1:
            raise ConfigError(
                f"--pipeline-split {','.join(map(str, split))} must give every stage at least one layer and add up "
                f"to the model's {num_layers} layers"
            )
        counts = list(split)
    else:
        if num_layers < num_stages:
            raise ConfigError(
                f"the model has {num_layers} layers, fewer than its {num_stages} pipeline stages: lower "
                "--pipeline-model-parallel-size (or the virtual stages) or add layers"
            )
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    ids, start = [], 0
    for count in counts:
        ids.append(list(range(start, start + count)))
        start += count
    return ids


def local_stage_indices(pp_rank: int, pp_size: int, virtual: int) -> list[int]:
    """Looped placement: rank r runs stages r, r + pp, r + 2 pp, ..."""
    return [pp_rank + v * pp_size for v in range(virtual)]


def family_of(model: nn.Module) -> PipelineSplit:
    """The pipeline split the model's family declares (``ModelSpec.pipeline``); refused in one line when the
    family has none or its split cannot take this model."""
    spec, name = spec_of(model), type(model).__name__
    split = spec.pipeline
    if split is None:
        raise ConfigError(
            f"--pipeline-model-parallel-size: there is no pipeline split for {name} (the {spec.family} model "
            f"family); the families with one: {', '.join(families_with('pipeline'))}"
        )
    reason = split.unsupported(model)
    if reason is not None:
        raise ConfigError(
            f"--pipeline-model-parallel-size: the {spec.family} family's pipeline split cannot take {name}: {reason}"
        )
    return split


# ------------------------------------------------------------------------------------------ stages
class StageModule(nn.Module):
    """One pipeline stage: the blocks of the stage (``layers``, keyed by global index) and, on the first
    and last stage, the embedding and the head. Its submodules are the rank's model's own."""

    def __init__(
        self, runner: PipelineRunner, parts: dict[str, nn.Module], layers: nn.ModuleDict, first: bool, last: bool
    ) -> None:
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)
        self.layers = layers
        self.first, self.last = first, last
        self.config = runner.model.config
        self._runner = [runner]  # a list: not registered as a submodule

    def forward(self, *activations: torch.Tensor, microbatch: torch.Tensor) -> Any:
        runner = self._runner[0]
        call = runner.calls[int(microbatch)]
        # A mixture of experts' router loss in training: each stage adds its routers' to what it received, and the
        # last stage's loss takes the sum (``PipelineRunner._loss``).
        carry = runner.router_loss is not None and torch.is_grad_enabled()
        x = call.inputs if self.first else activations[0]
        if self.last and call.output_forward is not None:  # the chunked output layer's log-probabilities
            head, forward = call.output_forward
            head.forward = forward
            try:
                out = runner.family.run(self, x, call)
            finally:
                del head.forward
        else:
            out = runner.family.run(self, x, call)
        if self.last and hasattr(out, "to_local"):  # vocabulary-sharded logits cross stages as local shards
            runner.sharded_logits = True
            out = out.to_local()
        if carry:  # the running sum goes last, after the stage's own output (a tuple's elements)
            received = activations[-1] if not self.first else torch.zeros(2, device=runner.device)
            own = runner.router_loss.stage_losses((id(self), int(microbatch)))
            runner.single_output = not isinstance(out, tuple)
            return (*((out,) if runner.single_output else out), received if own is None else received + own)
        return out


class _CallRecorded(Exception):
    """Stops a forward step once it has called the model (the schedule runs the model itself)."""


class PipelineRunner:
    """This rank's stages, the schedule, and the record/replay of the user's forward step."""

    def __init__(
        self,
        model: nn.Module,
        pp_group: Any,
        pp_rank: int,
        pp_size: int,
        device: torch.device,
        schedule: str,
        layers_per_virtual_stage: int | None = None,
        split: Sequence[int] | None = None,
        tp_mesh: Any = None,
    ) -> None:
        self.model, self.family = model, family_of(model)
        self.pp_group, self.pp_rank, self.pp_size = pp_group, pp_rank, pp_size
        self.device, self.schedule_name, self.tp_mesh = device, schedule, tp_mesh
        num_layers = len(self.family.blocks(model))
        virtual = 1
        if layers_per_virtual_stage:
            if num_layers % (layers_per_virtual_stage * pp_size):
                raise ConfigError(
                    f"the model's {num_layers} layers are not divisible by --num-layers-per-virtual-pipeline-stage "
                    f"{layers_per_virtual_stage} x --pipeline-model-parallel-size {pp_size}"
                )
            virtual = num_layers // (layers_per_virtual_stage * pp_size)
        self.num_stages = pp_size * virtual
        self.stage_ids = local_stage_indices(pp_rank, pp_size, virtual)
        layer_ids = stage_layer_ids(num_layers, self.num_stages, split)
        self.layer_ids = [layer_ids[s] for s in self.stage_ids]
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids
        self.tied = self.family.tied(model)
        self.family.prune(model, [i for ids in self.layer_ids for i in ids], self.has_first, self.has_last)
        self.calls: list[Call] = []
        self.results: dict[int, tuple[torch.Tensor, int | None]] = {}
        self._phase: str | None = None
        self._recorded: Call | None = None
        self._replays: list[Callable[[], Any]] = []
        self._replay_output: Any = None
        self._replay_call: Call | None = None
        self._schedules: dict[tuple[int, bool], Any] = {}
        self.loss_scale = 1.0
        self.sharded_logits = False
        self.router_loss: Any = None  # a mixture of experts' (``models.moe.RouterLoss``)
        self.single_output = True  # the last stage's output is one tensor (else a tuple), when it carries
        self.stages: list[StageModule] = []
        model.forward = self._dispatch  # the forward step's call is recorded, then replayed by the schedule

    # ---------------------------------------------------------------- building
    def build_stages(self) -> list[StageModule]:
        """The stage modules over the (already tensor-parallel, checkpointed) model's blocks."""
        layers = self.family.blocks(self.model)
        by_index = dict(zip((i for ids in self.layer_ids for i in ids), layers, strict=True))
        for stage_id, ids in zip(self.stage_ids, self.layer_ids, strict=True):
            first, last = stage_id == 0, stage_id == self.num_stages - 1
            parts = self.family.stage_parts(self.model, first, last)
            stage_layers = nn.ModuleDict({str(i): by_index[i] for i in ids})
            self.stages.append(StageModule(self, parts, stage_layers, first, last))
        return self.stages

    def _schedule(self, n_microbatches: int, train: bool) -> Any:
        key = (n_microbatches, train)
        if key not in self._schedules:
            from torch.distributed.pipelining import (
                PipelineStage,
                Schedule1F1B,
                ScheduleGPipe,
                ScheduleInterleaved1F1B,
            )

            pipeline_stages = [
                PipelineStage(stage, stage_id, self.num_stages, self.device, group=self.pp_group)
                for stage, stage_id in zip(self.stages, self.stage_ids, strict=True)
            ]
            # Gradients are summed over micro-batches; the optimizer step divides them (see train_step).
            kwargs = {"n_microbatches": n_microbatches, "loss_fn": self._loss, "scale_grads": False}
            if self.schedule_name == "interleaved-1f1b":
                schedule = ScheduleInterleaved1F1B(pipeline_stages, **kwargs)
            elif self.schedule_name == "1f1b" and train:
                schedule = Schedule1F1B(pipeline_stages[0], **kwargs)
            else:  # forward-only passes (evaluation) run fill-drain
                schedule = ScheduleGPipe(pipeline_stages[0], **kwargs)
            self._schedules[key] = schedule
        return self._schedules[key]

    # ---------------------------------------------------------------- the model as the forward step sees it
    def _dispatch(self, *args: Any, **kwargs: Any) -> Any:
        if self._phase == "record":
            self._recorded = self.family.bind(self.model, args, kwargs)
            self._recorded.output_forward = logps_override(self.model) if self.has_last else None
            raise _CallRecorded
        if self._phase == "replay":
            call = self.family.bind(self.model, args, kwargs)
            recorded, replaying = self._replay_call.output_forward, logps_override(self.model)
            if recorded is not None and replaying is not None and replaying[1].stats is not None:
                replaying[1].stats.extend(recorded[1].stats)  # what the stage's run of the head appended
            return self.family.finish(self.model, self._replay_output, call)
        raise ConfigError(
            "under pipeline parallelism the model runs inside the trainer's steps (run_forward_step); "
            "it cannot be called directly"
        )

    def _record(self, step: Callable[[], Any]) -> Call:
        self._phase, self._recorded = "record", None
        try:
            step()
        except _CallRecorded:
            pass
        finally:
            self._phase = None
        if self._recorded is None:
            raise ConfigError("under pipeline parallelism run_forward_step must call the model it is given")
        return self._recorded

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        index = int(target)
        carried = None
        if self.router_loss is not None and torch.is_grad_enabled():  # the router losses of every stage, last
            *parts, carried = output
            output = parts[0] if self.single_output else tuple(parts)
        if self.sharded_logits:  # the last stage's logits went out as local vocabulary shards
            from torch.distributed.tensor import DTensor, Shard

            output = DTensor.from_local(output, self.tp_mesh, [Shard(-1)], run_check=False)
        self._phase, self._replay_output, self._replay_call = "replay", output, self.calls[index]
        try:
            result = self._replays[index]()
        finally:
            self._phase, self._replay_output, self._replay_call = None, None, None
        loss, items = unpack_loss(result)
        self.results[index] = (loss.detach().float(), items)
        if carried is not None:  # weighted as the micro-batch's loss, now that its item count is known
            loss = loss + self.router_loss.carried_penalty(carried, items, index)
        return loss * self.loss_scale if torch.is_grad_enabled() else loss

    # ---------------------------------------------------------------- running
    def run(
        self, steps: Sequence[tuple[Callable[[], Any], Callable[[], Any]]], train: bool, loss_scale: float = 1.0
    ) -> list[tuple[torch.Tensor, int | None]]:
        """Run the micro-batches ``steps`` (each a (record, replay) pair of the user's forward step) through the
        pipeline: forward and backward when ``train``, forward only otherwise. Returns the last stage's
        ``(loss, items)`` per micro-batch (empty on other ranks)."""
        self.calls = [self._record(record) for record, _ in steps]
        self._replays = [replay for _, replay in steps]
        self.results, self.loss_scale = {}, loss_scale
        n = len(steps)
        index = torch.arange(n, device=self.device)
        schedule = self._schedule(n, train)
        context = loss_parallel_context() if self.tp_mesh is not None else contextlib.nullcontext()
        with context:
            if train:
                schedule.step(microbatch=index, target=index, return_outputs=False)
            else:
                with torch.no_grad():
                    schedule.eval(microbatch=index, target=index, return_outputs=False)
        self.calls, self._replays = [], []
        if self.router_loss is not None and train:
            self.router_loss.commit()
        return [self.results[i] for i in range(n)] if self.has_last else []

    # ---------------------------------------------------------------- export
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on rank 0 (on CPU), gathered from every stage; empty elsewhere. A
        collective: every rank calls it."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Whole within each stage (tensor-parallel and FSDP shards gathered), then moved to the host.
        local = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        local = {k: v.detach().cpu() for k, v in local.items()}
        rank = dist.get_rank()
        if 0 not in dist.get_process_group_ranks(self.pp_group):  # another pipeline's copy: rank 0 has one
            return {}
        gathered: list[Any] | None = [None] * self.pp_size if rank == 0 else None
        dist.gather_object(local, gathered, dst=0, group=self.pp_group)
        if rank != 0:
            return {}
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            for key, value in part.items():
                full.setdefault(key, value)
        return full

    # ---------------------------------------------------------------- gradients
    def tied_weight(self) -> nn.Parameter | None:
        """The tied word embedding on this rank, if it is on the first or the last stage."""
        if not self.tied:
            return None
        stage = self.stages[0] if self.has_first else self.stages[-1]
        module = self.family.word_embedding(stage)
        return module.weight if module is not None and (self.has_first or self.has_last) else None


def embedding_groups(mesh: Any, pp: int) -> Any:
    """The process group joining this rank's first and last pipeline stage (same data/tensor coordinates), for
    summing a tied embedding's gradient; every rank must call this (group creation is collective)."""
    import torch.distributed as dist

    ranks = mesh.mesh  # [pp, ...] tensor of global ranks
    flat = ranks.reshape(pp, -1)
    mine = None
    for column in range(flat.shape[1]):
        pair = [int(flat[0, column]), int(flat[pp - 1, column])]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine
