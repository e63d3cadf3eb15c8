"""Pipeline parallelism (each schedule, with data, ZeRO and tensor parallelism) of the built-in GPT and of
Hugging Face LLaMA and GPT-2 through ``rapidlite --task pretraining``, compared with one process; checkpoints
resharded across layouts; the white-box example unchanged under a pipeline."""

import shutil

import pytest
import torch

from helpers import (
    assert_close_lists,
    bert_run_args,
    layout_runs,
    rapidlite,
    rapidlite_captured,
    read_metrics,
    train_losses,
    write_tiny_corpus,
)
from rapidlite.checkpoint.dcp import read_model_tensors

pytestmark = pytest.mark.distributed

MODEL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "96", "--num-layers", "4", "--hidden-size", "32"]
MODEL += ["--num-attention-heads", "4", "--seq-length", "32", "--hidden-dropout", "0", "--attention-dropout", "0"]
COMMON = ["--task", "pretraining", *MODEL, "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "1"]
COMMON += ["--lr-decay-iters", "6", "--eval-interval", "6", "--eval-iters", "1", "--micro-batch-size", "2"]
PP2 = ["--nproc-per-node", "2", "--pipeline-model-parallel-size", "2"]
PP2_DP2 = ["--nproc-per-node", "4", "--pipeline-model-parallel-size", "2"]
LAYOUTS = {
    "single": [],
    "pp2_1f1b": PP2,
    "pp2_gpipe": [*PP2, "--pipeline-schedule", "gpipe"],
    "pp2_interleaved": [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"],
    "pp2_split_1_3": [*PP2, "--pipeline-split", "1,3"],
    "pp2_dp2": PP2_DP2,
    "pp2_dp2_zero1": [*PP2_DP2, "--zero-1-memory-optimization"],
    "pp2_dp2_zero2": [*PP2_DP2, "--zero-2-memory-optimization"],
    "tp2_pp2": [*PP2_DP2, "--tensor-model-parallel-size", "2"],
    "tp2_sp_pp2_zero3": [*PP2_DP2, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                         "--zero-3-memory-optimization", "--nproc-per-node", "4"],
    "dp2": ["--nproc-per-node", "2"],
    "dp2_tp2_pp2_zero2": ["--nproc-per-node", "8", "--pipeline-model-parallel-size", "2",
                          "--tensor-model-parallel-size", "2", "--zero-2-memory-optimization"],
}  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("pp_data") / "tiny_text_document"
    write_tiny_corpus(prefix)
    return ["--data-path", str(prefix)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    return layout_runs(tmp_path_factory.mktemp("pp_runs"), [*COMMON, *data], LAYOUTS)


def state(save):
    (record,) = [r for r in read_metrics(save) if r.get("split") == "model_state"]
    return record


def validation_loss(save):
    return [r["loss"] for r in read_metrics(save) if r.get("split") == "validation"]


def launch(*argv):
    """A multi-process layout through the launcher; a one-process run in this process (its launch is not what
    these tests are about)."""
    return (rapidlite if "--nproc-per-node" in argv else rapidlite_captured)(*argv)


def assert_trains_like(run, reference, iterations=6):
    assert len(train_losses(run)) == iterations
    assert_close_lists(train_losses(run), train_losses(reference), rtol=1e-5)
    assert_close_lists(train_losses(run, "grad_norm"), train_losses(reference, "grad_norm"), rtol=1e-5)
    assert_close_lists(validation_loss(run), validation_loss(reference), rtol=1e-5)  # evaluated through the pipeline


def assert_same_weights(run, reference, iteration="iter_0000006"):
    expected = read_model_tensors(reference / iteration)
    actual = read_model_tensors(run / iteration)  # every stage's part, read back whole
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert (actual[k] - v).abs().max().item() < 1e-4, k


@pytest.mark.parametrize("layout", ["pp2_1f1b", "pp2_gpipe", "pp2_interleaved", "pp2_split_1_3"])
def test_pipeline_schedules_train_like_one_process(runs, layout):
    """The built-in GPT's embedding is tied to its output layer: the two stages' copies stay one weight."""
    assert_trains_like(runs(layout), runs("single"))
    assert_same_weights(runs(layout), runs("single"))


@pytest.mark.parametrize(
    "layout", ["pp2_dp2", "pp2_dp2_zero1", "pp2_dp2_zero2", "tp2_pp2", "tp2_sp_pp2_zero3", "dp2_tp2_pp2_zero2"]
)
def test_pipeline_combines_with_data_zero_and_tensor_parallelism(runs, layout):
    assert_trains_like(runs(layout), runs("single"))
    assert_same_weights(runs(layout), runs("single"))


def test_stages_hold_their_share_of_the_model(runs):
    single, pp2, tp2_pp2 = state(runs("single")), state(runs("pp2_1f1b")), state(runs("tp2_pp2"))
    assert "pipeline parallel 2 (1f1b)" in pp2["strategy"]
    # Rank 0 holds the embedding and 2 of the 4 blocks (54% here); tensor parallelism halves that again.
    assert pp2["param_bytes"] < 0.6 * single["param_bytes"]
    assert pp2["optimizer_bytes"] < 0.6 * single["optimizer_bytes"]
    assert tp2_pp2["param_bytes"] == pytest.approx(pp2["param_bytes"] / 2, rel=0.05)
    zero2 = state(runs("pp2_dp2_zero2"))
    assert zero2["optimizer_bytes"] == pytest.approx(pp2["optimizer_bytes"] / 2, rel=0.05)


def test_hugging_face_export_is_the_whole_model(runs):
    from rapidlite.models.gpt import GPTModel

    expected = GPTModel.from_pretrained(runs("single") / "hf").state_dict()
    actual = GPTModel.from_pretrained(runs("tp2_pp2") / "hf").state_dict()
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert (actual[k] - v).abs().max().item() < 1e-4, k


@pytest.mark.parametrize("first,then", [("tp2_pp2", "dp2"), ("pp2_1f1b", "single"), ("single", "pp2_interleaved")])
def test_checkpoints_reshard_across_pipeline_layouts(runs, data, tmp_path, first, then):
    """Iteration 3's checkpoint of one layout, resumed in another, continues the one-process loss curve."""
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(runs(first) / "iter_0000003", resumed / "iter_0000003")
    (resumed / "latest").write_text("3")
    argv = [*COMMON, *data, *LAYOUTS[then], "--train-iters", "6", "--load", str(resumed), "--save", str(resumed)]
    proc = launch(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_lists(train_losses(resumed), train_losses(runs("single"))[3:], rtol=1e-5)


def test_fp16_loss_scaling_in_a_pipeline_follows_one_process(data, tmp_path):
    """The last stage scales the loss it back-propagates; every stage unscales, and all agree on overflow."""
    argv = [*COMMON, *data, "--train-iters", "6", "--fp16", "--initial-loss-scale", "1024", "--checkpoint-activations"]
    saves = {}
    for name, extra in (("single", []), ("pipeline", PP2)):
        saves[name] = tmp_path / name
        proc = launch(*argv, *extra, "--save", str(saves[name]))
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_lists(train_losses(saves["pipeline"]), train_losses(saves["single"]), rtol=1e-3)
    assert_close_lists(train_losses(saves["pipeline"], "loss_scale"), train_losses(saves["single"], "loss_scale"), 0)


def test_mixed_precision_and_recompute_run_in_a_pipeline(data, tmp_path):
    argv = [*COMMON, *data, *LAYOUTS["pp2_interleaved"], "--train-iters", "3", "--bf16", "--checkpoint-activations"]
    argv += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
    proc = rapidlite(*argv, "--save", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(tmp_path)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


@pytest.fixture(scope="module")
def hf_configs(tmp_path_factory):
    from transformers import GPT2Config, LlamaConfig

    root = tmp_path_factory.mktemp("hf_configs")
    LlamaConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=98, max_position_embeddings=64, bos_token_id=96, eos_token_id=96, tie_word_embeddings=False,
    ).save_pretrained(root / "llama")  # fmt: skip
    GPT2Config(
        n_layer=4, n_embd=32, n_head=4, n_positions=64, vocab_size=98, bos_token_id=96, eos_token_id=96,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
    ).save_pretrained(root / "gpt2")  # fmt: skip
    return root


@pytest.fixture(scope="module")
def hf_single(tmp_path_factory, data, hf_configs):
    """Each family's one-process reference (5 iterations), trained once for the module in this process."""
    root, done = tmp_path_factory.mktemp("hf_single"), {}

    def get(family):
        if family not in done:
            model = ["--pretrained-model-name-or-path", str(hf_configs / family)]
            proc = rapidlite_captured(*COMMON, *data, *model, "--train-iters", "5", "--save", str(root / family))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[family] = root / family
        return done[family]

    return get


@pytest.mark.parametrize(
    "family,layout",
    [
        ("llama", [*PP2, "--pipeline-schedule", "gpipe"]),
        ("gpt2", PP2),
        ("llama", [*PP2_DP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        ("gpt2", [*PP2_DP2, "--tensor-model-parallel-size", "2"]),
        ("llama", [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]),
    ],
    ids=["llama_pp2_gpipe", "gpt2_pp2_tied", "llama_tp2_sp_pp2", "gpt2_tp2_pp2", "llama_interleaved"],
)  # fmt: skip
def test_hugging_face_models_train_like_one_process_in_a_pipeline(
    data, hf_configs, hf_single, tmp_path, family, layout
):
    """Each family's split, tied weights and tensor-parallel plan in a pipeline. Data parallelism across
    pipeline replicas (with a tied embedding) does not depend on the model: the built-in GPT's pp2_dp2 shows it."""
    from transformers import AutoModelForCausalLM

    model = ["--pretrained-model-name-or-path", str(hf_configs / family)]
    saves = {"single": hf_single(family), "pipeline": tmp_path / "pipeline"}
    proc = rapidlite(*COMMON, *data, *model, *layout, "--train-iters", "5", "--save", str(saves["pipeline"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trains_like(saves["pipeline"], saves["single"], iterations=5)
    # The export gathers every stage into one model that Hugging Face loads.
    expected = AutoModelForCausalLM.from_pretrained(saves["single"] / "hf").state_dict()
    actual = AutoModelForCausalLM.from_pretrained(saves["pipeline"] / "hf").state_dict()
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert (actual[k] - v).abs().max().item() < 1e-4, k


def test_white_box_forward_step_runs_unchanged_in_a_pipeline(tmp_path):
    """examples/pretrain_megatron_gpt.py (reset attention masks and positions: every stage needs them) under
    a pipeline of 2 gives the one-process losses."""
    import numpy as np

    from helpers import REPO
    from rapidlite.data.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "counting_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(200):
        start = int(rng.integers(0, 60))
        builder.add_item(np.append(np.arange(start, start + int(rng.integers(8, 30))) % 60, 60))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    argv = [
        "--user-script", str(REPO / "examples" / "pretrain_megatron_gpt.py"), "--data-path", str(prefix),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "60", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "4", "--lr", "3e-3", "--log-interval", "1", "--split", "90,10,0", "--eod-mask-loss",
        "--reset-position-ids", "--reset-attention-mask", "--hidden-dropout", "0", "--attention-dropout", "0",
    ]  # fmt: skip
    saves = {}
    for name, extra in (("single", []), ("pipeline", PP2)):
        saves[name] = tmp_path / name
        proc = launch(*argv, *extra, "--save", str(saves[name]))
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trains_like(saves["pipeline"], saves["single"], iterations=4)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--pipeline-split", "1,1"], "--pipeline-split 1,1 must give every stage at least one layer and add up"),
        (["--pipeline-split", "1,1,2"], "--pipeline-split gives 3 stages but the pipeline has 2"),
        (["FINETUNER"], "--pipeline-model-parallel-size runs PreTrainer jobs"),
    ],
)
def test_bad_pipeline_layouts_are_one_line(data, tmp_path, argv, message):
    if argv == ["FINETUNER"]:
        script = tmp_path / "finetune.py"
        script.write_text(
            "from rapidlite import Finetuner\n\n"
            "class Tune(Finetuner):\n"
            "    def train_valid_test_datasets_provider(self):\n"
            "        return [0], None, None\n\n"
            "Tune().train()\n"
        )
        argv = ["--user-script", str(script)]
    proc = rapidlite(*COMMON, *data, *PP2, *argv, "--train-iters", "2", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rapidlite: error:")]
    assert len(errors) == 1, proc.stderr


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """The BERT pretraining flags and their one-process reference run, trained once for the module in this process."""
    root = tmp_path_factory.mktemp("bert")
    argv = [*bert_run_args(root / "data", num_layers=4), "--micro-batch-size", "2"]
    proc = rapidlite_captured(*argv, "--save", str(root / "single"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return argv, root / "single"


@pytest.mark.parametrize("layout", [PP2, [*PP2_DP2, "--tensor-model-parallel-size", "2"]], ids=["pp2", "tp2_pp2"])
def test_bert_pretraining_trains_like_one_process_in_a_pipeline(bert, tmp_path, layout):
    """BertForPreTraining: the pooler, masked-LM decoder (tied to the first stage's embedding) and
    next-sentence head on the last stage; the model's own loss computed there by the replayed step."""

    argv, single = bert
    saves = {"single": single, "pipeline": tmp_path / "pipeline"}
    proc = rapidlite(*argv, *layout, "--save", str(saves["pipeline"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trains_like(saves["pipeline"], saves["single"], iterations=5)
    assert_same_weights(saves["pipeline"], saves["single"], "iter_0000005")
    from transformers import BertForPreTraining

    expected = BertForPreTraining.from_pretrained(saves["single"] / "hf").state_dict()
    actual = BertForPreTraining.from_pretrained(saves["pipeline"] / "hf").state_dict()  # every stage, gathered
    assert actual.keys() == expected.keys()
    for k, v in expected.items():
        assert (actual[k] - v).abs().max().item() < 1e-4, k
