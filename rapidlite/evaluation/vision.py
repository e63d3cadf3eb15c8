"""``rapidlite-eval`` on rows with images: a vision-language model (``AutoModelForImageTextToText``) and its
processor score them as ``--task causal_lm`` trains on them (``rapidlite.data.vision``).

- Perplexity: chats with images in any layout the task reads; the loss and perplexity are over their assistant
  turns' tokens (the prompt and the image tokens are context).
- Multiple choice: the context (its ``<image>`` placeholders, else the row's images before it) is a user turn,
  rendered with the processor's chat template; each ending is scored as the assistant's answer, the tokens the
  template adds for it. ``acc`` and ``acc_norm`` as for text (``rapidlite.evaluation.scoring``).

Batches are shared out over the data-parallel ranks as the text scorer shares them, and the scores gathered.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from rapidlite.data.vision import VisionCollator, VisionEncoder, VisionSample, vision_sample
from rapidlite.errors import ConfigError, first_line
from rapidlite.evaluation.data import MultipleChoiceItem
from rapidlite.evaluation.scoring import choice_metrics, shared_out
from rapidlite.models.head import output_logps


class VisionScorer:
    """A vision-language model in eval mode, its processor, and where relative image paths start."""

    chunked = True

    def __init__(self, model: Any, processor: Any, base: str, max_length: int, batch_size: int, device: Any):
        self.model, self.processor, self.device = model.eval(), processor, device
        self.batch_size = batch_size
        tokenizer = processor.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.collate = VisionCollator(pad if pad is not None else 0)
        # No image limit beyond the processor's own resizing: a model is scored on the images as given.
        self.encoder = VisionEncoder(processor, max_length, base, 1, 2**62)

    @torch.no_grad()
    def _batch(self, samples: Sequence[VisionSample], rows: Sequence[int]) -> list[tuple[float, int]]:
        encoded = [self.encoder(s, r) for s, r in zip(samples, rows, strict=True)]
        batch = {k: v.to(self.device) for k, v in self.collate(encoded).items()}
        labels = batch.pop("labels")
        logps = output_logps(self.model, {**batch, "use_cache": False}, labels, shift=True, chunked=self.chunked)
        counts = (labels[:, 1:] != -100).sum(1)
        return list(zip(logps.sum(1).tolist(), counts.tolist(), strict=True))

    def scores(self, samples: Sequence[VisionSample], rows: Sequence[int], ctx: Any = None) -> list[tuple[float, int]]:
        """Each sample's summed log-probability of its assistant tokens and their count, in order, on every rank."""
        run = lambda batch: self._batch([samples[i] for i in batch], [rows[i] for i in batch])  # noqa: E731
        return [(logp, int(count)) for logp, count in shared_out(range(len(samples)), self.batch_size, run, 2, ctx)]


def perplexity(scorer: VisionScorer, samples: Sequence[VisionSample], ctx: Any = None) -> dict[str, Any]:
    """The assistant tokens' perplexity over the chats, with the mean loss, the token count and n."""
    scored = scorer.scores(samples, list(range(1, len(samples) + 1)), ctx)
    tokens = sum(n for _, n in scored)
    loss = -sum(lp for lp, _ in scored) / max(tokens, 1)
    return {"perplexity": math.exp(loss), "loss": loss, "tokens": tokens, "n": len(samples)}


def _question(item: MultipleChoiceItem, ending: str, number: int) -> VisionSample:
    row = {
        "messages": [{"role": "user", "content": item.context}, {"role": "assistant", "content": ending}],
        "images": list(item.images),
    }
    return vision_sample(row, number)


def multiple_choice(scorer: VisionScorer, items: Sequence[MultipleChoiceItem], ctx: Any = None) -> dict[str, Any]:
    """``choice_metrics`` of each ending scored as the assistant's answer to the context."""
    samples = [_question(item, e, n) for n, item in enumerate(items, 1) for e in item.endings]
    rows = [n for n, item in enumerate(items, 1) for _ in item.endings]
    return choice_metrics(items, [lp for lp, _ in scorer.scores(samples, rows, ctx)])


def evaluate(scorer: VisionScorer, task: str, items: Sequence[Any], ctx: Any = None) -> dict[str, Any]:
    """The metrics of ``task`` (multiple choice or perplexity) on image rows, equal on every rank."""
    from rapidlite.evaluation.data import MULTIPLE_CHOICE

    score = multiple_choice if task == MULTIPLE_CHOICE else perplexity
    return {"task": task, **score(scorer, items, ctx)}


def has_image_items(items: Sequence[Any]) -> bool:
    """Whether ``load_eval_data``'s items are image rows."""
    first = items[0] if items else None
    return isinstance(first, VisionSample) or (isinstance(first, MultipleChoiceItem) and bool(first.images))


def load_vision_scorer(
    model: str, data: str, max_length: int | None, batch_size: int, bf16: bool, device: Any
) -> VisionScorer:
    """The vision-language model of ``model`` with its processor; relative image paths start at ``data``'s
    directory."""
    from rapidlite.models.vision import load_processor, load_vision_model
    from rapidlite.observe.progress import hf_transformers_progress

    try:
        processor = load_processor(model)
        with hf_transformers_progress(True):
            net = load_vision_model(model, dtype=torch.bfloat16 if bf16 else torch.float32)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {model}: cannot load a vision-language model ({first_line(e)})") from None
    base = os.path.dirname(os.path.abspath(data))
    return VisionScorer(net.to(device), processor, base, max_length or 4096, batch_size, device)
