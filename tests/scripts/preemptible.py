"""The pretraining example, made easy to interrupt: STEP_SLEEP seconds per forward step (signals land mid-run);
CRASH_AT=N makes rank 1 (rank 0 on one process) fail in iteration N of the first attempt only, so a
--max-restarts run shows where the restarted attempt began. HANG_AT=N makes every rank hang in iteration N,
signals or not (a step that never ends), or with HANG_FOR=S fail after S seconds of it."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

from pretrain_custom_model import MyPreTrainer  # noqa: E402

from rapidlite import RapidliteEngine  # noqa: E402


class Preemptible(MyPreTrainer):
    def run_forward_step(self, data_iterator, model):
        time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
        if self.iteration + 1 == int(os.environ.get("HANG_AT", "0")):
            print(f"rank {self.engine.rank} hangs in iteration {self.iteration + 1}", flush=True)
            deadline = time.monotonic() + float(os.environ.get("HANG_FOR", "inf"))
            while time.monotonic() < deadline:
                time.sleep(0.1)
            raise RuntimeError("gave up hanging (HANG_FOR)")
        crash_at = int(os.environ.get("CRASH_AT", "0"))
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (
            crash_at
            and first_attempt
            and self.iteration + 1 == crash_at
            and self.engine.rank == self.engine.world_size - 1
        ):
            raise RuntimeError(f"crash in iteration {crash_at} (CRASH_AT)")
        return super().run_forward_step(data_iterator, model)


if __name__ == "__main__":
    Preemptible(engine=RapidliteEngine()).train()
