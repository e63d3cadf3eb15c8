"""Trains the pretraining example, but rank 1 fails in its second forward step: FAIL=user or FAIL=bug;
FAIL=first_attempt fails (as a bug) only before torchrun's first restart."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

from pretrain_custom_model import MyPreTrainer  # noqa: E402

from rapidlite import RapidliteEngine  # noqa: E402
from rapidlite.errors import DataError  # noqa: E402


class Failing(MyPreTrainer):
    calls = 0

    def run_forward_step(self, data_iterator, model):
        self.calls += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.engine.rank == 1 and self.calls == 2 and (os.environ["FAIL"] != "first_attempt" or first_attempt):
            if os.environ["FAIL"] == "user":
                raise DataError("--data-path shard-7.bin: truncated file; re-run the preprocessing")
            raise ValueError("boom in a forward step")
        return super().run_forward_step(data_iterator, model)


if __name__ == "__main__":
    Failing(engine=RapidliteEngine()).train()
