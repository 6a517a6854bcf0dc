"""`composer run`: build the Lightning Trainer around the module, run, and write what a run keeps."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import shutil
import stat
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from composer import files
from composer.runtime import samples as sample_files
from composer.runtime import checkpoint as ckpt_format
from composer.backends.lightning.callbacks import (AfterStep, AtomicCheckpointIO, GracefulStop, RunCSVLogger, StrictStop,
                                                   SampleWriter, StepLog, StopRequested, keep_logged_steps,
                                                   last_logged_step)
from composer.runtime.checkpoint import CheckpointError
from composer.backends.lightning.module import ComposerModule, NonFiniteError
from composer.runtime.export import MODEL_DIR, save_policy
from composer.runtime.paths import check_run_inputs
from composer.plan.compile import compile_plan
from composer.runtime.example_prompts import machine_notes
from composer.stops import for_spec
from composer.runtime.evaluate import prepare_records
from composer.runtime.binding import bind_task, check_task_lengths, context_length
from composer.checks.data import generation_room
from composer.runtime.models import load_model, load_tokenizer, merged, prepare_policy
from composer.runtime.samples import SampleLog

log = logging.getLogger("composer")


class Interrupted(RuntimeError):
    pass


class RunError(RuntimeError):
    """A run that cannot start or continue as asked: the message says why and what to do."""


def default_out(name: str) -> Path:
    base = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():  # two runs started in the same second get folders of their own
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def last_checkpoint(out: Path) -> Path | None:
    """The last complete checkpoint: checkpoints are written to a temp file and renamed, so a file here is whole."""
    ckpt = out / "checkpoints" / "last.ckpt"
    return ckpt if ckpt.exists() or ckpt.is_symlink() else None


LOCK = ".lock"


def _open_lock(path: Path):
    """The run folder's lock file, never through a symbolic link (that would truncate the file it points to)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(e.errno, f"its {LOCK} is a symbolic link (not followed; remove it)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"its {LOCK} is not a regular file (remove it)")
    return os.fdopen(fd, "r+")


@contextlib.contextmanager
def claim_folder(out: Path, resume: bool):
    """Own the run folder for the run's duration: created if needed, locked against a second run, and
    refused when it already holds files and this is not a resume (a finished run's files are never
    replaced). A fresh folder that a failed run leaves without a checkpoint is emptied again."""
    out = Path(out)
    try:
        existed = out.exists()
        out.mkdir(parents=True, exist_ok=True)
        if not out.is_dir():
            raise NotADirectoryError(20, "not a directory")
        lock = _open_lock(out / LOCK)
    except (OSError, ValueError) as e:  # /proc, /sys, a file, a name too long, a NUL byte, a .lock link
        raise RunError(f"{out}: cannot use it as the run folder: {getattr(e, 'strerror', None) or e}\n"
                       "    hint: give --out a writable folder path") from None
    try:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            owner = (lock.read().split() or ["?"])[0]
            raise RunError(f"{out}: another run (pid {owner}) is using this folder; wait for it to finish, or "
                           "choose another --out") from None
        token = secrets.token_hex(16)  # proves to the ranks rank 0 starts that this run owns the folder
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()} {token}")
        lock.flush()
        os.environ[RUN_ENV + "_TOKEN"] = token
        held = sorted(p.name for p in out.iterdir() if p.name != LOCK)
        if held and not resume:
            shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
            raise RunError(f"{out}: the folder already holds files ({shown}); a new run would replace them\n"
                           f"    hint: continue that run with `composer run --resume {out}`, or choose another --out")
        links = files.links_in(out, skip=("wandb",))  # a run writes only inside its folder, never through a link
        if links:
            shown = ", ".join(links[:5]) + (", ..." if len(links) > 5 else "")
            raise RunError(f"{out}: the run folder holds symbolic links ({shown}); a run never writes through "
                           "one (the files they point to would change)\n    hint: remove them (rm PATH; a "
                           "folder linked elsewhere: move it back) and resume")
        fresh = not held
        try:
            yield out
        except BaseException:
            if fresh and last_checkpoint(out) is None:  # nothing to resume: leave no half-made run behind
                for p in out.iterdir():
                    if p.name != LOCK:
                        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                if not existed:
                    shutil.rmtree(out, ignore_errors=True)
            raise
    finally:
        lock.close()


def changed_data(validated, state: dict) -> list[str]:
    """A line per data file of the spec whose contents differ from the fingerprint the checkpoint keeps."""
    composer = state.get("composer") if isinstance(state.get("composer"), dict) else {}
    return ckpt_format.data_changes(composer.get("data_files"), ckpt_format.data_fingerprints(validated))


