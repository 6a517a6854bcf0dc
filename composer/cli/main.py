"""The `composer` command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from composer.errors import SpecError

EXIT_INVALID = 2


def _fail(diags_text: str) -> None:
    click.echo(diags_text, err=True)
    sys.exit(EXIT_INVALID)


def allow_plugins_option(command):
    """--allow-plugins: import the modules specs name in `plugins:` (their code runs). Off by default."""
    def set_allowed(ctx, param, value):
        from composer import registry

        registry.allow_spec_plugins(True if value else None)  # None: COMPOSER_ALLOW_PLUGINS decides
        return value

    command = trust_remote_code_option(command)
    return click.option("--allow-plugins", is_flag=True, expose_value=False, callback=set_allowed, is_eager=True,
                        help="Import the modules a spec names in `plugins:` (this runs their code: only for specs "
                             "you trust). Also COMPOSER_ALLOW_PLUGINS=1.")(command)


def trust_remote_code_option(command):
    """--trust-remote-code: let a model folder's own Python run where the spec asks for it. Off by default."""
    def set_allowed(ctx, param, value):
        from composer import registry

        registry.allow_remote_code(True if value else None)  # None: COMPOSER_TRUST_REMOTE_CODE decides
        if value:  # the user's choice, carried to the processes this command starts (DDP ranks)
            import os

            os.environ[registry.TRUST_REMOTE_CODE_ENV] = "1"
        return value

    return click.option("--trust-remote-code", is_flag=True, expose_value=False, callback=set_allowed,
                        is_eager=True, help="Run the Python code a model folder ships where the spec sets "
                        "`trust_remote_code: true` (only for folders you trust). Also "
                        "COMPOSER_TRUST_REMOTE_CODE=1. A spec, checkpoint or run folder never turns it on.")(command)


def _validate(path: str, overrides: list[str]):
    from composer.checks.validate import validate_file

    try:
        return validate_file(path, overrides)
    except SpecError as e:
        raise with_override_hints(e, overrides) from None


def with_override_hints(e: SpecError, overrides) -> SpecError:
    """An override whose value YAML read as a mapping or a list where text was wanted (`data.prompt_template=
    {prompt}`: YAML's flow mapping {prompt: null}) gets a hint to quote it (was: only "Input should be a valid
    string")."""
    for d in getattr(e, "diagnostics", []):
        where = str(getattr(d.location, "file", "") or "")
        item = next((o for o in overrides or [] if where == f"<override {o!r}>"), None)
        if item is None or "valid string" not in d.message:
            continue
        key, _, value = item.partition("=")
        value = value.strip()
        if not value[:1] in ("{", "["):
            continue
        what = "a mapping" if value.startswith("{") else "a list"
        quoted = "'" + key.strip() + '="' + value.replace('"', '\\"') + '"' + "'"
        d.hint = (f"the value {value} was read as YAML, where an unquoted {value[0]}...{value[-1]} is {what}, not "
                  f"text: quote it for YAML inside the shell's quotes, {quoted}" + (f"\n    {d.hint}" if d.hint else ""))
    return e


def split_args(args) -> tuple[list[str], list[str]]:
    """Command-line arguments as (files, path.to.field=value overrides). An argument that names an existing file is
    a file even with `=` in its name (`lr=1e-4.yaml`): it was taken as an override and nothing was checked."""
    files = [a for a in args if "=" not in a or Path(a).is_file()]
    return files, [a for a in args if a not in files]


SIGNALLED: dict = {}  # the name of a stop signal `composer run` received before training (see cli/run.py)


def validated_or_exit(path: str, overrides: list[str]):
    """The validated spec, its warnings printed; on a spec error the message and exit 2."""
    try:
        v = _validate(path, list(overrides))
    except SpecError as e:
        _fail(str(e))
    except Exception as e:  # never a traceback for an input file
        if SIGNALLED:  # a signal inside pydantic's schema build comes back wrapped in a SchemaError
            raise KeyboardInterrupt from e
        _fail(f"{path}:1:1: error: internal error while validating: {type(e).__name__}: {e}")
    for w in v.warnings:
        click.echo(w.format(), err=True)
    return v


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="algorithm-composer")
def main():
    """Declare, validate, explain and run LLM post-training methods as YAML graphs of components."""


