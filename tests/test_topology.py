"""One Topology and one Batching, derived once: every spelling of a layout maps onto the same frozen objects, the
mesh is named after them, and nothing below ``resolve`` reads the ZeRO flags or derives a stage again."""

from __future__ import annotations

import ast
import json

import pytest

from helpers import REPO
from rapidlite.config.runtime import ParallelConfig
from rapidlite.config.topology import MESH_DIMS, Batching, Topology
from rapidlite.errors import ConfigError
from rapidlite.resolve import parse_args
from rapidlite.resolve.topology import ZERO_STAGE_FLAGS

BASE = ["--task", "sequence_classification", "--demo"]
# The raw spellings of a ZeRO stage: read only where the command line is turned into settings.
RAW_LAYOUT_FLAGS = set(ZERO_STAGE_FLAGS)
ALLOWED = ("rapidlite/cli/", "rapidlite/resolve/", "rapidlite/config/runtime.py")  # the last declares the flags


def test_the_table_names_every_spelling_of_a_stage():
    assert RAW_LAYOUT_FLAGS == {
        "zero_1_memory_optimization",
        "zero_2_memory_optimization",
        "zero_3_memory_optimization",
        "fsdp_memory_optimization",
        "use_distributed_optimizer",
    }


def below_resolve():
    """(module path, AST node) for every node of the modules below resolve (outside ``ALLOWED``)."""
    for path in sorted((REPO / "rapidlite").rglob("*.py")):
        name = str(path.relative_to(REPO))
        if not name.startswith(ALLOWED):
            for node in ast.walk(ast.parse(path.read_text(), name)):
                yield name, node


def test_nothing_below_resolve_reads_the_zero_flags():
    reads = []
    for name, node in below_resolve():
        attr = node.attr if isinstance(node, ast.Attribute) else None
        text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
        if attr in RAW_LAYOUT_FLAGS or text in RAW_LAYOUT_FLAGS:
            reads.append(f"{name}:{node.lineno} {attr or text}")
    assert not reads, "read the resolved Topology (settings.topology) instead: " + ", ".join(reads)


# The derived values whose home is Topology/Batching, by the section that also keeps them for get_args()'s flat view.
DERIVED = {
    "training": {"micro_batch_size", "global_batch_size", "gradient_accumulation_steps"},
    "parallel": {
        "data_parallel_size",
        "world_size",
        "deepspeed",
        "cpu_offload",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
    },
}


def test_below_resolve_the_batch_and_the_split_are_read_from_batching_and_topology():
    reads = []
    for name, node in below_resolve():
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if node.attr in DERIVED.get(node.value.attr, ()):
                reads.append(f"{name}:{node.lineno} .{node.value.attr}.{node.attr}")
    assert not reads, "read settings.batching / settings.topology instead: " + ", ".join(reads)


def _layout(*flags: str, world: int = 2):
    settings = parse_args([*BASE, "--nproc-per-node", str(world), *flags]).sections
    return settings.topology, settings.batching


