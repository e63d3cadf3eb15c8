"""LoRA and QLoRA (``--lora-rank``, ``--load-in-4bit``/``--load-in-8bit``) on the demo's tiny LLaMA and the
classification demo's tiny BERT: what trains, what is checkpointed and exported, and equality with references
(one process, an unaccumulated batch, an uninterrupted run, the adapter-applied model)."""

import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, rapidlite, rapidlite_here, read_metrics, train_losses
from rapidlite import RapidliteEngine
from rapidlite.checkpoint.dcp import SafeFileSystemReader
from rapidlite.checkpoint.layout import checkpoint_path
from rapidlite.cli.main import main
from rapidlite.errors import ConfigError
from rapidlite.models import lora
from rapidlite.resolve import parse_args
from rapidlite.tasks.causal_lm import CausalLMFinetuner
from rapidlite.tasks.causal_lm_demo import write_demo_assets

peft = pytest.importorskip("peft")


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    return write_demo_assets(tmp_path_factory.mktemp("lora"), seed=7, num_train=96, num_validation=16)


def task_args(assets, *extra):
    model_dir, data_dir = assets
    return [
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(model_dir), "--data-path", str(data_dir),
        "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-2", "--seq-length", "64",
        "--log-interval", "1", "--lora-rank", "4", *extra,
    ]  # fmt: skip


def trainer(assets, *extra):
    return CausalLMFinetuner(RapidliteEngine(args=parse_args(task_args(assets, *extra))))


def adapter_params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def checkpoint_keys(save):
    return list(SafeFileSystemReader(checkpoint_path(save)).read_metadata().state_dict_metadata)


def base_model(assets, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets[0], dtype=torch.float32, **kwargs).eval()
    lora.keep_training_kernel(model)
    return model


def test_lora_trains_adapters_only_checkpoints_megabytes_and_exports_merged(assets, tmp_path, capfd):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    assert main(task_args(assets, "--train-iters", "6", "--lr", "3e-2", "--merge-lora", "--save", str(out))) == 0
    captured = capfd.readouterr()
    log = captured.out + captured.err
    # the log names what trains: rank 4 on the 7 LLaMA projections of each of the 4 layers
    base = base_model(assets)
    expected = sum(
        4 * (m.in_features + m.out_features)
        for n, m in base.named_modules()
        if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    total = sum(p.numel() for p in base.parameters()) + expected
    assert f"trainable params: {expected:,d} || all params: {total:,d}" in log
    assert all(torch.isfinite(torch.tensor(train_losses(out))))
    # gradients and optimizer state are the adapters' only (fp32; AdamW: two moments)
    state = next(r for r in read_metrics(out) if r.get("split") == "model_state")
    assert state["grad_bytes"] == 4 * expected
    assert 8 * expected <= state["optimizer_bytes"] <= 8 * expected + 4096
    # the checkpoint holds the adapters and their optimizer state, nothing of the frozen base
    keys = checkpoint_keys(out)
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:5]
    assert sum(f.stat().st_size for f in checkpoint_path(out).glob("*.distcp")) < 3 * 12 * expected
    # peft loads the adapter; the merged model's logits equal the adapter-applied model's
    adapted = peft.PeftModel.from_pretrained(base, out / "hf" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    ids = torch.randint(3, 60, (2, 10))
    with torch.no_grad():
        moved = (adapted(ids).logits - base_model(assets)(ids).logits).abs().max()
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)
    assert moved > 1e-2  # the adapters did change the model
    assert (out / "hf" / "tokenizer.json").is_file() and (out / "hf" / "adapter" / "tokenizer.json").is_file()


@pytest.fixture(scope="module")
def straight(assets, tmp_path_factory):
    """4 iterations without --merge-lora, checkpoints at 2 and 4: the trainer and its --save directory."""
    save = tmp_path_factory.mktemp("straight") / "a"
    t = trainer(assets, "--train-iters", "4", "--save", str(save), "--save-interval", "2")
    t.train()
    return t, save


