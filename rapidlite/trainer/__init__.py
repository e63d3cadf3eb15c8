from rapidlite.trainer.base import BaseTrainer
from rapidlite.trainer.finetuner import Finetuner
from rapidlite.trainer.pretrainer import PreTrainer

Pretrainer = PreTrainer  # Rapidformer spells it so in places

__all__ = ["BaseTrainer", "Finetuner", "PreTrainer", "Pretrainer"]