def _override(path: str, value) -> str:
    import shlex

    return shlex.quote(f"{path}={value if isinstance(value, str) else json.dumps(value)}")


def _asked(changes: list) -> str:
    """The resumable settings a resume asked to change (train.steps=200, ...) as the overrides that say them,
    each with a leading space ('' for none)."""
    return "".join(" " + _override(p, new) for p, _old, new in changes
                   if p in ckpt_format.RESUMABLE and isinstance(new, (str, int, float, bool)))


def resume_hint(out: Path, changes: list, spec_path: str | None = None) -> str:
    """The exact command that resumes the run in `out` with the resumable settings this command asked for
    (`changes`: (path, checkpoint's value, asked value)): the run's own spec, which the folder keeps with its
    overrides (spec.yaml); without that file, SPEC with the overrides that make it the run's spec, when plain
    `path=value` overrides can say them."""
    asked = _asked(changes)
    may = f"only {', '.join(ckpt_format.RESUMABLE)} may change on resume"
    if (Path(out) / "spec.yaml").is_file() or spec_path is None:
        return (f"    hint: resume with the run's own spec, which {Path(out) / 'spec.yaml'} keeps with its overrides: "
                f"`composer run --resume {out}{asked}` ({may}). For another spec, start a "
                f"new run (`composer run SPEC --out NEW`)")
    back = [(p, old) for p, old, _new in changes if p not in ckpt_format.RESUMABLE]
    if all("[" not in p and (old is None or isinstance(old, (str, int, float, bool))) for p, old in back):
        fixes = " ".join(_override(p, old) for p, old in back)
        return (f"    hint: {out} has no spec.yaml; resume with {spec_path} set back to the run's values: `composer run "
                f"{spec_path} --resume {out} {fixes}{asked}` ({may})")
    return (f"    hint: {spec_path} is not the spec of this run, and {out} has no spec.yaml to resume with; give the "
            f"run's own spec, or start a new run (`composer run SPEC --out NEW`)")


def check_resume(validated, out: Path, allow_changed_data: bool = False,
                 spec_path: str | None = None) -> tuple[dict, list]:
    """The checkpoint to resume from, read safely, and the resumable settings that change (path, old, new).

    Another spec, or an override of anything but `checkpoint.RESUMABLE`, is refused with what differs:
    resuming would silently continue another experiment from this one's weights. So is a data file whose
    contents changed under the same path since the checkpoint (its size and sha256 are kept in it), unless
    `allow_changed_data` (`--allow-changed-data`). `spec_path`: the SPEC the command named, for the hint.
    """
    ckpt = last_checkpoint(out)
    if ckpt is None:
        raise RunError(f"{out}: no checkpoint to resume from (looked for checkpoints/last.ckpt)")
    state = ckpt_format.load(ckpt, mmap=True)
    if "composer" in state and not isinstance(state["composer"], dict):
        raise ckpt_format.damaged(ckpt, "composer", "expected a mapping of the run's state, found "
                                                    f"{type(state['composer']).__name__}")
    record = (state.get("composer") or {}).get("spec")
    if not isinstance(record, dict) or "json" not in record:
        raise RunError(f"{ckpt}: the checkpoint does not record its spec (written by an older version); it "
                       "cannot be checked against this one, so it is not resumed")
    try:
        changes = ckpt_format.spec_changes(record, validated)
    except (TypeError, ValueError, AttributeError):  # a record whose json is not the JSON of a spec
        raise RunError(f"{ckpt}: the checkpoint's spec record is damaged, so it cannot be checked against this "
                       "spec; it is not resumed\n    hint: restore the run's own checkpoints/last.ckpt, or start "
                       "a new run") from None
    fixed = [c for c in changes if c[0] not in ckpt_format.RESUMABLE]
    if fixed:
        raise RunError(f"{out}: the checkpoint was trained with another spec; resuming it with this one would "
                       f"continue a different experiment. What differs (checkpoint -> now):\n"
                       f"{ckpt_format.describe_changes(fixed)}\n{resume_hint(out, changes, spec_path)}")
    check_counters(state, out, ckpt, record)
    data = changed_data(validated, state)
    if data and not allow_changed_data:
        lines = "\n".join(data)
        raise RunError(f"{ckpt}: the data changed since this checkpoint was written:\n{lines}\nresuming would train "
                       f"the remaining steps on other data than the first ones (the same path, other contents)\n"
                       f"    hint: restore the data as it was; or, to continue on the new contents, add "
                       f"--allow-changed-data (`composer run --resume {out}{_asked(changes)} --allow-changed-data`)")
    return state, changes


