"""Callbacks and plugins that make runs keep what they did: post-step hooks, atomic checkpoints,
clean stops on SIGINT/SIGTERM, and a CSV log that survives --resume."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.loggers.csv_logs import _ExperimentWriter
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AfterStep(L.Callback):
    """Runs the module's post-step bookkeeping (ahead of ModelCheckpoint, which Lightning runs last)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.after_step()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file, then rename: a half-written checkpoint is never taken for a good one."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)


class GracefulStop(L.Callback):
    """SIGINT/SIGTERM: finish the current step, write a checkpoint, stop."""

    def __init__(self, ckpt_path: Path):
        self.ckpt_path = Path(ckpt_path)
        self.requested: str | None = None
        self._old = {}

    def _handler(self, signum, frame):
        if self.requested:  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def on_train_start(self, trainer, pl_module) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.requested:
            trainer.save_checkpoint(self.ckpt_path)
            trainer.should_stop = True
            pl_module.stopped_by = self.requested

    def on_train_end(self, trainer, pl_module) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class _KeepingWriter(_ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv; on resume keep the rows before the resumed step."""

    def __init__(self, log_dir: str, keep_before: int | None):
        self.metrics, self.metrics_keys = [], []
        self._fs = get_filesystem(log_dir)
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self._fs.makedirs(log_dir, exist_ok=True)
        if os.path.isfile(self.metrics_file_path):
            rows, keys = [], []
            if keep_before is not None:
                with open(self.metrics_file_path, newline="") as f:
                    reader = csv.DictReader(f)
                    keys = list(reader.fieldnames or [])
                    rows = [r for r in reader if r.get("step") not in (None, "") and int(r["step"]) < keep_before]
            os.remove(self.metrics_file_path)
            if rows:
                self.metrics_keys = keys
                with open(self.metrics_file_path, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=keys)
                    w.writeheader()
                    w.writerows(rows)


class RunCSVLogger(CSVLogger):
    """CSVLogger writing `metrics.csv` straight into the run folder, resumable."""

    def __init__(self, out: Path, keep_before: int | None = None):
        super().__init__(save_dir=str(out), name="", version="")
        self._keep_before = keep_before

    @property
    def log_dir(self) -> str:
        return self.root_dir

    def log_metrics(self, metrics, step=None) -> None:
        super().log_metrics(metrics, step)
        self.save()  # one row per step on disk: a killed run loses no logged step

    @property
    def experiment(self):
        if self._experiment is None:
            self._experiment = _KeepingWriter(self.log_dir, self._keep_before)
        return self._experiment
