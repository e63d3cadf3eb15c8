"""Vision-language fine-tuning (``--task causal_lm`` on data with images): the data layouts, TRL's SFTTrainer as the
reference for the batch and the loss, freezing, the layouts against one process, and the bad inputs."""

from __future__ import annotations

import base64
import io
import json
import os

import pytest
import torch

from helpers import assert_same_metrics, rapidlite, rapidlite_captured, read_metrics
from rapidlite import RapidliteEngine
from rapidlite.resolve import parse_args
from rapidlite.tasks.causal_lm import CausalLMFinetuner
from rapidlite.tasks.vision_build import save_tiny_vlm

trl = pytest.importorskip("trl")

WORDS = "what colour is the shape square circle red blue green describe it a".split()
COLOURS = ("red", "blue", "green")
SHAPES = ("square", "circle")
TOL = {"rel": 1e-5, "abs": 1e-6}


def _image(i):
    from PIL import Image, ImageDraw

    colour, shape = COLOURS[i % 3], SHAPES[(i // 3) % 2]
    image = Image.new("RGB", (32 + 5 * (i % 6), 32 + 7 * (i % 4)), "white")
    pen = ImageDraw.Draw(image)
    (pen.rectangle if shape == "square" else pen.ellipse)((3, 3, 22, 22), fill=colour)
    return image, f"{colour} {shape}"


def _rows(layout, n, start=0):
    """``n`` rows of one layout: one image and one question each (the image opens the user turn)."""
    rows = []
    for i in range(start, start + n):
        path, answer = f"images/{i}.png", _image(i)[1]
        question = "describe the shape" if i % 2 else "what colour is it"
        answer = answer if i % 2 else answer.split()[0]
        if layout == "factory":  # LLaMA-Factory: <image> in the text, paths in images
            messages = [{"role": "user", "content": f"<image>{question}"}, {"role": "assistant", "content": answer}]
            rows.append({"messages": messages, "images": [path]})
        elif layout == "content":  # TRL/axolotl content lists with the path in the image item
            user = [{"type": "image", "path": path}, {"type": "text", "text": question}]
            answer_items = [{"type": "text", "text": answer}]
            rows.append(
                {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer_items}]}
            )
        elif layout == "base64":  # axolotl's base64 image items
            data = base64.b64encode(_png(i)).decode()
            user = [{"type": "image", "base64": data}, {"type": "text", "text": question}]
            rows.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
        elif layout == "datasets":  # a datasets Image column of PIL images, TRL's text-only chat
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            rows.append({"messages": messages, "images": [_image(i)[0]]})
        elif layout == "trl":  # TRL's conversational prompt/completion, images before the first user turn
            rows.append(
                {
                    "prompt": [{"role": "user", "content": question}],
                    "completion": [{"role": "assistant", "content": answer}],
                    "images": [path],
                }
            )
    return rows


def _png(i):
    out = io.BytesIO()
    _image(i)[0].save(out, format="PNG")
    return out.getvalue()