def _loop_steps(state: dict) -> int | None:
    """The optimizer steps Lightning's loop counters in a checkpoint hold (what it resumes from), None when
    they are missing or not counts. `global_step` is written from the same counters, so the two always agree
    in a checkpoint the run wrote."""
    try:
        loop = state["loops"]["fit_loop"]
        auto = loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]["completed"]
        manual = loop["epoch_loop.manual_optimization.optim_step_progress"]["total"]["completed"]
    except (KeyError, TypeError, IndexError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (auto, manual)):
        return None
    return auto + manual


def read_metrics_rows(out: Path) -> list[dict] | None:
    """The rows of the run folder's metrics.csv (None without one); a file that is not CSV text is a RunError
    that names it (was: UnicodeDecodeError from deep inside the CSV logger, after the folder was claimed)."""
    path = Path(out) / "metrics.csv"
    if not path.exists() and not path.is_symlink():
        return None
    hint = ("    hint: restore a good copy of the file; or move it away to resume without the earlier rows "
            "(the curves in report.md then start at the resumed step)")
    if not path.is_file():
        raise RunError(f"{path}: not a regular file, so the run's logged rows cannot be kept\n{hint}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise RunError(f"{path}: cannot be read ({e.strerror or e})\n{hint}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunError(f"{path}: not the run's metrics (not UTF-8 text: byte {e.start} is 0x{raw[e.start]:02x}); "
                       f"resuming would append to a damaged file, so nothing was changed\n{hint}") from None
    if "\x00" in text:
        raise RunError(f"{path}: not the run's metrics (it holds NUL bytes); nothing was changed\n{hint}")
    import csv
    import io

    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        rows = list(reader)
    except csv.Error as e:
        raise RunError(f"{path}: not readable as CSV ({e}); nothing was changed\n{hint}") from None
    if rows and "step" not in (reader.fieldnames or []):
        raise RunError(f"{path}: its header has no `step` column, so it is not the run's metrics; nothing was "
                       f"changed\n{hint}")
    return rows


def check_counters(state: dict, out: Path, ckpt: Path, record: dict) -> None:
    """Refuse a checkpoint whose step counters disagree with each other or with the run folder's metrics.csv:
    a resume cuts metrics.csv, samples.jsonl and eval_samples.jsonl back to the checkpoint's step, so a
    tampered or foreign `global_step` would delete rows the run logged. Nothing is changed when refused."""
    step = state.get("global_step")
    fix = (f"    hint: restore the run's own checkpoints/last.ckpt, or start a new run (`composer run SPEC --out "
           f"NEW`); nothing in {out} was changed")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise RunError(f"{ckpt}: the checkpoint's global_step is {step!r}, not a step count\n{fix}")
    counted = _loop_steps(state)
    if counted is None:
        raise RunError(f"{ckpt}: the checkpoint's loop counters (loops.fit_loop) are missing or damaged, so "
                       f"where it resumes cannot be checked\n{fix}")
    if counted != step:
        raise RunError(f"{ckpt}: the checkpoint's counters disagree: global_step {step}, but its loop counters "
                       f"hold {counted} optimizer steps (an edited or damaged checkpoint); resuming would cut the "
                       f"run folder's logs back to step {step}\n{fix}")
    rows = read_metrics_rows(out)
    if not rows:
        return
    from composer.backends.lightning.callbacks import _step_cell

    trained = [st for r in rows if r.get("loss") and (st := _step_cell(r)) is not None]
    if not trained:
        return
    last = max(trained)  # metrics.csv numbers a step's row from 0: the row of step N (1-based) says N - 1
    try:
        every = int(json.loads(record["json"])["train"]["checkpoint_every"])
    except (KeyError, TypeError, ValueError):
        every = 1
    # the row of the checkpoint's own step is written just after the checkpoint: a kill between may lose it
    if last < step - 2:
        raise RunError(f"{ckpt}: the checkpoint is at step {step}, but {out / 'metrics.csv'} logged only {last + 1} "
                       f"step(s): the checkpoint is not this run folder's (or metrics.csv was cut)\n{fix}")
    if last + 1 - step > max(every, 1):
        raise RunError(f"{ckpt}: the checkpoint is at step {step}, but {out / 'metrics.csv'} logged {last + 1} "
                       f"steps, more than one checkpoint interval (train.checkpoint_every {every}) past it: a later "
                       f"checkpoint was written, so this one is not the run's last; resuming from it would delete "
                       f"the {last + 1 - step} later step(s)' rows\n{fix}")


def expected_state(module, callbacks) -> ckpt_format.Expected:
    """What this run restores a checkpoint into (checkpoint.check_state checks every field against it): the
    policy's weight names and shapes, fresh states of its optimizer, scheduler and callbacks, and the loops of
    a Trainer that never runs (its progress counters' structure)."""
    import warnings

    from composer.backends.lightning.module import _needs_initial
    from composer.runtime.models import has_adapter

    policy = module.policy
    configured = module.configure_optimizers()
    with warnings.catch_warnings():  # e.g. "GPU available but not used": this Trainer never runs
        warnings.simplefilter("ignore")
        probe = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)
    loops = {name: getattr(probe, name).state_dict() for name in ("fit_loop", "validate_loop", "test_loop",
                                                                   "predict_loop")}
    return ckpt_format.Expected(
        weights={k: tuple(v.shape) for k, v in policy.state_dict().items()},
        params=[tuple(p.shape) for p in policy.parameters()],
        optimizer=configured["optimizer"].state_dict(),
        scheduler=configured["lr_scheduler"]["scheduler"].state_dict(),
        loops=loops, callbacks={cb.state_key: cb.state_dict() for cb in callbacks},
        segments=[s.name for s in module.segments],
        vocab=policy.get_input_embeddings().weight.shape[0],
        trainable=sum(1 for p in policy.parameters() if p.requires_grad),
        initial=(lambda: {k: tuple(v.shape) for k, v in merged(policy).state_dict().items()})
        if has_adapter(policy) else None,
        needs_initial=any(_needs_initial(s.spec) for s in module.segments),
        sharded=module.validated.spec.train.strategy == "fsdp")


