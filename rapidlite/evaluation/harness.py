"""``--eval-harness FILE[,FILE...]``: benchmarks inside the run. At each evaluation the model in memory (adapters
applied, however the layout shards it) is scored on each jsonl file with ``rapidlite-eval``'s own code
(``rapidlite.evaluation.scoring``): multiple choice (``acc``, ``acc_norm``) or perplexity (``perplexity``,
``loss``), logged as ``harness/<file>/<metric>`` beside the validation metrics. Every rank takes part: the
scored batches are shared out over the data-parallel ranks, each running as many forwards as the others (a
sharded model's forwards are collectives). The files are read and checked when the flags are resolved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rapidlite.errors import ConfigError
from rapidlite.evaluation.data import MULTIPLE_CHOICE, REWARD, load_eval_data

REPORTED = {MULTIPLE_CHOICE: ("acc", "acc_norm"), "perplexity": ("perplexity", "loss")}


def load_harness(files: list[str]) -> list[tuple[str, str, list[Any]]]:
    """``(name, task, items)`` of each file; a reward file or two files of one name are one line."""
    out, names = [], set()
    for file in files:
        name = Path(file).stem
        if name in names:
            raise ConfigError(f"--eval-harness: two files are named {name}; their metrics would share a name")
        names.add(name)
        task, items = load_eval_data(file)
        if task == REWARD:
            raise ConfigError(
                f"--eval-harness {file}: preference pairs score a reward model (rapidlite-eval --task reward); "
                "give multiple-choice (context/endings/label) or text rows"
            )
        out.append((name, task, items))
    return out


def harness_metrics(trainer: Any) -> dict[str, float]:
    """The harness files' scores of ``trainer``'s model as it is now."""
    from rapidlite.evaluation.scoring import CausalLMScorer, evaluate, model_max_length

    engine, settings = trainer.engine, trainer.settings
    if trainer._harness is None:
        trainer._harness = load_harness(settings.task.eval_harness)
    bare = engine.strategy.module(trainer.model)
    tokenizer = trainer.tokenizer
    max_length = model_max_length(bare.config, tokenizer)
    scorer = CausalLMScorer(trainer.model, tokenizer, max_length, settings.batching.micro_batch_size, engine.device)
    scorer.chunked = settings.model.chunked_loss
    out: dict[str, float] = {}
    for name, task, items in trainer._harness:
        metrics = evaluate(scorer, task, items, engine.dist)
        out.update({f"harness/{name}/{key}": metrics[key] for key in REPORTED[task]})
    return out