def _write(directory, rows_by_split):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "images").mkdir(exist_ok=True)
    for i in range(24):
        _image(i)[0].save(directory / "images" / f"{i}.png")
    if rows_by_split and not isinstance(next(iter(rows_by_split.values()))[0].get("images", [""])[0], str):
        import datasets

        features = datasets.Features(
            {
                "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                "images": datasets.Sequence(datasets.Image()),
            }
        )
        splits = {k: datasets.Dataset.from_list(v, features=features) for k, v in rows_by_split.items()}
        datasets.DatasetDict(splits).save_to_disk(str(directory / "saved"))
        return directory / "saved"
    for split, rows in rows_by_split.items():
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    models = {family: root / family for family in ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3")}
    for family, directory in models.items():
        save_tiny_vlm(directory, family, WORDS)
    data = {
        layout: _write(root / layout, {"train": _rows(layout, 16), "validation": _rows(layout, 4, start=16)})
        for layout in ("factory", "content", "trl", "base64", "datasets")
    }
    return models, data


def _args(model, data, *extra):
    return [
        "--task", "causal_lm", "--pretrained-model-name-or-path", str(model), "--data-path", str(data),
        "--micro-batch-size", "4", "--log-interval", "1", "--seq-length", "128", *extra,
    ]  # fmt: skip


def _trainer(model, data, *extra):
    trainer = CausalLMFinetuner(RapidliteEngine(args=parse_args(_args(model, data, *extra))))
    train, _, _, collate = trainer.train_valid_test_datasets_provider()
    return trainer, train, collate


def test_the_layouts_give_the_same_tensors(assets):
    models, data = assets
    batches = {}
    for layout in ("factory", "content", "trl", "base64", "datasets"):
        _, train, collate = _trainer(models["qwen2_vl"], data[layout])
        batches[layout] = collate([train[i] for i in range(6)])
    reference = batches["factory"]
    assert set(reference) >= {"input_ids", "labels", "attention_mask", "pixel_values", "image_grid_thw"}
    for layout in ("content", "trl", "base64", "datasets"):
        assert set(batches[layout]) == set(reference)
        for key, value in reference.items():
            assert torch.equal(batches[layout][key], value), (layout, key)


def _trl_sft(model_dir, rows, model):
    """TRL's SFTTrainer batch of ``rows`` (prompt/completion with PIL images) and its loss on it."""
    from datasets import Dataset

    processor = _processor(model_dir)
    config = trl.SFTConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False, max_length=None)
    trainer = trl.SFTTrainer(
        model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=processor
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    model.train()
    return batch, float(trainer.compute_loss(model, batch))


def _processor(model_dir):
    from rapidlite.models.vision import load_processor

    return load_processor(str(model_dir))


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3"])
def test_the_batch_labels_and_loss_equal_trls_sft_trainer(assets, family):
    """The processed inputs, the labels (prompt, image tokens and padding masked) and the loss equal TRL 1.16's
    SFTTrainer on the same prompt/completion rows (completion-only loss, its default for such data)."""
    from PIL import Image

    models, data = assets
    trainer, train, collate = _trainer(models[family], data["trl"])
    ours = collate([train[i] for i in range(4)])
    model = trainer.model_optimizer_lr_scheduler_provider()[0]
    for p in model.parameters():
        p.requires_grad_(True)  # TRL trains the whole model; the loss does not depend on it
    rows = _rows("trl", 4)
    for row in rows:
        row["images"] = [Image.open(data["trl"] / p).convert("RGB") for p in row["images"]]
    theirs, trl_loss = _trl_sft(models[family], rows, model)
    for key in (
        "input_ids",
        "attention_mask",
        "labels",
        "pixel_values",
        "image_grid_thw",
        "image_sizes",
        "token_type_ids",
    ):
        if key in theirs:
            assert torch.equal(ours[key], theirs[key]), key
    assert (ours["labels"] != -100).sum() < (ours["attention_mask"] == 1).sum() // 2  # the prompt is masked
    model.train()
    loss_sum, count = trainer.run_forward_step(ours, model)
    assert float(loss_sum) / count == pytest.approx(trl_loss, **TOL)


def _tower(directory):
    from safetensors.torch import load_file

    weights = load_file(os.path.join(directory, "model.safetensors"))
    return {k: v for k, v in weights.items() if ".visual." in f".{k}" and ".merger." not in k}


def test_the_tower_is_frozen_by_default_and_trains_without_it(assets, tmp_path):
    models, data = assets
    before = _tower(models["qwen2_vl"])
    for name, flags in (("frozen", []), ("trained", ["--no-freeze-vision-tower"])):
        proc = rapidlite_captured(
            *_args(models["qwen2_vl"], data["factory"], "--train-iters", "2", "--lr", "1e-2", *flags),
            "--save", str(tmp_path / name),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        after = _tower(tmp_path / name / "hf")
        assert after.keys() == before.keys() and after
        same = all(torch.equal(after[k], before[k]) for k in before)
        assert same == (name == "frozen"), name
    out = proc.stdout + proc.stderr
    assert "vision tower" in out and "language model" in out
    # The export holds the processor: transformers reloads both, and gives the checkpoint's logits on an image.
    from transformers import AutoModelForImageTextToText

    exported = tmp_path / "trained" / "hf"
    processor = _processor(exported)
    model = AutoModelForImageTextToText.from_pretrained(exported).eval()
    image, _ = _image(3)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe the shape"}]}],
        add_generation_prompt=True,
    )
    inputs = processor(text=[text], images=[[image]], return_tensors="pt")
    logits = model(**inputs).logits
    assert torch.isfinite(logits).all() and logits.shape[1] == inputs["input_ids"].shape[1]


TWO = ["--micro-batch-size", "2", "--nproc-per-node", "2"]
LAYOUTS = {
    "one": ["--micro-batch-size", "4"],
    "accumulation": ["--micro-batch-size", "2"],
    "ddp": TWO,
    "zero2": [*TWO, "--zero-2-memory-optimization"],
    "zero3_offload": [*TWO, "--zero-3-memory-optimization", "--cpu-offload"],
    "checkpointing": ["--micro-batch-size", "4", "--checkpoint-activations", "--offload-activations"],
    "deepspeed_zero3": [*TWO, "--deepspeed", "--zero-3-memory-optimization"],
    "lora_one": ["--micro-batch-size", "4", "--lora-rank", "4"],
    "lora_zero3": [*TWO, "--zero-3-memory-optimization", "--lora-rank", "4"],
}


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    models, data = assets
    root = tmp_path_factory.mktemp("vision-layouts")
    done = {}

    def get(name):
        if name not in done:
            common = ["--train-iters", "2", "--global-batch-size", "4", "--optimizer", "sgd", "--lr", "0.05"]
            run = rapidlite if "--nproc-per-node" in LAYOUTS[name] else rapidlite_captured
            args = _args(models["qwen2_vl"], data["factory"], *common, *LAYOUTS[name], "--save", str(root / name))
            proc = run(*args)
            assert proc.returncode == 0, proc.stderr[-3000:]
            # FSDP2 once warned at the per-image features transformers returns as views (nothing changes them)
            assert "returned a view tensor" not in proc.stderr, name
            done[name] = root / name
        return done[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["accumulation", "checkpointing", "ddp", "zero2", "zero3_offload", "deepspeed_zero3", "lora_zero3"]
)
def test_a_layout_equals_one_process(runs, name):
    if name == "deepspeed_zero3":
        pytest.importorskip("deepspeed")
    reference = runs("lora_one" if name.startswith("lora") else "one")
    assert_same_metrics(runs(name), reference, ("loss", "grad_norm"), rel=1e-5, at_least=3)
    losses = [r["loss"] for r in read_metrics(runs(name)) if "lr" in r]
    assert losses[1] != losses[0]  # the step moved the model


def _fails(capsys_args, *extra):
    proc = rapidlite_captured(*capsys_args, *extra)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return proc.returncode, lines


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", "no such file"),
        ("not_an_image", "not an image"),
        ("placeholders", "2 image placeholders"),
        ("text_only_model", "is a text-only model"),
        ("packing", "--packing: the data has images"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(assets, tmp_path, case, expected):
    models, data = assets
    rows = _rows("factory", 4)
    model = models["qwen2_vl"]
    extra = []
    if case == "missing":
        rows[2]["images"] = ["images/nowhere.png"]
    elif case == "not_an_image":
        rows[1]["images"] = ["bad.png"]
    elif case == "placeholders":
        rows[3]["messages"][0]["content"] = "<image><image>what colour is it"
    elif case == "text_only_model":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = tmp_path / "llama"
        LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2)).save_pretrained(model)  # fmt: skip
        _processor(models["qwen2_vl"]).tokenizer.save_pretrained(model)
    elif case == "packing":
        extra = ["--packing"]
    directory = _write(tmp_path / "data", {"train": rows, "validation": rows[:1]})
    (directory / "bad.png").write_text("not an image")
    save = tmp_path / "out"
    code, lines = _fails(_args(model, directory, "--train-iters", "1", "--save", str(save), *extra))
    assert code == 2, lines
    assert len(lines) == 1 and expected in lines[0], lines
    assert not save.exists()