def check_launcher(num_nodes: int) -> None:
    """More than one node needs a launcher that starts the other nodes; without one Lightning waits forever."""
    if num_nodes <= 1:
        return
    from lightning.fabric.plugins import environments as envs

    detected = []
    for name in ("SLURMEnvironment", "TorchElasticEnvironment", "KubeflowEnvironment", "LSFEnvironment",
                 "MPIEnvironment"):
        env = getattr(envs, name, None)
        try:
            detected += [name] if env is not None and env.detect() else []
        except Exception:  # an environment whose optional package is missing (mpi4py)
            pass
    if detected:
        return
    if "NODE_RANK" in os.environ and "MASTER_ADDR" in os.environ:  # started by hand on each node: say what it waits for
        import sys

        sys.stderr.write(f"train.num_nodes {num_nodes}: node {os.environ['NODE_RANK']} waits for the other nodes at "
                         f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '?')} (SIGTERM or Ctrl-C "
                         "stops it)\n")
        return
    raise RunError(f"train.num_nodes is {num_nodes}, but no multi-node launcher started this process (no SLURM, "
                   "torchrun/torchelastic, Kubeflow, LSF or MPI environment, and NODE_RANK/MASTER_ADDR unset); "
                   "the run would wait forever for the other nodes.\n    hint: launch it on each node with one of "
                   "those, or set train.num_nodes=1 on one machine")


RUN_ENV = "COMPOSER_RUN_DIR"  # set by rank 0 for the processes Lightning starts for the other ranks


def launched_child() -> dict | None:
    """{out, resume, rank} when this process is another rank of a run that rank 0 owns (started by Lightning's
    launcher, which passes rank 0's environment on, or by torchrun/SLURM with RANK > 0), else None."""
    try:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)
    except ValueError:
        return None
    if RUN_ENV not in os.environ or not (rank > 0 or "LOCAL_RANK" in os.environ):
        return None
    out = os.environ[RUN_ENV]
    if rank <= 0 or not _owned_by_parent(Path(out), os.environ.get(RUN_ENV + "_TOKEN", "")):
        return None  # not started by the run that holds that folder: an ordinary run (its own --out and lock)
    return {"out": out, "resume": os.environ.get(RUN_ENV + "_RESUME") == "1", "rank": rank}