def write(tmp_path, config) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("spellings", "stage"),
    [
        ([[], ["--global-batch-size", "16"]], 0),
        ([["--zero-1-memory-optimization"], ["--use-distributed-optimizer"]], 1),
        ([["--zero-2-memory-optimization"], ["--use-distributed-optimizer", "--zero-2-memory-optimization"]], 2),
        ([["--zero-3-memory-optimization"], ["--fsdp-memory-optimization"]], 3),
    ],
)
def test_each_spelling_of_a_stage_is_one_topology(spellings, stage):
    topologies = {_layout(*flags)[0] for flags in spellings}
    assert topologies == {Topology(world_size=2, dp=2, zero_stage=stage)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_deepspeed_files_stage_and_offload_are_the_flags(tmp_path, stage):
    offload = stage >= 2  # offload keeps sharded state in host memory: ZeRO-2/3
    zero = {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    from_file = _layout("--deepspeed-config", write(tmp_path, {"zero_optimization": zero}))
    flags = ["--deepspeed", f"--zero-{stage}-memory-optimization", *(["--cpu-offload"] if offload else [])]
    assert from_file == _layout(*flags)
    assert from_file[0] == Topology(world_size=2, dp=2, zero_stage=stage, cpu_offload=offload, backend="deepspeed")


@pytest.mark.parametrize(
    "config",
    [
        {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 16},
        {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
    ],
)
def test_a_deepspeed_files_batch_sizes_are_the_flags(tmp_path, config):
    from_file = _layout("--deepspeed-config", write(tmp_path, config))[1]
    from_flags = _layout("--deepspeed", "--micro-batch-size", "4", "--global-batch-size", "16")[1]
    assert from_file == from_flags
    assert from_file == Batching(
        micro_batch_size=4, gradient_accumulation_steps=2, global_batch_size=16, seq_length=128
    )


def test_batching_is_the_batch_arithmetic_and_the_flat_view_agrees():
    args = parse_args([*BASE, "--nproc-per-node", "2", "--micro-batch-size", "2", "--global-batch-size", "12"])
    topology, batching = args.sections.topology, args.sections.batching
    assert batching == Batching(micro_batch_size=2, gradient_accumulation_steps=3, global_batch_size=12, seq_length=128)
    assert batching.tokens_per_rank == 2 * 3 * 128 and batching.samples_per_rank == 6
    # get_args()'s flat view, for user scripts, holds the same numbers.
    assert (args.world_size, args.data_parallel_size) == (topology.world_size, topology.dp) == (2, 2)
    assert (args.gradient_accumulation_steps, args.global_batch_size) == (3, 12)


def test_megatrons_distributed_optimizer_is_zero1_with_expert_parallelism_too():
    """ZeRO-1 steps the experts with an optimizer of their own (``Zero1WithExperts``): Megatron's flag is ZeRO-1
    with or without experts, as the explicit flag is."""
    moe = ["--num-experts", "4", "--expert-model-parallel-size", "2"]
    args = parse_args([*BASE, "--nproc-per-node", "2", *moe, "--use-distributed-optimizer"])
    assert args.sections.topology == Topology(world_size=2, dp=2, ep=2, zero_stage=1)
    assert not any(n.startswith("--use-distributed-optimizer") for n in args.notices)
    assert _layout("--use-distributed-optimizer")[0].zero_stage == 1
    assert _layout(*moe, "--zero-1-memory-optimization")[0] == Topology(world_size=2, dp=2, ep=2, zero_stage=1)


def test_conflicting_spellings_keep_their_one_line_refusals():
    with pytest.raises(ConfigError, match="--use-distributed-optimizer is ZeRO-1 here"):
        _layout("--use-distributed-optimizer", "--tensor-model-parallel-size", "2")
    with pytest.raises(ConfigError, match="not divisible by tensor x pipeline parallel size 2 x 1"):
        _layout("--tensor-model-parallel-size", "2", world=3)


def test_the_mesh_has_named_dimensions_in_torchtitans_order():
    assert MESH_DIMS == ("pp", "dp", "cp", "tp")
    topology = Topology.split(8, tp=2, pp=2)
    assert topology.mesh_shape == (("pp", 2), ("dp", 2), ("tp", 2))
    assert Topology.split(4).mesh_shape == (("dp", 4),)
    assert Topology(world_size=4, dp=2, cp=2).mesh_shape == (("dp", 2), ("cp", 2))
    # Tensor-parallel ranks are neighbours: rank = (pp_index * dp + dp_index) * tp + tp_index.
    for rank in range(8):
        where = topology.coordinates(rank)
        assert rank == (where["pp"] * 2 + where["dp"]) * 2 + where["tp"] and where["cp"] == 0


def test_a_topology_that_does_not_split_its_world_is_refused():
    with pytest.raises(ConfigError, match="is not pipeline x data x context x tensor parallel size 1 x 3 x 1 x 1"):
        Topology(world_size=4, dp=3)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 3 does not divide"):
        Topology(world_size=4, dp=4, ep=3)
    with pytest.raises(ConfigError, match="ZeRO stage 4"):
        Topology(zero_stage=4)


def test_the_process_group_is_the_topologys_world():
    from rapidlite.runtime.distributed import init_distributed

    one = init_distributed(Topology(), ParallelConfig())
    assert one.topology == Topology() and not one.initialized and one.dp_size == 1
    with pytest.raises(ConfigError, match="resolved for 2"):
        init_distributed(Topology.split(2), ParallelConfig())