def test_without_merge_the_export_is_the_adapter_alone(straight):
    out = straight[1]
    assert sorted(p.name for p in (out / "hf").iterdir()) == ["adapter"]
    saved = load_file(out / "hf" / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)


def test_adapter_resume_is_bit_exact(assets, straight, tmp_path):
    straight, save = straight
    # the run stopped at iteration 2: its checkpoint there, nothing later
    shutil.copytree(save, tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "iter_0000004")
    (tmp_path / "b" / "latest").write_text("2\n")
    resumed = trainer(assets, "--train-iters", "4", "--load", str(tmp_path / "b"), "--save", str(tmp_path / "b"))
    resumed.train()
    assert train_losses(tmp_path / "b")[-2:] == train_losses(save)[-2:]
    expected, actual = adapter_params(straight.model), adapter_params(resumed.model)
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


@pytest.fixture(scope="module")
def sgd_step(assets):
    """The adapters after one SGD step of learning rate 1 (each moved by exactly its gradient) from the same
    start, by flags; each run once for the module."""
    done = {}

    def get(*flags):
        if flags not in done:
            t = trainer(assets, "--train-iters", "1", "--optimizer", "sgd", "--lr", "1.0", "--hidden-dropout", "0",
                        *flags)  # fmt: skip
            t.train()
            done[flags] = adapter_params(t.model)
        return done[flags]

    return get