def _owned_by_parent(out: Path, token: str) -> bool:
    """The folder's lock is held right now by this process's parent, which wrote `token` into it: the
    environment alone (COMPOSER_RUN_DIR and LOCAL_RANK set by hand) never hands over another run's folder."""
    if not token:
        return False
    try:
        fd = os.open(out / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        pid, _, written = os.read(fd, 200).decode("ascii", "replace").partition(" ")
        if not secrets.compare_digest(written.strip(), token) or pid.strip() != str(os.getppid()):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True  # held (by rank 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def train(validated, out: Path, resume: bool = False, progress: bool = True, final_eval=None, recorder=None,
          strict: bool = False, allow_changed_data: bool = False, on_checked=None) -> dict:
    """Run a validated spec on the Lightning backend: the compiled Plan's segments. Returns the final metrics.

    `final_eval(ctx, policy)`, when given, runs on the trained policy before the report is written;
    `recorder(kind, **data)` receives events of what ran (composer/runtime/context.py `record`).
    SIGINT/SIGTERM stop the run from its first moment: before training with `Interrupted` at once, during
    training after the current step and a checkpoint.
    `strict`: a segment that trained on nothing (composer/runtime/vacuous.py; always a warning) is a RunError
    after that segment's last step, whose checkpoint is kept.
    `allow_changed_data` (`--allow-changed-data`): resume although a data file changed since the checkpoint.
    `on_checked()`, when given, runs once every check of the spec, data and checkpoint has passed, before
    anything in the run folder changes (the CLI writes a resumed run's new spec.yaml there).
    """
    stop = GracefulStop(out / "checkpoints" / "last.ckpt")
    stop.install()
    try:
        return _train(validated, out, resume, progress, final_eval, stop, recorder, strict, allow_changed_data,
                      on_checked)
    except KeyboardInterrupt:
        where = "during the final evaluation" if stop.finishing else "before training"
        raise Interrupted(f"{stop.requested or 'SIGINT'}: stopped {where}; "
                          + (f"continue with --resume {out}" if last_checkpoint(out) else "nothing was trained")) from None
    finally:
        stop.uninstall()


def _train(validated, out: Path, resume: bool, progress: bool, final_eval, stop: GracefulStop, recorder,
           strict: bool = False, allow_changed_data: bool = False, on_checked=None) -> dict:
    spec = validated.spec
    # the bar only where it draws: on a pipe or a file (CI, nohup, `2> log`) Rich would dump its last frame
    # at the end of the output; there the step lines (StepLog) say the same
    progress = progress and _tty()
    check_run_inputs(validated)  # every model, tokenizer and data path, and the loggers' packages: nothing written yet
    quiet_libraries()
    check_launcher(spec.train.num_nodes)
    torch.manual_seed(spec.train.seed)
    # tiny models are bound by per-op overhead: on a small machine extra threads only contend
    cores = os.cpu_count() or 1
    torch.set_num_threads(int(os.environ.get("COMPOSER_THREADS", 1 if cores <= 2 else min(cores, 8))))
    child = launched_child() is not None  # another rank: rank 0 writes every file of the run folder
    out.mkdir(parents=True, exist_ok=True)
    if not child:
        (out / "checkpoints" / "last.ckpt.tmp").unlink(missing_ok=True)  # a write a kill cut short: garbage
        os.environ[RUN_ENV], os.environ[RUN_ENV + "_RESUME"] = str(out), "1" if resume else "0"
    state = check_resume(validated, out, allow_changed_data)[0] if resume else None
    plan = {**compile_plan(validated, "lightning"), **machine_notes(validated)}
    task = bind_task(spec)
    policy_name = spec.policy.model or "toy:student"
    trust = spec.policy.trust_remote_code
    tokenizer = load_tokenizer(spec.policy.tokenizer or policy_name, trust_remote_code=trust)
    stops = for_spec(tokenizer, spec)  # every engine and target reads these (composer/stops.py)
    policy = prepare_policy(load_model(policy_name, spec.policy.dtype, trust_remote_code=trust), spec.policy)
    check_task_lengths(task, tokenizer, context_length(policy), spec.data.on_bad_row, spec.data.prompt_field)
    budget = min(spec.rollout.max_new_tokens, task.max_new_tokens or spec.rollout.max_new_tokens)  # the toy's cap
    env = spec.rollout.environment  # an episode's response also holds the environment's answers
    room = generation_room(task, tokenizer, context_length(policy), budget, env.extra_tokens() if env else 0)
    from composer.registry import VERIFIERS

    for name in sorted({getattr(s, "verifier", "") for seg in validated.segments for s in seg.spec.sources.values()}):
        if name in VERIFIERS:  # fail closed before any training: e.g. code never runs outside the sandbox
            VERIFIERS[name].run_preflight()
    samples = SampleLog(out, chain=recorder)  # the run's recorder: keeps rollouts for samples.jsonl
    module = ComposerModule(plan, task, tokenizer, policy, samples, validated)
    module.start_metrics = {"skipped_rows": float(getattr(task, "skipped_rows", 0))}
    module.strict = strict
    module.data_files = ckpt_format.data_fingerprints(validated)  # kept in every checkpoint (--resume compares)
    t = spec.train
    ckpt = last_checkpoint(out) if resume else None
    resumed_at = None
    callbacks = [AfterStep(), StrictStop(out / "checkpoints" / "last.ckpt"), SampleWriter(samples), stop,
                 ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=t.checkpoint_every,
                                 save_last=True, save_top_k=0, save_on_train_epoch_end=False,
                                 enable_version_counter=False)]
    if state is not None:  # every field checked before anything is restored or any file of the folder changes
        ckpt_format.check_fits(state["state_dict"], module, ckpt)
        if not child:  # rank 0 checks before it starts the other ranks (they read the same file)
            ckpt_format.check_state(state, ckpt, expected_state(module, callbacks))
        resumed_at = int(state["global_step"])
        del state
    if not child:  # the run folder changes from here on
        if on_checked is not None:
            on_checked()
        files.write_text(out / "plan.json", json.dumps(plan, indent=2, default=str))
    if _rank_zero():
        sample_files.prepare(out, resumed_at)  # a resumed run trains its later steps again: drop their rows
        prepare_records(out, resumed_at)
    if progress:
        callbacks.append(_progress_bar())
    if not child:
        console_log()
        log.info(f"run folder: {out}")
        log.info(f"stop tokens: {stops.describe()}")
        if room:  # prompts + rollout.max_new_tokens past the policy's context (composer/checks/data.py)
            log.warning(room)
        # a progress bar only draws on a terminal: elsewhere (CI, nohup, --no-progress) one line per log_every steps
        callbacks.append(StepLog(t.log_every, validated.total_steps, show_steps=not (progress and _tty())))
    loggers = build_loggers(validated, out, resumed_at) if not child else []
    try:
        final = _fit(validated, out, plan, module, loggers, callbacks, ckpt, stop, final_eval, tokenizer, progress)
    except BaseException:
        close_loggers(loggers, failed=True)
        raise
    close_loggers(loggers, failed=False)
    return final


