"""Callbacks and plugins that make runs keep what they did: post-step hooks, rollout samples, atomic checkpoints
(checked for non-finite weights, read back with weights_only=True), clean stops on SIGINT/SIGTERM
from the first moment of a run, and a CSV log that survives --resume and a full disk."""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch  # noqa: F401 (callbacks.torch: tests reach torch.save through it)
from lightning.fabric.loggers.csv_logs import _ExperimentWriter
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO

from composer import files


class AfterStep(L.Callback):
    """Runs the module's post-step bookkeeping (ahead of ModelCheckpoint, which Lightning runs last)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.after_step()


class StrictStop(L.Callback):
    """`composer run --strict`: a segment that trained on nothing (the module's `vacuous_error`, set by
    after_step at the segment's end) stops the run after this step, with this step's checkpoint written."""

    def __init__(self, ckpt_path: Path):
        self.ckpt_path = Path(ckpt_path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.vacuous_error and not trainer.should_stop:
            trainer.save_checkpoint(self.ckpt_path)
            trainer.should_stop = True


class SampleWriter(L.Callback):
    """After each step, before any checkpoint of it: the step's rollouts to samples.jsonl when the step is due
    (composer/runtime/samples.py `SampleLog`, the run's recorder). Only rank 0 writes; a failure is a warning."""

    def __init__(self, samples):
        self.samples = samples

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            self.samples.events = []
            return
        step = self.samples.step
        try:
            train = pl_module.segment_at(step).spec.train if step is not None else None
        except Exception:
            train = None
        self.samples.write_step(train, pl_module.total_steps - 1, pl_module.tokenizer, trainer.loggers)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file, then rename: a half-written checkpoint is never taken for a good one.

    Before writing, every weight must be finite (a checkpoint called "the last good one" must be good);
    a failed write (a full disk) removes its temporary file and keeps the previous checkpoint. Reading
    goes through `checkpoint.load`: weights_only=True, and a damaged file is a CheckpointError.
    """

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        from composer.runtime.checkpoint import first_non_finite, save
        from composer.backends.lightning.module import NonFiniteError

        bad = first_non_finite(checkpoint.get("state_dict", {}))
        if bad is not None:
            raise NonFiniteError(f"the weight {bad} is not finite after step {checkpoint.get('global_step')}; "
                                 "no checkpoint was written")
        save(checkpoint, path)  # a temporary file renamed; a full disk is a CheckpointError, the last one kept

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        from composer.runtime.checkpoint import load

        return load(path, map_location=map_location if map_location is not None else "cpu")


class StopRequested(Exception):
    """A signal arrived while the run was being set up inside trainer.fit: leave fit before any step."""


class GracefulStop(L.Callback):
    """SIGINT/SIGTERM: before training, stop at once; during training, finish the current step, write a
    checkpoint, stop. `install()` at the start of a run, `uninstall()` at its end."""

    def __init__(self, ckpt_path: Path):
        self.ckpt_path = Path(ckpt_path)
        self.requested: str | None = None
        self.deferred = False  # inside trainer.fit: only record the signal (Lightning turns a
        self.finishing = False  # KeyboardInterrupt there into exit status 1); after it: final evaluation
        self._old = {}
        self._handled = 0  # signals the Python handler ran for (the watchdog compares)
        self._watch = None  # (read fd, write fd, previous wakeup fd) while the watchdog runs

    STUCK_SECONDS = 5.0  # a signal the interpreter has not handled by then: the main thread waits in native code

    def _handler(self, signum, frame):
        self._handled += 1
        if self.requested or not self.deferred:  # a second signal, or not training yet: stop now
            self.requested = self.requested or signal.Signals(signum).name
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old.setdefault(sig, signal.signal(sig, self._handler))
            except ValueError:  # not the main thread
                pass
        if self._old and self._watch is None:
            self._start_watchdog()

    def _start_watchdog(self) -> None:
        """Python runs a signal handler only between bytecodes: a main thread blocked in native code (a
        rendezvous waiting for nodes that never come, a hung collective) would ignore SIGTERM forever. A
        thread sees each signal on the wakeup fd; one the handler has not taken within STUCK_SECONDS ends
        the process (nothing can be checkpointed from there anyway)."""
        import threading

        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            os.close(r)
            os.close(w)
            return
        self._watch = (r, w, old_fd)

        def watch():
            try:
                _watch_signals()
            finally:
                os.close(r)

        def _watch_signals():
            seen = 0
            while True:
                try:
                    data = os.read(r, 64)
                except OSError:
                    return
                if not data:
                    return
                for signum in data:
                    if signum not in (signal.SIGINT, signal.SIGTERM):
                        continue
                    seen += 1
                    deadline = time.monotonic() + self.STUCK_SECONDS
                    while time.monotonic() < deadline and self._handled < seen:
                        time.sleep(0.05)
                    if self._handled < seen and self._watch is not None:
                        name = signal.Signals(signum).name
                        os.write(2, f"\n{name}: the run was waiting in native code (a rendezvous with other nodes, "
                                    f"a collective) and did not stop; ended now\n".encode())
                        os._exit(128 + signum)

        threading.Thread(target=watch, name="composer-signal-watchdog", daemon=True).start()

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        if self._watch is not None:
            r, w, old_fd = self._watch
            self._watch = None
            try:
                signal.set_wakeup_fd(old_fd)
            except ValueError:
                pass
            os.close(w)  # the watchdog's read returns empty and it ends

    def on_train_start(self, trainer, pl_module) -> None:
        self.install()
        if self.requested:  # signalled while the run was being set up: no step is taken
            raise StopRequested(self.requested)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.requested:
            trainer.save_checkpoint(self.ckpt_path)
            trainer.should_stop = True
            pl_module.stopped_by = self.requested



def _step_cell(row: dict) -> int | None:
    """A metrics.csv row's step, None when the cell is not a whole number (an edited or damaged file)."""
    try:
        return int(str(row.get("step")).strip())
    except (TypeError, ValueError):
        return None

class _KeepingWriter(_ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv; on resume keep the rows before the resumed step."""

    def __init__(self, log_dir: str, keep_before: int | None):
        self.metrics, self.metrics_keys = [], []
        self._fs = get_filesystem(log_dir)
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self._fs.makedirs(log_dir, exist_ok=True)
        files.refuse_link(self.metrics_file_path)  # its rows are never read from, nor written to, another file
        if os.path.isfile(self.metrics_file_path):
            rows, keys = [], []
            if keep_before is not None:
                with open(self.metrics_file_path, newline="") as f:
                    reader = csv.DictReader(f)
                    keys = list(reader.fieldnames or [])
                    rows = [r for r in reader if (st := _step_cell(r)) is not None and st < keep_before]
            self.metrics_keys = keys if rows else []
            self._write_all(rows)

    def _write_all(self, rows: list[dict]) -> None:
        """Replace metrics.csv atomically (temp file, then rename); no rows: remove it."""
        if not rows:
            if os.path.isfile(self.metrics_file_path):
                os.remove(self.metrics_file_path)
            return
        with files.atomic_path(self.metrics_file_path) as tmp, open(tmp, "w", newline="") as f:  # a new name: no link
            w = csv.DictWriter(f, fieldnames=self.metrics_keys)
            w.writeheader()
            w.writerows(rows)

    def save(self) -> None:
        """Append the new rows; with new columns rewrite the file atomically. A failed append (a full disk)
        truncates the file back to its last whole row, so metrics.csv never ends in half a row."""
        if not self.metrics:
            return
        new_keys = self._record_new_keys()
        if new_keys or not os.path.isfile(self.metrics_file_path):
            rows = []
            if os.path.isfile(self.metrics_file_path):
                with open(self.metrics_file_path, newline="") as f:
                    rows = list(csv.DictReader(f))
            self._write_all(rows + self.metrics)
        else:
            buf = io.StringIO()
            csv.DictWriter(buf, fieldnames=self.metrics_keys).writerows(self.metrics)
            data = buf.getvalue().encode()
            with files.open_append(self.metrics_file_path) as f:  # never through a link
                size = f.tell()
                try:
                    f.write(data)
                    f.flush()
                except BaseException:
                    f.truncate(size)
                    raise
        self.metrics = []


def last_logged_step(out: Path) -> int | None:
    """The last training step metrics.csv holds (what an interrupted run trained and logged), None without one.
    Training rows carry `loss`; the final evaluation's row, logged at the step after the last, does not."""
    path = Path(out) / _ExperimentWriter.NAME_METRICS_FILE
    if not path.is_file():
        return None
    with contextlib.suppress(OSError, csv.Error), open(path, newline="") as f:
        steps = [st for r in csv.DictReader(f) if r.get("loss") and (st := _step_cell(r)) is not None]
        return max(steps) if steps else None
    return None


def keep_logged_steps(logger, upto: int) -> None:
    """A resumed run trains again the steps after its checkpoint; W&B and MLflow runs continue the interrupted
    ones, which already hold those steps (MLflow would record each twice, W&B refuses them with a warning): the
    logger skips metrics of steps <= `upto` and keeps the values the interrupted run logged, which an exact
    resume reproduces."""
    inner = logger.log_metrics

    def log_metrics(metrics, step=None):
        if step is None or step > upto:
            inner(metrics, step)

    logger.log_metrics = log_metrics


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


class StepLog(L.Callback):
    """What a run shows without a progress bar (no terminal, --no-progress): the rollout engine at the start,
    then one line every `every` steps and after the last one: step, loss, reward, pass@1 when evaluated,
    tokens/s and the time left. Rank 0 only; lines go to the `composer` logger (stderr)."""

    def __init__(self, every: int, total: int, show_steps: bool = True):
        self.every, self.total, self.show_steps = max(int(every), 1), int(total), show_steps
        self.t0, self.first = 0.0, 0

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0, self.first = time.perf_counter(), trainer.global_step
        if trainer.is_global_zero and pl_module.ctx is not None:
            engine = pl_module.ctx.engine
            name = getattr(engine, "name", None) or type(engine).__name__
            logging.getLogger("composer").info(f"rollout engine: {name} ({pl_module.ctx.spec.rollout.engine} asked)")
            if self.first:
                logging.getLogger("composer").info(f"resumed after step {self.first} of {self.total}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        done = trainer.global_step
        if not self.show_steps or not trainer.is_global_zero or (done % self.every and done != self.total):
            return
        logging.getLogger("composer").info(step_line(getattr(pl_module, "last_row", {}) or {}, done, self.total,
                                                     time.perf_counter() - self.t0, done - self.first))


def step_line(row: dict, done: int, total: int, elapsed: float, steps_here: int) -> str:
    """`step 3/10 | loss 0.1234 | reward 0.500 | pass@1 0.250 | 812 tok/s | ETA 0:01:05`."""
    parts = [f"step {done}/{total}"]
    for key, label, fmt in (("loss", "loss", "{:.4f}"), ("reward_mean", "reward", "{:.3f}"),
                            ("pass@1", "pass@1", "{:.3f}"), ("tokens_per_s", "tok/s", "{:.0f}")):
        if key in row:
            parts.append(f"{label} {fmt.format(row[key])}")
    if steps_here > 0 and elapsed > 0:
        left = (total - done) * elapsed / steps_here
        parts.append(f"ETA {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}")
    return " | ".join(parts)
