"""TensorBoard: ``--report-to tensorboard`` or ``--tensorboard-dir DIR``.

Every record's finite numbers become scalars ``<split>/<name>`` at step ``iteration``, in event files under the
resolved directory (``--tensorboard-dir``, else ``--save DIR/tensorboard``, else TensorBoard's own
``runs/<date>_<host>``). The writer opens with the first record, so a run refused before it wrote nothing leaves
no directory. A resumed run appends to the same directory; there is no run id to keep. ``curves.png`` is stored
as an image.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rapidlite.observe.trackers.base import STEP, Tracker, numbers

DIR_UNDER_SAVE = "tensorboard"


def default_dir(save: str | None) -> str | None:
    """Where ``--report-to tensorboard`` writes without ``--tensorboard-dir``: beside the checkpoints, so that
    ``--load`` continues in the same directory; without ``--save``, TensorBoard's default (None)."""
    return os.path.join(save, DIR_UNDER_SAVE) if save else None


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writer: Any = None
        self._open = False

    def start(self, settings: Mapping[str, Any], resume_id: str | None) -> str:
        self._open = True
        return f"TensorBoard: tensorboard --logdir {self.cfg.tensorboard_dir or 'runs'}"

    def _summary_writer(self) -> Any:
        if self._writer is None and self._open:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.cfg.tensorboard_dir)
        return self._writer

    def log(self, record: Mapping[str, Any], prefix: str) -> None:
        writer = self._summary_writer()
        if writer is None:
            return
        step = record.get(STEP, 0)
        for key, value in numbers(record, prefix).items():
            writer.add_scalar(key, value, step)
        writer.flush()

    def log_file(self, path: str) -> None:
        """A PNG (``curves.png``) as an image; event files hold no other files."""
        writer = self._writer  # after the last record; a run that logged nothing has no curves either
        if writer is None or not path.endswith(".png"):
            return
        from matplotlib.image import imread

        writer.add_image(os.path.basename(path), imread(path)[..., :3], dataformats="HWC")
        writer.flush()

    def finish(self, exit_code: int, preempted: bool) -> None:
        writer, self._writer, self._open = self._writer, None, False
        if writer is not None:
            writer.close()