def _fit(validated, out: Path, plan: dict, module, loggers, callbacks, ckpt, stop: GracefulStop, final_eval,
         tokenizer, progress: bool) -> dict:
    t = validated.spec.train
    try:
        trainer = L.Trainer(
            max_steps=plan["total_steps"], max_epochs=-1, accelerator=t.accelerator, devices=t.devices,
            strategy=t.strategy, num_nodes=t.num_nodes, precision=t.precision,
            logger=loggers, callbacks=callbacks, log_every_n_steps=1,
            enable_progress_bar=progress, enable_model_summary=False, num_sanity_val_steps=0,
            enable_checkpointing=True, default_root_dir=str(out), limit_val_batches=0,
            plugins=[AtomicCheckpointIO()],
        )
    except (ValueError, TypeError) as e:  # Lightning's refusal of a setting this machine cannot honour
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RunError(f"train.accelerator {t.accelerator}, devices {t.devices}, strategy {t.strategy}, precision "
                       f"{t.precision}: Lightning cannot run this here: {first}\n    hint: on a machine without "
                       "GPUs use strategy auto or ddp and a device count (train.devices=2), not a list of "
                       "indices") from None
    stop.deferred = True  # inside fit a signal stops the run after the current step
    try:
        trainer.fit(module, ckpt_path=str(ckpt) if ckpt else None)
    except StopRequested as e:
        raise Interrupted(f"{e}: stopped before the first step; "
                          + (f"continue with --resume {out}" if ckpt else "nothing was trained")) from None
    except (NonFiniteError, CheckpointError) as e:
        last = last_checkpoint(out)
        fix = "fix the cause above" if isinstance(e, CheckpointError) else "fix the spec"  # a full disk, say
        raise type(e)(f"{e}; the run stopped, the last good checkpoint is "
                      f"{last if last else '(none yet)'}; {fix} and continue with --resume {out}") from None
    if getattr(module, "stopped_by", None):
        if last_checkpoint(out) is None:
            raise Interrupted(f"{stop.requested}: stopped before the first step; nothing was trained")
        raise Interrupted(f"{stop.requested}: stopped after step {module.global_step}, checkpoint written; "
                          f"continue with --resume {out}")
    if module.vacuous_error:
        raise RunError(f"{module.vacuous_error}\n--strict: the run stopped after step {module.global_step}; its "
                       f"checkpoint is kept ({last_checkpoint(out)})\n    hint: fix the spec (the settings above never "
                       f"acted), or run without --strict to train on regardless; --resume {out} continues") from None
    stop.deferred, stop.finishing = False, True
    if trainer.is_global_zero:
        module.reward_watch.warn()
    if trainer.global_step and _checkpoint_step(out) != trainer.global_step:  # the last step's state, always
        trainer.save_checkpoint(str(out / "checkpoints" / "last.ckpt"))  # every rank calls it; rank 0 writes
    if module.ctx is None:  # resumed from the last step's checkpoint: Lightning ran nothing
        module.setup("fit")
    module.final_evaluation(loggers)
    final = dict(module.last_eval)
    if final_eval is not None:
        final_eval(module.ctx, module.policy)
    model_dir = None
    if trainer.is_global_zero:
        model_dir = export_policy(module, tokenizer, out, t.strategy)
        write_report(out, plan, final, model_dir)
    return final


