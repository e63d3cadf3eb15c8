from rapidlite.trainer.base import BaseTrainer
from rapidlite.trainer.finetuner import Finetuner
from rapidlite.trainer.pretrainer import PreTrainer

__all__ = ["BaseTrainer", "Finetuner", "PreTrainer"]
