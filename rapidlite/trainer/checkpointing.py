"""The trainer's checkpoints: what it saves besides the tensors (its position, the schedule, the loss scaler, the
trackers' run ids, the run's settings as ``config.yaml``), when a save is refused (weights that are NaN/inf), what a
resume restores and when (the RNG streams last), ``--keep-last`` and ``--overwrite``.

The writing and reading themselves are the strategy's (``rapidlite.strategies``), over ``rapidlite.checkpoint``.
"""

from __future__ import annotations

from typing import Any

import torch

from rapidlite.checkpoint import layout, rng, selection
from rapidlite.config import files as config_file
from rapidlite.config.parser import build_parser
from rapidlite.errors import TrainingDiverged
from rapidlite.runtime import distributed


class Checkpointing:
    """Saves and resumes a ``BaseTrainer`` (``trainer``): its model, optimizer and scheduler, its ``state_dict``
    and its monitor's."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.settings = trainer.settings
        self.ckpt = trainer.settings.checkpoint
        self.engine = trainer.engine
        self.logger = trainer.logger
        self.last_saved = -1  # the iteration of the last checkpoint this run wrote or resumed
        self._resume_rng: dict[str, Any] | None = None
        self._saved_config: str | None = None  # iter_N/config.yaml: the settings, loadable with --config
        self._cleared = False  # --overwrite: rank 0 removed the earlier run (see clear_earlier_run)

    @property
    def resuming(self) -> bool:
        """Whether --load names a rapidlite checkpoint to resume (not a Hugging Face model to start from)."""
        return self.ckpt.load is not None and not self.ckpt.load_is_pretrained_model

    def prepare(self) -> None:
        """Before the model is built: a resume's strategy may need the checkpoint first (DeepSpeed's weights)."""
        ckpt = self.settings.checkpoint
        if ckpt.load_is_pretrained_model:
            self.logger.info(
                f"--load {ckpt.load} holds a Hugging Face model, not a rapidlite checkpoint: the model provider "
                "loads it (from_pretrained(args.load)); nothing is resumed"
            )
        if self.resuming:
            self.engine.strategy.prepare_resume(self.ckpt.load)

    def clear_earlier_run(self) -> None:
        """``--overwrite`` (rank 0): the earlier run's checkpoints and outputs in --save go, right before this run
        writes its first record or checkpoint there: a run refused before that (at its first step) keeps it."""
        if self.ckpt.overwrite_save and not self._cleared:
            self._cleared = True
            removed = layout.clear_run(self.ckpt.save)
            self.logger.info(f"--overwrite: removed the earlier run in {self.ckpt.save} ({removed})")

    def keep_settings(self) -> None:
        """Rank 0, with --save: the run's settings, written into every checkpoint as ``config.yaml``."""
        if self.ckpt.save is not None:
            parser = build_parser(self.engine.extra_args_provider)
            header = "this run's settings: 'rapidlite --config config.yaml' repeats them (flags given with it win)"
            self._saved_config = config_file.dump(self.trainer.args, parser, header)

    # ------------------------------------------------------------------ save
    def save(self) -> None:
        """Every rank writes its shards (a collective); rank 0 the trainer, schedule and scaler state."""
        trainer, ckpt = self.trainer, self.settings.checkpoint
        if ckpt.save is None or self.last_saved == trainer.iteration:
            return
        if not self._weights_finite():
            raise TrainingDiverged(
                f"iteration {trainer.iteration}: the weights hold NaN/inf, so no checkpoint is written; "
                f"{self.last_good()} (lower --lr, clip gradients with --clip-grad)"
            )
        # This launch's first checkpoint (--overwrite never resumes): no rank's shard lands before the removal.
        if self.ckpt.overwrite_save and self.last_saved < 0:
            if self.engine.is_main_process:
                self.clear_earlier_run()
            self.engine.barrier()
        optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
        # A run resumed from here continues the trackers' runs (W&B, MLflow).
        state = {
            "trainer": trainer.state_dict(),
            "skipped_steps": optimizer.skipped_steps,
            **trainer.monitor.state_dict(),
        }
        if scheduler is not None and hasattr(scheduler, "state_dict"):
            state["lr_scheduler"] = scheduler.state_dict()
        if optimizer.loss_scaler is not None:
            state["loss_scaler"] = optimizer.loss_scaler.state_dict()
        files = {config_file.FILE_NAME: self._saved_config} if self._saved_config is not None else None
        path = self.engine.strategy.save_checkpoint(
            ckpt.save,
            trainer.iteration,
            trainer.model,
            optimizer,
            state,
            not ckpt.no_save_optim,
            files,
        )
        self.logger.info(f"saved checkpoint {path}")
        self.last_saved = trainer.iteration
        if ckpt.keep_last:
            for old in selection.prune_checkpoints(ckpt.save, ckpt.keep_last, trainer.iteration):
                self.logger.info(f"--keep-last {ckpt.keep_last}: deleted {old}")

    def _weights_finite(self) -> bool:
        """Whether every rank's weights are finite (checked before each save: a cheap pass next to the write)."""
        module = self.engine.strategy.module(self.trainer.model)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]
        checks = [torch.isfinite(t).all() for t in local if t.is_floating_point() and t.numel()]
        if not checks:
            return True
        ok = torch.stack([c.to(checks[0].device) for c in checks]).all().float().reshape(1)
        return bool(distributed.all_reduce_world(1 - ok, op="max").item() == 0)

    def last_good(self) -> str:
        """Where the run's last good checkpoint is, for the line that stops a diverged run."""
        if self.ckpt.save is None:
            return "no --save directory"
        if self.last_saved >= 0:
            return f"the last checkpoint is iteration {self.last_saved} in {self.ckpt.save}"
        return f"no checkpoint was written to {self.ckpt.save}"

    # ------------------------------------------------------------------ resume
    def load(self) -> None:
        """--load's checkpoint into the composed model and optimizer; the trainer, schedule, scaler and monitor
        continue where it was (with --finetune, only the weights load)."""
        trainer, ckpt = self.trainer, self.settings.checkpoint
        optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
        iteration, state = self.engine.strategy.load_checkpoint(
            ckpt.load,
            trainer.model,
            optimizer,
            with_optimizer=not (ckpt.finetune or ckpt.no_load_optim),
            weights_only=ckpt.finetune,
        )
        if ckpt.finetune:
            self.logger.info(f"loaded weights of iteration {iteration} from {ckpt.load}; starting at iteration 0")
            return
        trainer.monitor.load_state_dict(state)
        trainer.load_state_dict(state["trainer"])
        self.last_saved = trainer.iteration
        if state["optimizer_loaded"]:
            optimizer.skipped_steps = int(state.get("skipped_steps", 0))
            if "loss_scaler" in state and optimizer.loss_scaler is not None:
                optimizer.loss_scaler.load_state_dict(state["loss_scaler"])
        if "lr_scheduler" in state and scheduler is not None:
            scheduler.load_state_dict(state["lr_scheduler"])
        elif scheduler is not None and hasattr(scheduler, "num_steps"):
            scheduler.num_steps = trainer.iteration  # keep the schedule where the run was
            scheduler.step(0)
        if not ckpt.no_load_rng:
            self._resume_rng = state["rng"]
        self.logger.info(f"resumed from {ckpt.load} at iteration {trainer.iteration}")

    def restore_rng(self) -> None:
        """Right before the first step: the resumed RNG streams, restored last, so nothing built after loading
        (data iterators, workers) shifts them."""
        if self._resume_rng is not None:
            rng.set_rng_state(self._resume_rng)
            self._resume_rng = None