def test_tensor_parallelism_is_refused_in_one_line(assets, tmp_path):
    models, data = assets
    argv = _args(models["qwen2_vl"], data["factory"], "--train-iters", "1", "--save", str(tmp_path / "o"))
    proc = rapidlite(*argv, "--nproc-per-node", "2", "--tensor-model-parallel-size", "2")
    assert proc.returncode == 2
    assert "--tensor-model-parallel-size: not built for vision-language models" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()


def test_skip_bad_images_leaves_out_rows_whose_image_is_missing(assets, tmp_path):
    models, _ = assets
    rows = _rows("factory", 8)
    rows[5]["images"] = ["images/nowhere.png"]
    directory = _write(tmp_path / "data", {"train": rows, "validation": rows[:2]})
    proc = rapidlite_captured(
        *_args(models["llava"], directory, "--train-iters", "1", "--skip-bad-images", "--save", str(tmp_path / "o"))
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1 rows left out with a missing image" in proc.stdout + proc.stderr


# ------------------------------------------------------------------ dpo


def _pairs(layout, n, start=0):
    """Preference pairs with one image: the right answer against a wrong colour."""
    rows = []
    for i in range(start, start + n):
        answer = _image(i)[1]
        wrong = answer.replace(answer.split()[0], COLOURS[(COLOURS.index(answer.split()[0]) + 1) % 3])
        if layout == "trl":
            rows.append(
                {
                    "prompt": [{"role": "user", "content": "describe the shape"}],
                    "chosen": [{"role": "assistant", "content": answer}],
                    "rejected": [{"role": "assistant", "content": wrong}],
                    "images": [f"images/{i}.png"],
                }
            )
        else:  # LLaMA-Factory's: the prompt turns in messages, one assistant message each
            rows.append(
                {
                    "messages": [{"role": "user", "content": "<image>describe the shape"}],
                    "chosen": {"role": "assistant", "content": answer},
                    "rejected": {"role": "assistant", "content": wrong},
                    "images": [f"images/{i}.png"],
                }
            )
    return rows


def test_dpo_with_images_equals_trls_dpo_trainer(assets, tmp_path):
    """The same pairs in TRL's and LLaMA-Factory's layouts give the same batch, and its DPO loss equals TRL 1.16's
    DPOTrainer's on it (the policy moved off its reference, so the loss is not log 2)."""
    import copy

    from datasets import Dataset
    from PIL import Image

    from rapidlite.tasks.dpo import DPOFinetuner

    models, _ = assets
    model_dir = models["qwen2_vl"]
    batches = {}
    for layout in ("trl", "factory"):
        directory = _write(tmp_path / layout, {"train": _pairs(layout, 4), "validation": _pairs(layout, 2, 4)})
        args = _args(model_dir, directory)
        args[1] = "dpo"
        trainer = DPOFinetuner(RapidliteEngine(args=parse_args(args)))
        train, _, _, collate = trainer.train_valid_test_datasets_provider()
        batches[layout] = collate([train[i] for i in range(4)])
    for key, value in batches["trl"].items():
        assert torch.equal(batches["factory"][key], value), key
    batch = batches["trl"]
    ref = trainer.model_optimizer_lr_scheduler_provider()[0].eval()
    policy = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            p.requires_grad_(True)
    trainer.ref_model = ref
    policy.train()
    loss_sum, pairs = trainer.run_forward_step(batch, policy)
    rows = _pairs("trl", 4)
    for row in rows:
        row["images"] = [Image.open(tmp_path / "trl" / p).convert("RGB") for p in row["images"]]
    config = trl.DPOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False, max_length=None)
    theirs = trl.DPOTrainer(
        model=copy.deepcopy(policy), ref_model=ref, args=config, train_dataset=Dataset.from_list(rows),
        processing_class=_processor(model_dir),
    )  # fmt: skip
    trl_batch = theirs.data_collator([theirs.train_dataset[i] for i in range(4)])
    theirs.model.train()
    trl_loss = float(theirs.compute_loss(theirs.model, trl_batch))
    assert float(loss_sum) / pairs == pytest.approx(trl_loss, **TOL)
    assert abs(trl_loss - 0.6931) > 1e-3


