"""Offline assets for ``rapidlite --task kto --demo``: the DPO demo's pairs, unpaired, on its model.

The rows are the DPO demo's (``dpo_demo``): "reverse the words: red fox blue" with the correct reversal (chosen) and a
near miss (rejected). KTO reads each pair as two completions, the chosen one desirable and the rejected one not (TRL's
unpairing), and starts from the same tiny LLaMA after the same short supervised fine-tuning. The assets are built
once, in a cache directory of their own. Two epochs (about 30 s on 2 cores) take the validation
``rewards/margins`` from 0 to about 1 and ``exact_match`` of 100 greedy answers from 0.23 to about 0.35 (after a dip
to 0.01 at the first epoch's end, as the rejected near misses are pushed down with what they share).
"""

from __future__ import annotations

import dataclasses

from rapidlite.tasks import dpo_demo
from rapidlite.tasks.demo import TIME_BUDGET

# fmt: off
DEMO_FLAGS = {
    "time_budget": TIME_BUDGET, "micro_batch_size": 16, "lr": 1e-3, "epochs": 2, "seq_length": 64,
    "log_interval": 10, "weight_decay": 0.0, "clip_grad": 1.0, "eval_generate": 100, "beta": 0.1,
}
# fmt: on

demo = dataclasses.replace(dpo_demo.demo, name="kto", flags=DEMO_FLAGS)
write_demo_assets = demo.write_assets