def export_policy(module, tokenizer, out: Path, strategy: str) -> Path | None:
    """The trained policy as `model/` in the run folder (save_pretrained of model and tokenizer)."""
    if strategy == "fsdp":  # the module holds one shard: export from the full checkpoint instead
        from composer.runtime.export import export_checkpoint

        ckpt = last_checkpoint(out)
        return export_checkpoint(ckpt, out / MODEL_DIR) if ckpt is not None else None
    from composer.runtime.export import eval_settings

    settings = eval_settings(json.loads(ckpt_format.spec_record(module.validated)["json"]), module.global_step)
    return save_policy(merged(module.policy), tokenizer, out / MODEL_DIR, settings)  # a LoRA adapter merged


LOGGER_IDS = "loggers.json"  # the W&B and MLflow run ids, so that --resume continues the same runs


def build_loggers(validated, out: Path, resumed_at: int | None) -> list:
    """Lightning's loggers named by train.loggers (composer/runtime/paths.py has checked their packages)."""
    from composer.runtime.paths import LOGGER_PACKAGES, installed

    spec = validated.spec
    ids_path = out / LOGGER_IDS
    ids = {}
    if resumed_at is not None and ids_path.exists():
        with contextlib.suppress(ValueError, OSError):
            ids = json.loads(ids_path.read_text())
    loggers, new_ids = [], {}
    logged = last_logged_step(out) if resumed_at is not None else None  # read before metrics.csv is cut
    for kind in spec.train.loggers:
        if kind == "csv":
            loggers.append(RunCSVLogger(out, keep_before=resumed_at))
        elif kind == "tensorboard":
            if not any(installed(m) for m in LOGGER_PACKAGES["tensorboard"][0]):
                continue  # only the default list gets here: its tensorboard is optional
            from lightning.pytorch.loggers import TensorBoardLogger

            # a resumed run drops the events of the steps it trains again (purge_step): each step shows once
            purge = {"purge_step": resumed_at} if resumed_at is not None else {}
            loggers.append(TensorBoardLogger(save_dir=str(out), name="tensorboard", version="",
                                             default_hp_metric=False, **purge))
        elif kind == "wandb":
            import secrets

            from lightning.pytorch.loggers import WandbLogger

            run_id = ids.get("wandb") or secrets.token_hex(4)
            loggers.append(WandbLogger(name=out.name, save_dir=str(out), id=run_id, resume="allow",
                                       project=os.environ.get("WANDB_PROJECT") or "composer", group=spec.name))
            new_ids["wandb"] = run_id
        elif kind == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger

            uri = os.environ.get("MLFLOW_TRACKING_URI") or (out.resolve() / "mlruns").as_uri()
            if uri.startswith("file:") or "://" not in uri:  # a folder: MLflow 3 wants this said out loud
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            # a server that stops answering: a few short retries, not MLflow's default of minutes
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
            try:
                lg = MLFlowLogger(experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME") or spec.name,
                                  run_name=out.name, tracking_uri=uri, run_id=ids.get("mlflow"))
                new_ids["mlflow"] = lg.run_id  # creates the run now: a tracking store that refuses stops here
            except Exception as e:
                detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise RunError(f"train.loggers: mlflow cannot start a run at {uri}: {detail}\n    hint: set "
                               "MLFLOW_TRACKING_URI to a tracking server or store you can write to") from None
            loggers.append(lg)
    for lg in loggers:
        if type(lg).__name__ in ("WandbLogger", "MLFlowLogger") and logged is not None and logged >= resumed_at:
            keep_logged_steps(lg, logged)
    if new_ids and new_ids != ids and _rank_zero():
        files.write_text(ids_path, json.dumps(new_ids, indent=2))
    if resumed_at is None:
        params = _hyperparams(validated)
        for lg in loggers:
            if type(lg).__name__ in ("WandbLogger", "MLFlowLogger", "TensorBoardLogger"):
                try:
                    lg.log_hyperparams(params)
                except Exception as e:  # a tracking server's refusal is no reason to stop the run
                    log.warning(f"{type(lg).__name__}: the spec was not logged as hyperparameters ({e})")
    return loggers


def _rank_zero() -> bool:
    from lightning.pytorch.utilities import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def _hyperparams(validated) -> dict:
    """The resolved spec, flattened to path -> value, with keys every tracker accepts."""
    import re

    spec = json.loads(ckpt_format.spec_record(validated)["json"])
    flat = {}

    def walk(value, prefix):
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
            for i, v in enumerate(value):
                walk(v, f"{prefix}.{i}")
        else:
            flat[re.sub(r"[^\w\-. /]", "_", prefix)] = value if not isinstance(value, list) else str(value)

    walk(spec, "")
    return flat