@pytest.mark.slow
def test_dpo_with_images_on_two_ranks_equals_one_process(assets, tmp_path):
    models, _ = assets
    directory = _write(tmp_path / "pairs", {"train": _pairs("factory", 8), "validation": _pairs("factory", 2, 8)})
    common = ["--train-iters", "2", "--global-batch-size", "4", "--optimizer", "sgd", "--lr", "0.05"]
    saves = {}
    for name, layout in (("one", ["--micro-batch-size", "4"]), ("ddp", TWO)):
        args = _args(models["qwen2_vl"], directory, *common, *layout, "--save", str(tmp_path / name))
        args[1] = "dpo"
        proc = (rapidlite if name == "ddp" else rapidlite_captured)(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        saves[name] = tmp_path / name
    assert_same_metrics(saves["ddp"], saves["one"], ("loss", "grad_norm", "rewards/margins"), rel=1e-5, at_least=3)


VISION_TYPES = ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3", "smolvlm"]


def test_every_vision_family_is_here():
    from rapidlite.models.spec import _REGISTRY

    named = {model_type for spec in _REGISTRY if spec.vision is not None for model_type in spec.model_types}
    assert named == set(VISION_TYPES)


@pytest.mark.parametrize("model_type", VISION_TYPES)
def test_every_family_names_its_tower_projector_and_language_model(model_type):
    """Each family's spec splits the model (its default config, built on the meta device) into the three parts,
    none empty; its blocks are the language model's; LoRA's default targets lie in the language model only."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from rapidlite.config.sections import LoraConfig
    from rapidlite.models import lora
    from rapidlite.models.spec import find_blocks, spec_of
    from rapidlite.models.vision import parameter_parts

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(model_type))
    spec = spec_of(model)
    assert spec.vision is not None, model_type
    parts = parameter_parts(model)
    assert all(total > 0 for _, total in parts.values()), parts
    blocks = find_blocks(model)
    language = getattr(model.model, spec.vision.language_model)
    assert blocks is language.layers
    targets = lora.target_modules(model, LoraConfig(lora_rank=4))
    assert targets and all(spec.vision.part(t) == "language" for t in targets)


@pytest.mark.slow
def test_the_dry_run_counts_the_images(tmp_path):
    """--dry-run plans one image a sample at --image-max-pixels through the processor's rule, and what the trained
    vision tower saves for it: the plan is within 15% of the run's measured peak, where leaving the images out
    would be 30% under it."""
    import re

    from PIL import Image, ImageDraw
    from test_dry_run import plans

    save_tiny_vlm(tmp_path / "model", "qwen2_vl", WORDS, image_side=224, vision_width=128)
    rows = []
    (tmp_path / "data" / "images").mkdir(parents=True)
    for i in range(12):
        image = Image.new("RGB", (448, 448), "white")
        ImageDraw.Draw(image).ellipse((40, 40, 200, 200), fill=COLOURS[i % 3])
        image.save(tmp_path / "data" / "images" / f"{i}.png")
        user = {"role": "user", "content": "<image>what colour is it"}
        rows.append(
            {"messages": [user, {"role": "assistant", "content": COLOURS[i % 3]}], "images": [f"images/{i}.png"]}
        )
    for split, part in (("train", rows[:10]), ("validation", rows[10:])):
        (tmp_path / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    argv = _args(tmp_path / "model", tmp_path / "data", "--no-freeze-vision-tower", "--train-iters", "2")
    argv[argv.index("--micro-batch-size") + 1], argv[argv.index("--seq-length") + 1] = "8", "320"
    (rank,) = plans({"vision": argv})["vision"]
    proc = rapidlite(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = max(float(x) for x in re.findall(r"\| peak_memory_mb: ([\d.]+)", proc.stdout + proc.stderr))
    predicted = rank["peak_bytes"] / 2**20
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)
    assert rank["activation_bytes"] / 2**20 > 0.3 * measured  # the images are most of the activations


@pytest.mark.slow
def test_the_vision_demo_answers_unseen_images(tmp_path, monkeypatch):
    """``--task causal_lm --demo vision`` as the docs run it: no validation image answered before training, at least
    0.9 of them exactly after it."""
    from helpers import run_cli

    monkeypatch.setenv("RAPIDLITE_CACHE", str(tmp_path / "cache"))
    proc = run_cli("--task", "causal_lm", "--demo", "vision", "--save", str(tmp_path / "run"), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [r for r in read_metrics(tmp_path / "run") if r.get("split") == "validation"]
    assert evals[0]["iteration"] == 0 and evals[0]["exact_match"] == 0.0
    assert evals[-1]["exact_match"] >= 0.9, evals


def test_rapidlite_eval_scores_image_rows(assets, tmp_path, capsys):
    """rapidlite-eval on the exported model: a chat file's perplexity is the run's last validation loss, and
    multiple choice over the colours reads the images; on two ranks the same."""
    from rapidlite.cli.evaluate import main as evaluate

    models, data = assets
    proc = rapidlite_captured(
        *_args(models["qwen2_vl"], data["factory"], "--train-iters", "2", "--lr", "1e-2", "--save", str(tmp_path / "o"))
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = [r for r in read_metrics(tmp_path / "o") if r.get("split") == "validation"][-1]
    model = str(tmp_path / "o" / "hf")
    assert evaluate(["--model", model, "--data", str(data["factory"] / "validation.jsonl")]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["task"] == "perplexity" and scored["loss"] == pytest.approx(last["loss"], rel=1e-5)
    rows = [
        {"context": "<image>what colour is it", "endings": list(COLOURS), "label": i % 3, "images": [f"images/{i}.png"]}
        for i in range(6)
    ]
    choices = data["factory"] / "choices.jsonl"
    choices.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert evaluate(["--model", model, "--data", str(choices)]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["task"] == "multiple_choice" and one["n"] == 6
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = ["--model", model, "--data", str(choices), "--nproc-per-node", "2", "--micro-batch-size", "2"]
    two = subprocess.run(
        [sys.executable, "-m", "rapidlite.cli.evaluate", *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert two.returncode == 0, two.stderr[-3000:]
    two = json.loads(two.stdout.strip().splitlines()[-1])
    assert two["world_size"] == 2 and two["acc"] == one["acc"] and two["acc_norm"] == one["acc_norm"]
    # rapidlite export writes the processor beside the checkpoint's model, checked on an image and a question.
    exported = rapidlite_captured("export", str(tmp_path / "o"), "--out", str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "the model (an image and a question): max |logit difference| 0 " in exported.stdout + exported.stderr
    assert (tmp_path / "exported" / "processor_config.json").is_file()


def test_the_flops_count_the_vision_encoder_per_image_patch():
    """N is the language model's; the tower and projector run per patch: 2 N_v forward, 4 N_v of what trains
    backward. The patches of a batch are counted from Qwen-VL's grid, or the pixels and the patch size."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from rapidlite.models.flops import ModelFlops, matmul_parameters
    from rapidlite.models.vision import freeze, image_patches

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model("llava"))
    freeze(model, freeze_tower=True, freeze_projector=False)
    flops = ModelFlops.of(model)
    tower = matmul_parameters(model.model.vision_tower)
    projector = matmul_parameters(model.model.multi_modal_projector)
    assert flops.vision_params == tower + projector and flops.vision_trained == projector
    assert flops.matmul_params == matmul_parameters(model) - tower - projector
    assert flops.per_patch() == 2 * (tower + projector) + 4 * projector
    assert "per image patch" in flops.describe() and flops.patch_size == 14
    assert image_patches({"pixel_values": torch.zeros(3, 3, 336, 336)}, 14) == 3 * 24 * 24
    assert image_patches({"image_grid_thw": torch.tensor([[1, 4, 6], [1, 2, 2]])}, 14) == 28
    assert image_patches({"input_ids": torch.zeros(2, 3)}, 14) == 0


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_5_vl", "gemma3"])
def test_a_family_trains_and_its_export_reloads(assets, tmp_path, family):
    """LLaVA, LLaVA-NeXT (any resolution: patch counts differ by image), Qwen2.5-VL (windowed vision attention) and
    Gemma 3 (token types: its image tokens attend both ways) train two steps on the LLaMA-Factory layout, the loss
    moving, and the export reloads in transformers with its processor."""
    from transformers import AutoModelForImageTextToText

    models, data = assets
    save = tmp_path / "run"
    proc = rapidlite_captured(*_args(models[family], data["factory"], "--train-iters", "2", "--save", str(save)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(save) if "lr" in r]
    assert len(losses) == 2 and losses[1] != losses[0]
    processor = _processor(save / "hf")
    model = AutoModelForImageTextToText.from_pretrained(save / "hf").eval()
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is it"}]}],
        add_generation_prompt=True,
    )
    inputs = processor(text=[text], images=[[_image(0)[0]]], return_tensors="pt")
    assert torch.isfinite(model(**inputs).logits).all()