@main.command()
@click.argument("specs", nargs=-1, required=True)
@click.option("--set", "overrides", multiple=True, help="Override (path.to.field=value); also accepted as bare args.")
@allow_plugins_option
def validate(specs, overrides):
    """Validate SPEC files (schema, graph, method rules). Exit 0 if all are valid, 2 otherwise."""
    files, given = split_args(specs)
    overrides = list(overrides) + given
    if not files:  # every argument read as an override: nothing would be checked, and exit 0 would say "valid"
        _fail("error: no spec file given: " + ", ".join(repr(a) for a in given) + " read as override(s) "
              "(path.to.field=value), and no file of that name exists\n    hint: name a spec file (a file name with "
              "`=` in it is a file when it exists: check the path)")
    bad = warned = 0
    for f in files:
        try:
            v = _validate(f, overrides)
        except SpecError as e:
            bad += 1
            click.echo(str(e), err=True)
            continue
        except Exception as e:  # never a traceback for an input file
            bad += 1
            click.echo(f"{f}:1:1: error: internal error while validating: {type(e).__name__}: {e}", err=True)
            continue
        for w in v.warnings:
            warned += 1
            click.echo(w.format(), err=True)
        click.echo(f"{f}: ok")
    for err in _entry_point_errors():
        warned += 1
        click.echo(f"warning: {err}", err=True)
    click.echo(f"{len(files) - bad} valid, {bad} invalid" + (f", {warned} warnings" if warned else ""))
    sys.exit(EXIT_INVALID if bad else 0)


def _entry_point_errors() -> list[str]:
    """What installed (entry-point) plugins refused or failed to do; spec plugins' are warnings of their spec."""
    from composer import registry

    return [e for e in registry.PLUGIN_ERRORS if e not in registry.SPEC_PLUGIN_ERRORS]


@main.command()
@click.argument("spec")
@click.argument("overrides", nargs=-1)
@click.option("--format", "fmt", type=click.Choice(["text", "mermaid", "dot", "json"]), default="text")
@allow_plugins_option
def explain(spec, overrides, fmt):
    """Explain SPEC: sources and readers, token origins with loss and anchor, models, taxonomy."""
    from composer.plan import explain as ex
    from composer.plan.compile import compile_plan
    from composer.runtime.example_prompts import machine_notes

    try:
        v = _validate(spec, list(overrides))
        plan = {**compile_plan(v), **machine_notes(v)}
        out = {"text": ex.text, "mermaid": ex.mermaid, "dot": ex.dot, "json": ex.as_json}[fmt](plan)
    except SpecError as e:
        _fail(str(e))
        return
    except Exception as e:  # never a traceback for an input file
        _fail(f"{spec}:1:1: error: internal error while explaining: {type(e).__name__}: {e}")
        return
    bad_data = (plan.get("prompts") or {}).get("data_error")
    if bad_data:  # a data field or split the rows do not have: the run would stop here, so explain does too
        hint = (plan.get("prompts") or {}).get("data_hint") or "check the data file against `composer list data`"
        _fail(f"{spec}: error: data: {bad_data}\n    hint: {hint}")
    for w in v.warnings:
        click.echo(w.format(), err=True)
    click.echo(out)


@main.command("list")
@click.argument("topic", required=False)
@click.option("--section", default=None, metavar="KEY",
              help="Same as TOPIC: a top-level key (train, stages, objective, ...), guide, or verifiers.")
@click.option("--markdown", is_flag=True, help="Print Markdown (the text of docs/reference.md) instead.")
@click.option("--out", default=None, help="With --markdown: write to this file (docs/reference.md is generated with "
              "`composer list --markdown --out docs/reference.md`).")
