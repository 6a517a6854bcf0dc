"""`composer check SPEC [overrides...]`: the conformance referee on a short recorded run (composer/referee)."""

from __future__ import annotations

import sys
import tempfile

import click

from composer.cli.main import EXIT_INVALID, allow_plugins_option, main, split_args, validated_or_exit


@main.command()
@click.argument("spec")
@click.argument("overrides", nargs=-1)
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Folder for the short run (default: a temporary one).")
@click.option("--as-declared", is_flag=True, help="Run the spec with the given overrides only (not shortened: its full length).")
@click.option("--coverage", is_flag=True, help="Also print every part the spec declares, the reference in its own file that checks it, and whether the run exercised it.")
@allow_plugins_option
def check(spec, overrides, out, as_declared, coverage):
    """Run SPEC for a few steps on the toy testbed (or as declared) and recompute what trained from the spec and the
    recorded inputs: gates, control rows, filters, temperatures, KL, teachers, references, advantages, losses and
    gradients. Prints a table of checks; exit 0 if all pass, 1 if one fails, 2 on bad input."""
    from composer.errors import SpecError
    from composer.referee import referee, short

    files, given = split_args((spec,) + tuple(overrides))
    if len(files) != 1:
        click.echo(f"error: one spec file expected, got {len(files)}: {' '.join(files)}", err=True)
        sys.exit(EXIT_INVALID)
    validated_or_exit(files[0], given)
    try:
        if not as_declared:
            short(files[0], given)  # the shortened spec must validate too
    except SpecError as e:
        click.echo(str(e), err=True)
        sys.exit(EXIT_INVALID)
    with tempfile.TemporaryDirectory(prefix="composer-check-") as tmp:
        rep = referee(files[0], out or tmp, given, as_declared=as_declared)
    click.echo(rep.table())
    if coverage:
        from composer.referee.coverage import table

        click.echo("")
        click.echo(table(rep.v, rep))
    sys.exit(0 if rep.ok else 1)