def test_an_image_found_bad_in_a_loader_worker_is_one_line_or_skipped(assets, tmp_path):
    """An unreadable image past the rows opened at start-up fails in a loader worker: one line and exit 2, not the
    worker's traceback; with --skip-bad-images the sample is left out of its batch and the run goes on, warned."""
    models, _ = assets
    rows = _rows("factory", 12)
    rows[10]["images"] = ["late.png"]
    directory = _write(tmp_path / "data", {"train": rows, "validation": rows[:2]})
    (directory / "late.png").write_text("not an image")
    argv = _args(models["qwen2_vl"], directory, "--epochs", "1", "--num-workers", "1", "--split", "100,0,0")
    code, lines = _fails(argv)
    assert code == 2 and len(lines) == 1 and "row 10: image late.png: not an image" in lines[0], lines
    proc = rapidlite(*argv, "--skip-bad-images")  # its own process: the worker logs to the run's streams
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--skip-bad-images: skipped row 10: image late.png" in proc.stdout + proc.stderr


def test_a_vision_language_model_trains_on_text_only_chats(assets, tmp_path):
    """Text-only prompt/completion rows on a vision-language model go through its processor (no image), the
    prompt masked, as they would with images."""
    models, _ = assets
    rows = [{"prompt": "what colour is it", "completion": COLOURS[i % 3]} for i in range(8)]
    directory = _write(tmp_path / "text", {"train": rows, "validation": rows[:2]})
    trainer, train, collate = _trainer(models["qwen2_vl"], directory)
    batch = collate([train[i] for i in range(4)])
    assert "pixel_values" not in batch and trainer.images
    assert 0 < int((batch["labels"] != -100).sum()) < int(batch["attention_mask"].sum())
    proc = rapidlite_captured(*_args(models["qwen2_vl"], directory, "--train-iters", "1"))
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_vision_family_plans_causal_lm_and_dpo(tmp_path):
    """--dry-run plans each vision-language family (its default config, two layers in each part) for both tasks
    that read images, its activations counted; without a processor beside the model the images are said not to
    be counted, and the plan still prints."""
    from test_dry_run import plans
    from transformers import AutoConfig

    data = {}
    for task, rows in (("causal_lm", _rows("factory", 4)), ("dpo", _pairs("factory", 4))):
        data[task] = _write(tmp_path / task, {"train": rows, "validation": rows[:1]})
    argvs = {}
    for model_type in VISION_TYPES:
        config = AutoConfig.for_model(model_type)
        for part in (config.text_config, config.vision_config):
            for key in ("num_hidden_layers", "depth"):
                if hasattr(part, key):
                    setattr(part, key, 2)
            if getattr(part, "layer_types", None):
                part.layer_types = part.layer_types[:2]
        config.save_pretrained(tmp_path / model_type)
        for task in ("causal_lm", "dpo"):
            argv = _args(tmp_path / model_type, data[task], "--seq-length", "64")
            argv[1] = task
            argvs[f"{model_type}/{task}"] = argv
    planned = plans(argvs)
    for case, result in planned.items():
        assert isinstance(result, list), (case, result)
        (rank,) = result
        assert rank["activation_bytes"] > 0 and rank["param_bytes"] > 0, (case, rank)