def close_loggers(loggers, failed: bool) -> None:
    """Flush and close every logger at the end of a run (Lightning's own finalize runs before the final
    evaluation's row): TensorBoard's event file, the W&B run, the MLflow run's status."""
    for lg in loggers:
        try:
            if type(lg).__name__ == "WandbLogger":
                if lg._experiment is not None:
                    lg._experiment.finish(exit_code=1 if failed else 0)
            else:
                lg.finalize("failed" if failed else "success")
        except Exception as e:
            log.warning(f"{type(lg).__name__}: could not be closed ({type(e).__name__}: {e})")


def _tty() -> bool:
    import sys

    return sys.stderr.isatty()


def console_log() -> None:
    """The `composer` logger's lines (run folder, rollout engine, step lines, warnings) on stderr, once."""
    import sys

    class Stderr(logging.StreamHandler):
        """Writes to the sys.stderr of the moment (a test's capture, a redirected CLI), not the one at setup."""

        @property
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, value):
            pass

    if not any(getattr(h, "_composer_console", False) for h in log.handlers):
        handler = Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._composer_console = True
        log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)


def quiet_libraries() -> None:
    """Keep the console for the run: no library tips, deprecation notes or weight-loading bars."""
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    for pattern in (".*LeafSpec.*", ".*does not have many workers.*", ".*exists and is not empty.*",
                    ".*reproducible.*", ".*dataloader is not resumable.*", ".*Checkpoint directory.*exists and is not empty.*",
                    ".*MLFlow only allows.*"):  # MLflow's names for pass@1/...: said for every key of every row
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric.utilities.rank_zero").setLevel(logging.WARNING)


def _progress_bar():
    """Lightning's progress bar, labelled by step (a run is one pass of max_steps, not epochs)."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    class Steps(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            return "Training steps"

    class StepsTQDM(TQDMProgressBar):
        def on_train_epoch_start(self, trainer, *args) -> None:
            super().on_train_epoch_start(trainer, *args)
            self.train_progress_bar.set_description("Training steps")

    try:
        return Steps(leave=True)
    except Exception:
        return StepsTQDM()


def _checkpoint_step(out: Path) -> int | None:
    """The global step last.ckpt holds (None without one)."""
    last = last_checkpoint(out)
    if last is None:
        return None
    try:
        return int(ckpt_format.load(last, mmap=True)["global_step"])
    except Exception:
        return None


def report_rows(final: dict) -> list[str]:
    """One table row per evaluation metric, named: `| pass@1 | eval | 0.250 |` (greedy), `| pass@4 | eval |`,
    `| pass@1_sampled | eval |` (was: every row labelled with its tier only, under a pass@1 header)."""
    rows = []
    for k, v in sorted(final.items(), key=lambda kv: (kv[0].split("/", 1)[-1], kv[0])):
        metric, _, tier = k.partition("/")
        rows.append(f"| {metric} | {tier or '-'} | {v:.3f} |")
    return rows


def write_report(out: Path, plan: dict, final: dict, model_dir: Path | None = None) -> None:
    """report.md with the final evaluation, a table of every evaluation and a PNG of the loss, the reward and the
    evaluation against step."""
    from composer.runtime.report import evaluation_table, plot_metrics

    metrics = out / "metrics.csv"
    png = None
    if metrics.exists():
        with files.atomic_path(out / "curves.png") as tmp:
            plot_metrics(metrics, tmp, plan["name"])
        png = out / "curves.png"
    lines = [f"# {plan['name']}", "", plan.get("summary", ""), "",
             f"Steps: {plan['total_steps']}, backend: lightning, testbed: {plan['testbed']}.", "",
             "## Final evaluation", "", "| metric | tier | value |", "| --- | --- | --- |"]
    lines += report_rows(final)
    history = evaluation_table(metrics) if metrics.exists() else []
    if history:  # every evaluation of the run (train.eval_every), not only the final one
        lines += ["", "## Every evaluation", "", *history]
    if png:
        lines += ["", f"![loss, reward and evaluation]({png.name})"]
    if model_dir is not None:
        lines += ["", "## The trained policy", "",
                  f"`{model_dir}`: a transformers directory (model and tokenizer); load it with "
                  f"`AutoModelForCausalLM.from_pretrained(\"{model_dir}\")`."]
    samples = out / sample_files.SAMPLES
    if samples.exists():
        lines += ["", f"Rollout samples: `{samples.name}` (`composer samples {out}`)."]
    files.write_text(out / "report.md", "\n".join(lines) + "\n")
