"""``rapidlite export DIR``: a run's checkpoint as a Hugging Face model or a GGUF file, checked by reading it back.

    rapidlite export DIR --out OUT [--format hf|gguf] [--merged|--adapter] [--dtype fp32|fp16|bf16]
                     [--gguf-type f32|f16|q8_0] [--overwrite]

``DIR`` is a run's ``--save`` directory (its newest checkpoint that verifies, as ``--load`` chooses) or one
``iter_N`` checkpoint in it, saved under any layout (one process, DDP, ZeRO/FSDP, DeepSpeed, tensor or pipeline
parallel): the checkpoint's ``config.yaml`` rebuilds the run's model as its task builds it (``--dry-run``'s
``planning.model.task_model``, from the pretrained weights for a LoRA run's base), and ``--load``'s
``load_checkpoint`` fills in the weights. The Hugging Face files are written by the run's own export
(``checkpoint.export.export_hf``); the GGUF file by ``checkpoint.gguf_file``.

Everything is written into a temporary sibling of ``OUT`` and read back there: the Hugging Face model's logits on a
few probe sequences against the checkpoint's model, each GGUF tensor against its source. Only an export that
passes is renamed to ``OUT``; one that does not is removed, with one line naming the difference (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rapidlite.checkpoint.gguf_file import GGUF_TYPES, ExportCheckFailed
from rapidlite.config.settings import Sections
from rapidlite.errors import CheckpointError, ConfigError, RapidliteError

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The largest |logit difference| an export may show, relative to the largest |logit| (at least 1): fp32 only
# reorders arithmetic (a merge's), fp16 and bf16 round every weight (2**-11, 2**-8 relative).
LOGIT_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 6e-2}
PROBES, PROBE_LENGTH = 3, 16
GGUF_NAME = "model.gguf"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see 'rapidlite export --help')")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="rapidlite export",
        description="Export a run's checkpoint as a Hugging Face model or a GGUF file, checked by reading it back.",
        allow_abbrev=False,
    )
    p.add_argument("dir", metavar="DIR", help="a run's --save directory (its latest checkpoint) or an iter_N in it")
    p.add_argument("--out", required=True, metavar="OUT", help="the directory to write (created; see --overwrite)")
    p.add_argument("--format", choices=("hf", "gguf"), default="hf", help="hf: safetensors (default); gguf: llama.cpp")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run: the base with the adapters merged in (default), OUT/adapter too",
    )
    kind.add_argument("--adapter", action="store_true", help="a LoRA run: the peft adapter alone, in OUT/adapter")
    p.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="--format hf: the weights' dtype (default fp32)"
    )
    p.add_argument(
        "--gguf-type", choices=GGUF_TYPES, default=None, help="--format gguf: the matrices' type (default f16)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT when it exists and is not empty")
    return p


@dataclasses.dataclass
class Checkpoint:
    run_dir: Path
    iteration: int
    path: Path


def find_checkpoint(given: str) -> Checkpoint:
    """The checkpoint ``DIR`` names (a run's directory: the one ``--load`` would resume; or an ``iter_N``)."""
    from rapidlite.checkpoint.integrity import verify_checkpoint
    from rapidlite.checkpoint.layout import LATEST_FILE, METADATA_FILE, is_deepspeed_checkpoint
    from rapidlite.checkpoint.selection import select_checkpoint

    path = Path(given)
    if not path.is_dir():
        raise CheckpointError(f"rapidlite export {given}: directory not found")
    if path.name.startswith("iter_") and ((path / METADATA_FILE).is_file() or is_deepspeed_checkpoint(path)):
        problem = verify_checkpoint(path)
        if problem:
            raise CheckpointError(f"rapidlite export {given}: the checkpoint does not verify: {problem}")
        return Checkpoint(path.parent, int(path.name[len("iter_") :]), path)
    if not (path / LATEST_FILE).exists() and not any(p.is_dir() for p in path.glob("iter_*")):
        raise CheckpointError(
            f"rapidlite export {given}: not a rapidlite checkpoint (no '{LATEST_FILE}', no iter_N directory); give "
            "a run's --save directory or one of its iter_N checkpoints"
        )
    iteration, chosen = select_checkpoint(path)
    return Checkpoint(path, iteration, chosen)


def check_out(out: Path, checkpoint: Checkpoint, overwrite: bool) -> None:
    """``OUT``: not the run's checkpoints (nor a directory holding them, which --overwrite would delete), and
    empty or absent unless ``--overwrite``."""
    target, run = out.resolve(), checkpoint.run_dir.resolve()
    protected = [run / p.name for p in run.glob("iter_*")] + [checkpoint.path.resolve(), run / "latest"]
    if target == run or run.is_relative_to(target) or any(target.is_relative_to(p) for p in protected):
        raise ConfigError(
            f"--out {out}: lies in or over the run's checkpoints in {checkpoint.run_dir}; pass a directory outside "
            f"them (e.g. {checkpoint.run_dir}/export or {run.name}-export)"
        )
    if out.is_file():
        raise ConfigError(f"--out {out}: is a file; pass a directory to write the export into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--out {out}: exists and is not empty; give --overwrite to replace it, or another directory")


def run_settings(checkpoint: Checkpoint) -> Sections:
    """The run's resolved settings from the checkpoint's ``config.yaml`` (without its ``--save``: nothing is
    trained or written there)."""
    from rapidlite.config.files import FILE_NAME
    from rapidlite.config.parser import parse_known
    from rapidlite.resolve import resolve_command

    config = checkpoint.path / FILE_NAME
    if not config.is_file():
        raise CheckpointError(
            f"rapidlite export {checkpoint.run_dir}: {checkpoint.path.name} has no {FILE_NAME}, so the run's model "
            "cannot be rebuilt (a checkpoint from an earlier version: read its weights with read_model_tensors)"
        )
    namespace, unknown = parse_known(["--config", str(config)])
    if unknown:
        raise ConfigError(f"{config}: flags this version does not know: {' '.join(unknown)}")
    namespace.save = None
    try:
        settings = resolve_command(namespace).sections
    except RapidliteError as e:
        raise ConfigError(f"{config}: the run's settings do not resolve here: {e}") from None
    if settings.task.user_script is not None:
        raise ConfigError(
            f"{config}: a --user-script run's model is built by its script, which export cannot rebuild; export it "
            "at the end of the run (--save writes DIR/hf) or load read_model_tensors(DIR/iter_N) into your model"
        )
    return settings


def rebuild(checkpoint: Checkpoint, settings: Sections, log: list[str]) -> torch.nn.Module:
    """The run's model with the checkpoint's weights, on the CPU, in fp32, in evaluation mode."""
    from rapidlite.checkpoint.dcp import load_checkpoint
    from rapidlite.models import lora
    from rapidlite.planning.model import task_model

    adapters = settings.lora
    model = task_model(settings, torch.device("cpu"), pretrained=adapters.enabled)
    if adapters.enabled:
        if adapters.quantized:
            log.append(f"{adapters.quant_flag}: the base is rebuilt unquantised (its pretrained weights)")
        adapters = dataclasses.replace(adapters, load_in_4bit=False, load_in_8bit=False)
        model = lora.prepare(model, adapters, None, torch.device("cpu"))
    else:
        _grow_embeddings(model, checkpoint.path, log)
    load_checkpoint(checkpoint.run_dir, model, weights_only=True, chosen=(checkpoint.iteration, checkpoint.path))
    return model.float().eval()


def _grow_embeddings(model: torch.nn.Module, path: Path, log: list[str]) -> None:
    """A run that grew the embeddings to its tokenizer's added tokens (``--task causal_lm``): the rebuilt model
    grows them to the checkpoint's rows, which it then loads."""
    from rapidlite.checkpoint.dcp import saved_shapes

    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # not a Hugging Face model
        return
    name = next((n for n, p in model.named_parameters() if p is embeddings.weight), None)
    rows = saved_shapes(path).get(name, (embeddings.num_embeddings,))[0]
    if rows != embeddings.num_embeddings:
        model.resize_token_embeddings(rows)
        log.append(f"the run grew the embeddings to {rows} rows (its tokenizer's added tokens): so does the export")


def run_tokenizer(settings: Sections) -> Any:
    """The tokenizer the run trained with, as a ``transformers`` tokenizer, or None."""
    from rapidlite.data.tokenizers import tokenizer_of
    from rapidlite.models.hf import load_tokenizer

    try:
        if settings.data.tokenizer_type is not None:
            return tokenizer_of(settings).hf_tokenizer()
        name = settings.model.pretrained_model_name_or_path
        if name and _vision(name):  # a vision-language model is exported with its processor
            from rapidlite.models.vision import load_processor

            return load_processor(name)
        return load_tokenizer(name) if name else None
    except RapidliteError:
        return None


def _vision(name: str) -> bool:
    from transformers import AutoConfig

    from rapidlite.models.vision import is_vision_config

    try:
        return is_vision_config(AutoConfig.from_pretrained(name))
    except (OSError, ValueError):
        return False


def probe_ids(model: torch.nn.Module) -> torch.Tensor:
    """``PROBES`` fixed random sequences within the model's vocabulary and positions."""
    from rapidlite.models import lora

    base = lora.unwrap(model)
    config = getattr(base, "config", None)
    try:
        vocab = base.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        vocab = config.vocab_size
    limits = [getattr(config, k, None) for k in ("max_position_embeddings", "n_positions", "seq_length")]
    length = min([PROBE_LENGTH, *(v for v in limits if isinstance(v, int))])
    return torch.randint(0, vocab, (PROBES, length), generator=torch.Generator().manual_seed(0))


def probe_inputs(model: torch.nn.Module, preprocessor: Any) -> torch.Tensor | dict[str, torch.Tensor]:
    """The round trip's probe: ``probe_ids``, or for a vision-language model (exported with its processor) a fixed
    random image and a question, through the processor and its chat template."""
    if getattr(preprocessor, "image_processor", None) is None:
        return probe_ids(model)
    from PIL import Image

    pixels = torch.randint(0, 256, (48, 64, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the image"}]}]
    text = preprocessor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return dict(preprocessor(text=[text], images=[[Image.fromarray(pixels.numpy())]], return_tensors="pt"))


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**ids) if isinstance(ids, dict) else model(ids)
    value = getattr(out, "logits", None)
    if value is None:
        value = out[0] if isinstance(out, (tuple, list)) else out
    return value.float()


def reload_hf(directory: Path) -> torch.nn.Module:
    """The model in an export directory as a user loads it: the ``transformers`` class its config names, or the
    built-in GPT's own format."""
    import transformers

    from rapidlite.models.gpt import GPTModel

    architectures = json.loads((directory / "config.json").read_text()).get("architectures") or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    model = (cls or GPTModel).from_pretrained(directory)
    return model.float().eval()


def compare_logits(expected: torch.Tensor, got: torch.Tensor, dtype: str, what: str) -> str:
    """One line of the logits' largest difference, or ``ExportCheckFailed`` past the dtype's tolerance."""
    if got.shape != expected.shape:
        raise ExportCheckFailed(
            f"hf round trip: {what} gives logits of shape {tuple(got.shape)}, not {tuple(expected.shape)}"
        )
    diff = float((got - expected).abs().max())
    tolerance = LOGIT_TOLERANCE[dtype] * max(1.0, float(expected.abs().max()))
    line = (
        f"hf round trip: {what}: max |logit difference| {diff:.3g} over {expected.shape[0]} probe sequences of "
        f"{expected.shape[1]} tokens (tolerance {tolerance:.3g} for {dtype})"
    )
    if not diff <= tolerance:  # NaN fails too
        raise ExportCheckFailed(line + "; the export is not kept")
    return line


def export_hf_checked(
    model: torch.nn.Module, settings: Sections, tokenizer: Any, tmp: Path, args: argparse.Namespace
) -> list[str]:
    from rapidlite.checkpoint.export import export_hf
    from rapidlite.models import lora
    from rapidlite.planning.model import task_model

    dtype = args.dtype or "fp32"
    adapters = lora.is_peft_model(model)
    if args.adapter and not adapters:
        raise ConfigError("--adapter: the run trained no LoRA adapters (no --lora-rank); export it without --adapter")
    ids = probe_inputs(model, tokenizer)
    expected = logits(model, ids)
    on = " (an image and a question)" if isinstance(ids, dict) else ""
    model.to(DTYPES[dtype])
    if export_hf(model, tmp, tokenizer, merge_adapters=adapters and not args.adapter) is None:
        raise ConfigError(f"--format hf: {type(lora.unwrap(model)).__name__} is not a Hugging Face model")
    lines = []
    if adapters:
        base = task_model(settings, torch.device("cpu"), pretrained=True)
        with_adapter = lora.load_adapter(base, tmp / "adapter").float().eval()
        lines.append(compare_logits(expected, logits(with_adapter, ids), dtype, "the base with OUT/adapter" + on))
    if not args.adapter:
        lines.append(
            compare_logits(
                expected, logits(reload_hf(tmp), ids), dtype, ("the merged model" if adapters else "the model") + on
            )
        )
    return lines


def export_gguf_checked(
    model: torch.nn.Module, tokenizer: Any, tmp: Path, args: argparse.Namespace, name: str
) -> list[str]:
    from rapidlite.checkpoint.gguf_file import FAMILIES, check_gguf, family, write_gguf
    from rapidlite.models import lora
    from rapidlite.models.gpt import GPTModel

    if lora.is_peft_model(model):
        model = model.merge_and_unload()
    if isinstance(model, GPTModel):
        from rapidlite.models import gpt_hf

        if gpt_hf.hf_layout(model.config) is None:
            raise ConfigError(
                f"--format gguf supports {FAMILIES}; the built-in GPT maps onto them only with GPT-2's blocks "
                "(LayerNorm, GELU, learned positions, biases) or LLaMA's (RMSNorm, --swiglu, rotary positions)"
            )
        model = gpt_hf.hf_model(model)
    if family(model) is None:
        raise ConfigError(f"--format gguf supports {FAMILIES}; this run's model is {type(model).__name__}")
    tmp.mkdir(parents=True)
    path = tmp / GGUF_NAME
    written, note = write_gguf(model, tokenizer, path, args.gguf_type or "f16", name)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp)  # beside the file, for tools that read the Hugging Face tokenizer
    return ([note] if note else []) + [check_gguf(path, written)]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No loading bars, and not peft's warning about a transformers attribute it reads (deprecated in 5)."""
    import transformers  # noqa: F401  (hf_transformers_progress switches the bars of an imported transformers)

    from rapidlite.observe.progress import hf_transformers_progress

    with hf_transformers_progress(False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def run(argv: Sequence[str]) -> int:
    from rapidlite.checkpoint.export import install, staging_dir

    args = build_parser().parse_args(list(argv))
    if args.format == "gguf" and args.dtype is not None:
        raise ConfigError("--dtype is for --format hf; a GGUF file's type is --gguf-type f32|f16|q8_0")
    if args.format == "hf" and args.gguf_type is not None:
        raise ConfigError("--gguf-type is for --format gguf; a Hugging Face export's is --dtype fp32|fp16|bf16")
    if args.format == "gguf" and args.adapter:
        raise ConfigError("--adapter: a GGUF file holds a whole model; export the adapter with --format hf")
    checkpoint = find_checkpoint(args.dir)
    out = Path(args.out)
    check_out(out, checkpoint, args.overwrite)
    settings = run_settings(checkpoint)
    if args.format == "gguf":
        from rapidlite.checkpoint.gguf_file import require_gguf

        require_gguf()  # before the model is built
    log: list[str] = []
    tmp = staging_dir(out)
    try:
        with _quiet():
            model = rebuild(checkpoint, settings, log)
            tokenizer = run_tokenizer(settings)
            out.parent.mkdir(parents=True, exist_ok=True)
            if args.format == "hf":
                log += export_hf_checked(model, settings, tokenizer, tmp, args)
            else:
                log += export_gguf_checked(model, tokenizer, tmp, args, checkpoint.run_dir.resolve().name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    install(tmp, out)
    for line in log:
        print(line, flush=True)
    what = "GGUF file " + str(out / GGUF_NAME) if args.format == "gguf" else f"Hugging Face model {out}"
    print(f"exported {checkpoint.path.name} of {checkpoint.run_dir} as the {what}", flush=True)
    return 0


def main(argv: Sequence[str]) -> int:
    """``rapidlite export ...`` (``rapidlite.cli.main`` runs it with rapidlite's error handling)."""
    return run(argv)
