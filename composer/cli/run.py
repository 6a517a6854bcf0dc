"""Commands that run things (`run`, `samples`, `export`, `toy-data`): their heavy imports happen only when they run."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import click

from composer.cli.main import EXIT_INVALID, SIGNALLED, allow_plugins_option, main, split_args, trust_remote_code_option, validated_or_exit
from composer.errors import SpecError


@main.command()
@click.argument("spec", required=False)
@click.argument("overrides", nargs=-1)
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Run folder (default runs/<name>-<time>); must be new or empty.")
@click.option("--resume", type=click.Path(file_okay=False), default=None,
              help="Continue the run in this folder from its last checkpoint.")
@click.option("--no-progress", is_flag=True, help="No progress bar (for logs and CI).")
@click.option("--strict", is_flag=True, help="A segment that trained on nothing (a gate that selected no row, a "
              "filter that kept nothing, a verifier that parsed nothing, weights that did not move) is an error "
              "that stops the run after that segment, checkpoint kept (without it: a warning).")
@click.option("--allow-changed-data", is_flag=True, help="With --resume: continue although a data file changed "
              "since the checkpoint (its size and sha256 are kept in it); without it such a resume is refused.")
@allow_plugins_option
def run(spec, overrides, out, resume, no_progress, strict, allow_changed_data):
    """Train SPEC (the toy testbed when it names no policy/data). OVERRIDES: path.to.field=value."""
    if spec is not None and "=" in spec and not Path(spec).exists():  # `run --resume DIR train.steps=200`
        spec, overrides = None, (spec, *overrides)
    named = spec  # the SPEC the command gave (None: the run folder's own spec.yaml)
    if resume and spec is None:
        spec = str(Path(resume) / "spec.yaml")
    if allow_changed_data and not resume:
        raise click.UsageError("--allow-changed-data only applies to --resume DIR")
    if spec is None:
        raise click.UsageError("give a SPEC, or --resume DIR")
    # a run started as a background job (`composer run ... &` in a script) inherits SIGINT ignored; training's
    # own handler (callbacks.StopOnSignal) honours a SIGINT anyway, so setup honours it too: one behaviour
    old_int = signal.signal(signal.SIGINT, _interrupt)  # recorded: a library may wrap the KeyboardInterrupt it raises
    old_term = signal.signal(signal.SIGTERM, _interrupt)  # before training, SIGTERM stops like SIGINT: exit 130
    try:
        _run(spec, overrides, out, resume, no_progress, strict, allow_changed_data, named)
    except KeyboardInterrupt:
        old_int = old_term = signal.SIG_IGN  # a second Ctrl-C while stopping changes nothing: still exit 130
        signal.signal(signal.SIGINT, old_int)
        click.echo(f"{SIGNALLED.get('name', 'SIGINT')}: stopped before training; nothing was trained", err=True)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


def _interrupt(signum, frame):
    SIGNALLED["name"] = signal.Signals(signum).name
    raise KeyboardInterrupt


class _deferred_signals:
    """Hold SIGINT/SIGTERM while native code imports; raise KeyboardInterrupt afterwards if one came."""

    def __enter__(self):
        self.got = []
        self.old = {s: signal.signal(s, lambda n, f: self.got.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)
        if self.got and exc[0] is None:
            SIGNALLED["name"] = signal.Signals(self.got[0]).name
            raise KeyboardInterrupt
        return False


def _run(spec, overrides, out, resume, no_progress, strict=False, allow_changed_data=False, named=None):
    v = validated_or_exit(spec, overrides)
    if v.spec.train.backend != "lightning":
        click.echo(f"{spec}: train.backend is {v.spec.train.backend}; use `composer compile --backend "
                   f"{v.spec.train.backend}` for it", err=True)
        sys.exit(EXIT_INVALID)
    from composer.runtime.paths import PathError, check_run_inputs

    try:  # every model, tokenizer and data path, and the loggers' packages, before the run folder exists
        check_run_inputs(v)
    except PathError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_INVALID)
    with _deferred_signals():  # a signal inside torch's C++ import would abort the process, not stop it
        from composer.backends.lightning.run import (Interrupted, changed_data, check_resume, claim_folder, default_out,
                                                     train)

    from composer.backends.lightning.run import launched_child

    child = launched_child()
    if child is not None:  # a process Lightning started for another rank: rank 0 owns the folder
        folder, resume = Path(child["out"]), child["out"] if child["resume"] else None
        try:
            train(v, folder, resume=bool(resume), progress=False, strict=strict, allow_changed_data=allow_changed_data)
        except Interrupted:
            sys.exit(130)
        except Exception as e:
            click.echo(f"error (rank {child['rank']}): {_failure(e)}", err=True)
            sys.exit(EXIT_INVALID)
        return
    folder = Path(resume or out or default_out(v.spec.name))
    try:
        with claim_folder(folder, resume=bool(resume)):
            if resume:
                state, changes = check_resume(v, folder, allow_changed_data, named)
                for line in changed_data(v, state) if allow_changed_data else []:
                    click.echo(f"resuming on changed data (--allow-changed-data):{line[3:]}", err=True)
                done = finished_note(v, folder, state)
                if done:  # nothing to train: the folder stays as it is (no final evaluation rerun)
                    click.echo(done)
                    return
                for path, old, new in changes:
                    click.echo(f"resuming with {path}: {old} -> {new}", err=True)
            else:
                _save_resolved(spec, overrides, folder)
            # a resume's new settings go into spec.yaml once the checkpoint passed every check (a refused
            # resume changes nothing in the folder)
            save = (lambda: _save_resolved(spec, overrides, folder)) if resume and changes else None
            final = train(v, folder, resume=bool(resume), progress=not no_progress, strict=strict,
                          allow_changed_data=allow_changed_data, on_checked=save)
    except Interrupted as e:
        click.echo(str(e), err=True)
        sys.exit(130)
    except Exception as e:  # every failure is a message and exit 2, never a traceback
        click.echo(f"error: {_failure(e)}", err=True)
        sys.exit(EXIT_INVALID)
    click.echo(f"run folder: {folder}")
    for k, val in sorted(final.items()):
        click.echo(f"  {k}: {val:.3f}")
    if (folder / "model" / "config.json").exists():
        click.echo(f"model: {folder / 'model'} (transformers: AutoModelForCausalLM.from_pretrained)")


def finished_note(v, folder: Path, state: dict) -> str | None:
    """What `--resume` of a run that already finished says (None: there are steps left to train)."""
    try:
        step = int(state.get("global_step", -1))
    except (TypeError, ValueError):
        return None
    total = v.total_steps
    if step < total or not (folder / "report.md").exists():
        return None
    return (f"{folder}: the run already finished (step {step}/{total}, report.md written); --resume changed "
            f"nothing.\n    hint: to train further, resume with a larger train.steps (`composer run --resume {folder} "
            f"train.steps=N`, N > {v.spec.train.steps}); to evaluate again, `composer eval {folder} --out DIR`")


def _expected_errors() -> tuple:
    """Failures that are the input's or the machine's, each with its own message."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from composer.runtime.checkpoint import CheckpointError
    from composer.backends.lightning.module import NonFiniteError
    from composer.backends.lightning.run import RunError
    from composer.runtime.export import ExportError
    from composer.runtime.paths import PathError
    from composer.errors import DataError, MachineUnavailable, ModelLoadError

    return (SpecError, DataError, ModelLoadError, NonFiniteError, MachineUnavailable, CheckpointError, RunError,
            MisconfigurationException, OSError, PathError, ExportError)


