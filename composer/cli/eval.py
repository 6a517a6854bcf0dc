"""`composer eval`: evaluate a checkpoint, a run folder or an exported model alone (composer/runtime/evaluate.py)."""

from __future__ import annotations

import sys

import click

from composer.cli.main import EXIT_INVALID, main


@main.command("eval")
@click.argument("target", type=click.Path(exists=True))
@click.argument("overrides", nargs=-1)
@click.option("--data", default=None, help="Evaluation data file (jsonl, json, csv, parquet, a `datasets` folder); "
                                            "default: the run's data.eval. Needed for a model directory alone.")
@click.option("--k", "k", type=click.IntRange(0, 1024), default=None,
              help="Also sample k answers per problem and report the unbiased pass@k (train.eval_k).")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Folder for eval.json and eval_samples.jsonl (default: eval/ in the run folder).")
def eval_(target, overrides, data, k, out):
    """Evaluate TARGET (a checkpoint, a run folder, or an exported model directory) as a run's evaluation
    does: greedy pass@1 per tier with the spec's verifier, and pass@k with --k. OVERRIDES: path.to.field=value."""
    from composer.cli.run import _failure

    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # the eval's own lines say where it is
        transformers.utils.logging.set_verbosity_error()
        from composer.runtime.evaluate import evaluate_target

        metrics, folder = evaluate_target(target, data=data, k=k, out=out, overrides=list(overrides))
    except Exception as e:  # every failure is a message and exit 2, never a traceback
        from composer.errors import SpecError
        from composer.runtime.evaluate import EvalError

        if isinstance(e, SpecError):
            from composer.cli.main import with_override_hints

            e = with_override_hints(e, list(overrides))
        click.echo(f"error: {e if isinstance(e, (EvalError, SpecError)) else _failure(e)}", err=True)
        sys.exit(EXIT_INVALID)
    for key, val in sorted(metrics.items()):
        click.echo(f"  {key}: {val:.3f}")
    click.echo(f"evaluation: {folder / 'eval.json'}, generations: {folder / 'eval_samples.jsonl'}")
