"""A loop of one's own under ``engine.compose``, stopping on a scheduler's signal through ``engine.preemption()``:
prints ``step N`` after each step and, when told to stop, writes ``SAVE_FILE`` with the step it stopped after."""

import os
import time

import torch

from rapidlite import RapidliteEngine

engine = RapidliteEngine()
torch.manual_seed(0)
model, optimizer, _ = engine.compose(model_obj=torch.nn.Linear(8, 1))
with engine.preemption() as watch:
    for step in range(1, 10_000):
        loss = model(torch.randn(4, 8, device=engine.device)).pow(2).mean()
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(0.05)
        if engine.rank == 0:
            print(f"step {step}", flush=True)
        if watch.stop():
            if engine.rank == 0:
                with open(os.environ["SAVE_FILE"], "w") as f:
                    f.write(str(step))
            break