@click.option("--with-plugins", is_flag=True, help="With --markdown: include installed plugins' kinds (the committed "
              "docs/reference.md covers built-in kinds only).")
def list_(topic, section, markdown, out, with_plugins):
    """The spec language: every top-level key, every component kind and every verifier.

    TOPIC shows every field with its type, allowed values, default and description: a key (`train`,
    `stages`, `objective`), a kind (`objective/advantage_regression`, with its formula and paper), or
    `verifiers`.
    """
    from composer import registry
    from composer.lang import reference

    registry.load_all()
    _refuse_shadowing_plugins()
    topic = section or topic
    if out and not markdown:
        _fail("error: --out needs --markdown")
    try:
        entries = reference.entries_for(topic, builtins_only=markdown and not with_plugins) if topic else None
    except reference.UnknownTopic as e:
        _fail(f"error: {e}" + (f"\n    hint: {e.hint}" if e.hint else ""))
    if markdown:
        _list_markdown(entries, not with_plugins, out)
    else:
        _list_terminal(entries)


def _refuse_shadowing_plugins() -> None:
    """Exit 2 when an installed plugin tried to replace a built-in kind or verifier (a plugin adds names)."""
    from composer import registry

    refused = registry.entry_point_refusals()
    if refused:
        _fail("\n".join(f"error: {msg}" for msg in refused) +
              "\n    hint: fix the plugin package (a plugin adds names) or `pip uninstall` it")


def _list_markdown(entries, builtins_only: bool, out: str | None) -> None:
    from composer.lang import reference

    text = reference.markdown(builtins_only) if entries is None else \
        "\n".join(line for e in entries for line in reference.entry_markdown(e))
    if not out:
        click.echo(text, nl=False)
        return
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        _fail(f"{out!r}: error: cannot write the reference: {getattr(e, 'strerror', None) or e}")
    click.echo(f"wrote {out}")


def _list_terminal(entries) -> None:
    from rich.console import Console
    from rich.text import Text

    from composer import registry
    from composer.lang import reference

    # the width from this process's COLUMNS as it is now: rich's Console reads a mapping it captured when first
    # imported, which a library that rebinds os.environ (seen in the test suite) leaves stale
    columns = os.environ.get("COLUMNS", "")
    console = Console(highlight=False, width=int(columns) if columns.isdigit() and int(columns) > 0 else None)
    if entries is None:
        reference.render_overview(console)
    for e in entries or []:
        reference.render_entry(console, e)
    for err in registry.PLUGIN_ERRORS:
        line = Text("warning: ", style="yellow")
        line.append(err)
        console.print(line)


@main.command()
@click.option("--out", default=None, help="Output file (default: schemas/spec.schema.json of this checkout).")
@click.option("--with-plugins", is_flag=True, help="Include the kinds of installed plugins (the committed schema "
              "covers built-in kinds only).")
def schema(out, with_plugins):
    """Write the JSON Schema (2020-12) of the spec language, generated from the component registry."""
    from composer.lang.schema import write_schema

    if with_plugins and not out:
        _fail("error: --with-plugins needs --out (the committed schemas/spec.schema.json covers built-in kinds only)")
    _refuse_shadowing_plugins()
    try:
        path = write_schema(Path(out) if out else None, builtins_only=not with_plugins)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        _fail(f"{out!r}: error: cannot write the schema: {getattr(e, 'strerror', None) or e}")
    click.echo(f"wrote {path}")


def _register_optional_commands():
    """Commands whose modules only load when they run (they import torch)."""
    from composer.cli import run as cli_run  # noqa: F401
    from composer.cli import compile as cli_compile  # noqa: F401
    from composer.cli import eval as cli_eval  # noqa: F401
    from composer.cli import check as cli_check  # noqa: F401


try:
    _register_optional_commands()
except ImportError:
    pass


if __name__ == "__main__":  # `python -m composer.cli.main`: use the imported module, where every command registered
    from composer.cli.main import main as _main

    _main()