def test_accumulated_micro_batches_update_adapters_as_one_batch(sgd_step):
    big, small = sgd_step("--micro-batch-size", "8"), sgd_step("--micro-batch-size", "2")
    assert max(float(v.abs().max()) for k, v in big.items() if "lora_B" in k) > 1e-3  # B starts at zero: it moved
    for name, value in big.items():
        torch.testing.assert_close(small[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_activation_checkpointing_gives_the_same_adapter_gradients(sgd_step):
    plain = sgd_step("--micro-batch-size", "8")
    checkpointed = sgd_step("--micro-batch-size", "8", "--checkpoint-activations")
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("flag", ["--fp16", "--bf16"])
def test_half_precision_keeps_adapters_fp32_and_trains(assets, flag):
    t = trainer(assets, "--train-iters", "2", "--seq-length", "32", flag)
    t.train()
    trainable = [p for p in t.model.parameters() if p.requires_grad]
    frozen = [p for p in t.model.parameters() if not p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    # with adapters the frozen base is loaded in the compute dtype: half the memory
    assert {p.dtype for p in frozen} == {torch.float16 if flag == "--fp16" else torch.bfloat16}
    assert all(torch.isfinite(p).all() for p in trainable)
    if flag == "--fp16":
        assert t.optimizer.loss_scaler is not None


def test_qlora_4bit_trains_merges_and_holds_a_quarter_of_bf16(assets, tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    out = tmp_path / "q"
    t = trainer(assets, "--train-iters", "2", "--load-in-4bit", "--bnb-4bit-use-double-quant", "--merge-lora",
                "--save", str(out))  # fmt: skip
    t.train()
    assert all(torch.isfinite(torch.tensor(train_losses(out))))
    quantized = [m for m in t.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 28 and not isinstance(t.model.get_output_embeddings(), bnb.nn.Linear4bit)
    four_bit = sum(m.weight.numel() * m.weight.element_size() for m in quantized)
    bf16 = sum(m.in_features * m.out_features * 2 for m in quantized)
    assert 0.25 <= four_bit / bf16 <= 0.26  # two weights a byte; the scales are kept beside
    merged_dir = out / "hf"
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not hasattr(merged.config, "quantization_config")
    ids = torch.randint(3, 60, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, t.model.eval()(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_8bit_base_trains(assets, tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "q8"
    args = task_args(assets, "--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "2")
    assert main([*args, "--seq-length", "32", "--load-in-8bit", "--save", str(out)]) == 0
    assert all(torch.isfinite(torch.tensor(train_losses(out))))
    assert all("lora_" in k for k in checkpoint_keys(out))


class PlainModelFinetuner(CausalLMFinetuner):
    """A user's provider that builds the model itself (a plain transformers model, or a peft model)."""

    wrap = None

    def model_optimizer_lr_scheduler_provider(self):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.args.pretrained_model_name_or_path, dtype=torch.float32)
        return (self.wrap(model) if self.wrap else model), None, None


def test_a_user_model_gets_lora_and_4bit_from_the_flags(assets):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    flags = ("--train-iters", "2", "--load-in-4bit", "--lora-target-modules", "q_proj,v_proj")
    t = PlainModelFinetuner(RapidliteEngine(args=parse_args(task_args(assets, *flags))))
    t.train()
    assert lora.is_peft_model(t.model)
    adapted = {n.rsplit(".", 1)[-1] for n, m in t.model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "v_proj"}
    base = t.model.get_base_model()
    assert isinstance(base.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)  # quantised by the engine
    assert type(base.lm_head) is torch.nn.Linear  # the output head stays full precision


def test_a_peft_model_from_the_provider_is_trained_as_it_is(assets):
    class OwnPeft(PlainModelFinetuner):
        @staticmethod
        def wrap(model):
            return peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["o_proj"]))

    t = OwnPeft(RapidliteEngine(args=parse_args(task_args(assets, "--train-iters", "1"))))
    t.train()
    layers = [m for m in t.model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert layers and all(m.r["default"] == 2 for m in layers)
    assert {n.rsplit(".", 1)[0].rsplit(".", 1)[-1] for n, _ in t.model.named_modules() if n.endswith("lora_A")} == {
        "o_proj"
    }


@pytest.fixture(scope="module")
def classification_assets(tmp_path_factory):
    """The classification demo's tiny BERT and a small data set: (model_dir, data_dir)."""
    from rapidlite.tasks.demo import write_demo_assets as write_classification_assets

    return write_classification_assets(
        tmp_path_factory.mktemp("classification"), seed=3, num_train=96, num_validation=32, num_test=16
    )


def test_sequence_classification_trains_the_head_in_full_and_merges(classification_assets, tmp_path):
    from transformers import AutoModelForSequenceClassification

    model_dir, data_dir = classification_assets
    out = tmp_path / "run"
    argv = [
        "--task", "sequence_classification", "--pretrained-model-name-or-path", str(model_dir),
        "--data-path", str(data_dir), "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "5e-3",
        "--seq-length", "32", "--train-iters", "2", "--lora-rank", "4", "--merge-lora", "--save", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    adapter = load_file(out / "hf" / "adapter" / "adapter_model.safetensors")
    assert any("classifier" in k for k in adapter)  # the new head is trained in full and saved with the adapter
    merged = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    base = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=merged.config.num_labels).eval()
    adapted = peft.PeftModel.from_pretrained(base, out / "hf" / "adapter").eval()
    ids = torch.randint(5, 60, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)


def test_4bit_classification_keeps_the_head_full_precision_and_trains_it(classification_assets):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from rapidlite.tasks.sequence_classification import SequenceClassificationFinetuner

    model_dir, data_dir = classification_assets
    argv = [
        "--task", "sequence_classification", "--pretrained-model-name-or-path", str(model_dir),
        "--data-path", str(data_dir), "--micro-batch-size", "8", "--lr", "5e-3", "--seq-length", "32",
        "--train-iters", "2", "--lora-rank", "4", "--load-in-4bit",
    ]  # fmt: skip
    t = SequenceClassificationFinetuner(RapidliteEngine(args=parse_args(argv)))
    t.train()
    base = t.model.get_base_model()
    assert isinstance(base.bert.encoder.layer[0].attention.self.query.base_layer, bnb.nn.Linear4bit)
    head = base.classifier.modules_to_save["default"]
    assert type(head) is torch.nn.Linear and head.weight.requires_grad and head.weight.dtype == torch.float32


def test_a_run_without_adapters_never_imports_peft(tmp_path):
    """peft brings bitsandbytes and transformers' model classes (seconds at every start, on every rank): a run
    without --lora-rank trains, saves and exports without importing it."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        "from helpers import ToyFinetuner, engine\n"
        f"ToyFinetuner(engine('--micro-batch-size', '8', '--train-iters', '2', '--save', {str(tmp_path / 'run')!r}))"
        ".train()\n"
        "print('imported:', sorted({'peft', 'bitsandbytes'} & set(sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported: []" in proc.stdout, proc.stdout[-3000:]
    assert (tmp_path / "run" / "latest").read_text().strip() == "2"


# ------------------------------------------------------------------------------------------ bad input
def one_line_error(capsys, argv, up_front=True):
    """The error line of a refused command: the only line on stderr when refused before anything runs."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if up_front:
        assert err.count("\n") == 1, err
    return err.strip().splitlines()[-1]


def test_unknown_target_module_is_one_line_and_writes_nothing(assets, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = one_line_error(capsys, task_args(assets, "--lora-target-modules", "qkv", "--save", str(out)), up_front=False)
    assert "--lora-target-modules" in err and "q_proj" in err  # names the layers there are
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--load-in-4bit", "--zero-3-memory-optimization"], "--zero-3-memory-optimization"),
        (["--load-in-4bit", "--load-in-8bit"], "exclusive"),
        (["--tensor-model-parallel-size", "2", "--nproc-per-node", "2"], "--tensor-model-parallel-size"),
        (["--bnb-4bit-use-double-quant"], "--load-in-4bit"),
        (["--lora-dropout", "1.5"], "--lora-dropout"),
    ],
)
def test_impossible_combinations_are_refused_up_front(assets, capsys, flags, words):
    assert words in one_line_error(capsys, task_args(assets, *flags))


def test_lora_flags_without_a_rank_are_refused(assets, capsys):
    def without_rank(*flags):
        argv = task_args(assets, *flags)
        i = argv.index("--lora-rank")
        return argv[:i] + argv[i + 2 :]

    assert "--lora-rank" in one_line_error(capsys, without_rank("--load-in-4bit"))
    assert "--lora-rank" in one_line_error(capsys, without_rank("--lora-alpha", "16"))


def test_4bit_without_bitsandbytes_names_the_install(assets, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=re.escape("pip install 'rapidlite[quant]'")):
        parse_args(task_args(assets, "--load-in-4bit"))


# ------------------------------------------------------------------------------------- data parallel
TWO = ["--micro-batch-size", "4", "--nproc-per-node", "2"]
# SGD: Adam's normalised step turns the rounding noise of near-zero gradients (lora_A's, while lora_B is still near
# its zero start) into steps of the full learning rate.
COMMON = ["--train-iters", "3", "--optimizer", "sgd", "--lr", "0.5", "--hidden-dropout", "0", "--merge-lora"]
# DeepSpeed divides each micro-batch's loss itself: the causal-LM task counts its tokens up front (count_items), so
# its micro-batches of unequal token counts still average token-exactly there (the layout and JSON that LLaMA
# fine-tuning posts use, 2 micro-batches a rank). A step without that count is averaged per micro-batch (the run
# warns): the pretraining example, whose micro-batches hold equal token counts (LoRA on a user's own model, which is
# not a Hugging Face model: the adapter alone is exported).
SCRIPT = ["--user-script", str(REPO / "examples" / "pretrain_custom_model.py"), "--global-batch-size", "8"]
SCRIPT += ["--seq-length", "16", "--hidden-size", "32", "--log-interval", "1", "--lora-rank", "4"]
LAYOUTS = {
    "one": ["--micro-batch-size", "8"],
    "ddp": TWO,
    "zero3": [*TWO, "--zero-3-memory-optimization"],
    "zero3_offload": [*TWO, "--zero-3-memory-optimization", "--cpu-offload"],
    "deepspeed_zero3_offload": [
        "--micro-batch-size", "2", "--nproc-per-node", "2",
        "--deepspeed-config", str(REPO / "examples" / "deepspeed_zero3_offload.json"),
    ],
    "script_one": ["--micro-batch-size", "4"],
    "script_deepspeed_zero3_offload": [
        "--micro-batch-size", "2", "--nproc-per-node", "2",
        "--deepspeed-config", str(REPO / "examples" / "deepspeed_zero3_offload.json"),
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def layout_run(assets, tmp_path_factory):
    """The --save directory of each layout's run, trained once; the one-process references in this process (a
    launch of their own proves nothing here), the two-rank runs launched as a user launches them."""
    root = tmp_path_factory.mktemp("lora_layouts")
    done = {}

    def get(name):
        if name not in done:
            workload = SCRIPT if name.startswith("script") else task_args(assets)
            argv = [*workload, *COMMON, *LAYOUTS[name], "--save", str(root / name)]
            if "--nproc-per-node" in argv:
                proc = rapidlite(*argv)
                assert proc.returncode == 0, proc.stderr[-3000:]
            else:
                assert rapidlite_here(*argv) == 0
            done[name] = root / name
        return done[name]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout", ["ddp", "zero3", "zero3_offload", "deepspeed_zero3_offload", "script_deepspeed_zero3_offload"]
)
def test_lora_on_two_ranks_equals_one_process(layout_run, layout):
    if "deepspeed" in layout:
        pytest.importorskip("deepspeed")
    reference, run = layout_run("script_one" if layout.startswith("script") else "one"), layout_run(layout)
    assert train_losses(run) == pytest.approx(train_losses(reference), rel=1e-5)
    validation = [r["loss"] for r in read_metrics(run) if r.get("split") == "validation"]
    assert validation == pytest.approx([r["loss"] for r in read_metrics(reference) if r.get("split") == "validation"],
                                       rel=1e-5)  # fmt: skip
    want = load_file(reference / "hf" / "adapter" / "adapter_model.safetensors")
    got = load_file(run / "hf" / "adapter" / "adapter_model.safetensors")
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)
    if (reference / "hf" / "model.safetensors").exists():
        merged_want = load_file(reference / "hf" / "model.safetensors")
        merged_got = load_file(run / "hf" / "model.safetensors")
        for name, value in merged_want.items():
            torch.testing.assert_close(merged_got[name].float(), value.float(), rtol=1e-4, atol=1e-5, msg=name)
    if "deepspeed" not in layout:
        assert all("lora_" in k for k in checkpoint_keys(run))  # sharded or not, the adapters only


@pytest.mark.distributed
def test_a_checkpoint_of_two_sharded_ranks_resumes_on_one_process(layout_run, assets, tmp_path):
    """The ZeRO-3 run's adapter checkpoint (iteration 3) continues on one process as the one-process run's does."""

    def resume(name):
        shutil.copytree(layout_run(name), tmp_path / name)
        args = [*task_args(assets), *COMMON, "--micro-batch-size", "8", "--load", str(tmp_path / name)]
        args[args.index("--train-iters") + 1] = "4"
        t = CausalLMFinetuner(RapidliteEngine(args=parse_args([*args, "--save", str(tmp_path / name)])))
        t.train()
        assert t.iteration == 4
        return train_losses(tmp_path / name)[-1], adapter_params(t.model)

    (loss, adapters), (want_loss, want) = resume("zero3"), resume("one")
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for name, value in want.items():
        torch.testing.assert_close(adapters[name], value, rtol=1e-4, atol=1e-5, msg=name)
