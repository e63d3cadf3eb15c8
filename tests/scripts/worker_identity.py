"""Records how this worker was started: its rank, torch's threads, and its process name (``$OUT/rankR.json``)."""

import json
import os
from pathlib import Path

import torch

from rapidlite import RapidliteEngine

engine = RapidliteEngine()
name = Path("/proc/self/comm").read_text().strip()
record = {"rank": engine.rank, "threads": torch.get_num_threads(), "name": name, "pid": os.getpid()}
Path(os.environ["OUT"], f"rank{engine.rank}.json").write_text(json.dumps(record))