def _failure(e: Exception) -> str:
    """The message of a failed run; an unexpected exception also gets its traceback saved to a file."""
    if isinstance(e, _expected_errors()):
        from composer.errors import DataError

        if isinstance(e, DataError) and "hint:" not in str(e):  # what to do, for this error's reason and field
            from composer.runtime.binding import data_hint

            return f"{e}\n    hint: {data_hint(e)}"
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError) and e.strerror:
            return f"{e.filename or ''}{': ' if e.filename else ''}{e.strerror}"
        return str(e)
    import tempfile
    import traceback

    fd, log = tempfile.mkstemp(prefix="composer-error-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(e)))
    return f"internal error: {type(e).__name__}: {e} (traceback in {log}; please report it)"


def _save_resolved(spec: str, overrides, folder: Path) -> None:
    """Keep the spec (with its overrides) in the run folder, so --resume needs nothing else."""
    import yaml

    from composer import files
    from composer.lang.loader import load_spec

    data = load_spec(spec, list(overrides)).data
    data.pop("extends", None)
    files.write_text(folder / "spec.yaml", yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--step", type=click.IntRange(min=0), default=None, help="The step to show (default: the last one written).")
@click.option("--limit", type=click.IntRange(min=1), default=8, show_default=True, help="Samples to show.")
def samples(run_dir, step, limit):
    """Print RUN_DIR's rollout samples at a step (samples.jsonl), with the tokens a guide wrote highlighted."""
    from composer.runtime import samples as s

    path = Path(run_dir) / s.SAMPLES
    try:
        rows, bad = s.read(path)
    except FileNotFoundError:
        click.echo(f"{path}: no samples (a run writes them every train.samples_every steps; 0 turns them off)",
                   err=True)
        sys.exit(EXIT_INVALID)
    except OSError as e:
        click.echo(f"{path}: cannot read it: {e.strerror or e}", err=True)
        sys.exit(EXIT_INVALID)
    steps = sorted({r["step"] for r in rows})
    if not steps:
        click.echo(f"{path}: no samples written yet", err=True)
        sys.exit(EXIT_INVALID)
    shown_step = steps[-1] if step is None else step
    if shown_step not in steps:
        listed = ", ".join(map(str, steps[:20])) + (", ..." if len(steps) > 20 else "")
        click.echo(f"{path}: no samples at step {shown_step}; steps with samples: {listed}", err=True)
        sys.exit(EXIT_INVALID)
    at = [r for r in rows if r["step"] == shown_step]
    _print_samples(at[:limit], len(at), shown_step, steps)
    if bad:
        click.echo(f"({bad} unreadable line{'s' if bad > 1 else ''} skipped)", err=True)


GUIDE_STYLES = {"guide_prefix": "bold cyan", "guide_intervention": "bold magenta", "demonstration": "bold green",
                "environment": "bold yellow"}  # environment: a tool's answer (rollout.environment)


def _print_samples(rows: list[dict], total: int, step: int, steps: list[int]) -> None:
    """Rich styles on a terminal; elsewhere (a pipe, a file) guide-written spans between [[ and ]]."""
    from rich.console import Console
    from rich.text import Text

    from composer.runtime import samples as s

    console = Console(highlight=False, soft_wrap=True)
    styled = console.is_terminal
    head = f"step {step}: {len(rows)} of {total} samples (steps with samples: {steps[0]}..{steps[-1]}, {len(steps)} in all)"
    if styled:
        legend = Text("guide- or environment-written: ")
        for i, (origin, style) in enumerate(GUIDE_STYLES.items()):
            legend.append(("" if not i else ", ") + origin, style=style)
        console.print(Text(head, style="bold"))
        console.print(legend)
    else:
        click.echo(head)
        click.echo("[[...]]: tokens the guide wrote (guide_prefix, guide_intervention, demonstration); <<...>>: tokens "
                   "the environment wrote")
    p = s.printable  # a prompt or response may hold escape sequences: never sent to the terminal raw
    for r in rows:
        if styled:
            console.print()
            console.print(Text(p(s.row_header(r)), style="bold"))
            console.print(Text("prompt: " + p(r.get("prompt", "")), style="dim"))
            response = Text()
            response.append("response: ", style="dim")
            for span in r.get("spans", []):
                response.append(p(span.get("text", "")), style=GUIDE_STYLES.get(str(span.get("origin")), ""))
            console.print(response)
            for line in s.guide_lines(r):
                console.print(Text(p(line), style="yellow"))
        else:
            click.echo("")
            click.echo(p(s.row_header(r)))
            click.echo(f"prompt: {p(r.get('prompt', ''))}")
            click.echo(f"response: {p(s.marked(r))}")
            for line in s.guide_lines(r):
                click.echo(p(line))


@main.command("export")
@click.argument("source", type=click.Path())
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Folder for the transformers model directory (new, empty, or an earlier export).")
@click.option("--base", default=None, help="The model directory the run was trained from, for its config and "
              "tokenizer (default: the one the checkpoint's spec names).")
@trust_remote_code_option
def export(source, out, base):
    """Write a checkpoint's policy (SOURCE: a .ckpt file or a run folder) as a transformers directory."""
    from composer.runtime.export import MODEL_DIR, target_problem

    folder = Path(out)
    why = target_problem(folder)
    if why:
        click.echo(f"{out}: error: {why}", err=True)
        sys.exit(EXIT_INVALID)
    try:
        with _deferred_signals():
            import transformers

            from composer.runtime.export import export_checkpoint
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        path = export_checkpoint(source, folder, base)
    except Exception as e:
        click.echo(f"error: {_failure(e)}", err=True)
        sys.exit(EXIT_INVALID)
    click.echo(f"wrote {path} (transformers: AutoModelForCausalLM.from_pretrained; {MODEL_DIR}/ is what a run "
               "writes at its end)")


@main.command("toy-data")
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Folder for train.jsonl and eval_<tier>.jsonl.")
@click.option("--seed", type=click.IntRange(min=0, max=2**32 - 1), default=0, show_default=True)
def toy_data(out, seed):
    """Write the toy testbed's data as jsonl, to go through the ordinary `data:` path."""
    from composer.registry import part

    write_jsonl = part("toy.write_jsonl")

    taken = sorted(p.name for p in [*Path(out).glob("train.jsonl"), *Path(out).glob("eval_*.jsonl")]) \
        if Path(out).is_dir() else []
    if taken:
        click.echo(f"{out}: error: the folder already holds {', '.join(taken)}; choose another --out", err=True)
        sys.exit(EXIT_INVALID)
    try:
        paths = write_jsonl(out, {"seed": seed})
    except (OSError, ValueError) as e:
        click.echo(f"{out}: error: cannot write the toy data: {getattr(e, 'strerror', None) or e}", err=True)
        sys.exit(EXIT_INVALID)
    click.echo(f"wrote {', '.join(map(str, paths.values()))}")


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("specs", nargs=-1)
@click.option("--seeds", type=int, default=None, help="Seeds per variant (default 2; --quick 1).")
@click.option("--budget-samples", type=int, default=None, help="Policy-generated samples per run (default 4096).")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Output folder (default runs/bench-<time>).")
@click.option("--sweep", default=None, is_flag=False, flag_value="",
              help="One spec field and its values: rollout.guide.max_reviews=0,1,2,4,8 (with --throughput, no "
                   "value: how a GRPO step's cost grows with group size, response length and prompts per step).")
@click.option("--suite", type=click.Choice(["seeds"]), default=None,
              help="seeds: the nine methods and the studies (coverage, intensity, lag, off-policyness).")
@click.option("--study", multiple=True, help="With --suite: run only these studies.")
@click.option("--quick", is_flag=True, help="Tiny budget, one seed: a few minutes.")
@click.option("--throughput", is_flag=True, help="Samples/s of this backend against TRL's trainers (GRPO, GKD, SFT).")
@click.option("--readme", "readme_from", type=click.Path(file_okay=False, exists=True), default=None,
              help="Write the methods table and plot of this finished bench folder into docs/results.md (plots: docs/bench/).")
@allow_plugins_option
def bench(specs, seeds, budget_samples, out, sweep, suite, study, quick, throughput, readme_from):
    """Run SPECs (or a suite) on the toy testbed at an equal policy-sample budget; write results.csv,
    summary.md (mean and 95% interval) and plots. Arguments path.to.field=value override every SPEC."""
    import time as _time

    from composer.bench import methods as b

    if readme_from:
        try:
            b.readme_section(Path(readme_from), Path("docs/results.md"), Path("docs/bench"), (study or ("methods",))[0])
        except (OSError, ValueError, KeyError, StopIteration) as e:
            click.echo(f"{readme_from}: cannot write the results section: {type(e).__name__}: {e}", err=True)
            sys.exit(EXIT_INVALID)
        click.echo("wrote docs/results.md (bench results section) and docs/bench/")
        return
    if throughput:
        from composer.bench.throughput import main as tp_main

        extra = (["--sweep"] + (["--sweep-axes", sweep] if sweep else [])) if sweep is not None else []  # value: axes
        sys.exit(tp_main(extra + (["--out", out] if out else []) + list(specs)))
    if sweep == "":
        raise click.UsageError("--sweep needs a field and its values (e.g. --sweep train.lr=1e-4,3e-4); "
                               "without one it belongs to --throughput")
    cfg = dict(b.QUICK if quick else b.DEFAULTS)
    if seeds is not None:
        cfg["seeds"] = seeds
    if budget_samples is not None:
        cfg["budget_samples"] = budget_samples
    if suite:
        variants = [b.Variant(label, spec, list(ov), study=name) for name, items in b.SUITE.items()
                    if not study or name in study for label, spec, ov in items]
    elif specs:
        files, common = split_args(specs)  # path.to.field=value applies to every variant
        variants = b.variants_from(files, sweep, common)
    else:
        raise click.UsageError("give SPEC files, or --suite seeds")
    for var in variants:  # the bench measures on the toy testbed's tiers; a data spec has none of them
        try:
            from composer.checks.validate import validate_file

            data = validate_file(var.spec, list(var.overrides)).spec.data.train
        except SpecError as e:
            click.echo(str(e), err=True)
            sys.exit(EXIT_INVALID)
        if data is not None:
            click.echo(f"{var.spec}: the bench runs on the toy testbed (its tiers, pass@k on held-out chains); this "
                       f"spec trains on {data}\n    hint: for your data use `composer run SPEC train.eval_k=N` "
                       "(pass@k in metrics.csv), or `composer eval RUN --k N` on a finished run", err=True)
            sys.exit(EXIT_INVALID)
    folder = Path(out or f"runs/bench-{_time.strftime('%Y%m%d-%H%M%S')}")
    command = "composer bench " + " ".join(sys.argv[2:])
    try:
        b.bench(variants, folder, cfg, command, log=lambda m: click.echo(m, err=True))
    except SpecError as e:
        click.echo(str(e), err=True)
        sys.exit(EXIT_INVALID)
    click.echo(f"wrote {folder}/results.csv, {folder}/summary.md")
