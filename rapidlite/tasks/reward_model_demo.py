"""Offline assets for ``rapidlite --task reward_model --demo``: the DPO demo's pairs on its model.

The pairs are the DPO demo's (``dpo_demo``): "reverse the words: red fox blue" answered by the correct reversal
(chosen) or a near miss (rejected: two neighbouring words swapped, or the words left in their order). The model is
the same tiny LLaMA after the same short supervised fine-tuning, which a reward model reads with a fresh one-output
head: it learns to score the correct reversal above the near miss, and validation ``accuracy`` (the share of
pairs scored right) and ``margin`` rise over the run. The assets are built once, in a cache directory of their own.
"""

from __future__ import annotations

import dataclasses

from rapidlite.tasks import dpo_demo
from rapidlite.tasks.demo import TIME_BUDGET

# fmt: off
# 8 epochs at 5e-4: validation accuracy 0.51 -> 0.76 and margin 0.003 -> 3.1 here (about 40 s on 2 cores); at 1e-3
# it ends near the same, at 3e-3 it stays under 0.6.
DEMO_FLAGS = {
    "time_budget": TIME_BUDGET, "micro_batch_size": 16, "lr": 5e-4, "epochs": 8, "seq_length": 64,
    "log_interval": 20, "eval_interval": 94, "weight_decay": 0.0, "clip_grad": 1.0,
}
# fmt: on

demo = dataclasses.replace(dpo_demo.demo, name="reward_model", flags=DEMO_FLAGS)
write_demo_assets = demo.write_assets
