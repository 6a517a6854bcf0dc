"""`composer compile`: write a launch bundle for a backend (heavy imports happen only when it runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from composer.cli import EXIT_INVALID, allow_plugins_option, main, validated_or_exit


@main.command("compile")
@click.argument("spec")
@click.argument("overrides", nargs=-1)
@click.option("--backend", type=click.Choice(["openrlhf"]), default="openrlhf", show_default=True)
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Bundle folder to write.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="Ray nodes.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True, help="GPUs per node.")
@click.option("--colocate/--no-colocate", default=True, show_default=True,
              help="Colocate vLLM engines, actor and reference on the same GPUs (sleep mode).")
@click.option("--vllm-engines", type=click.IntRange(min=1), default=None,
              help="vLLM engines without colocation (default 1); with it: GPUs / tensor_parallel_size.")
@click.option("--cluster-dir", default="/tmp/composer-runs", show_default=True,
              help="Folder on the cluster for checkpoints, final models and logs (a subfolder per spec).")
@click.option("--wandb-project", default=None, help="Log to this W&B project (key from $WANDB_API_KEY at launch).")
@allow_plugins_option
def compile_(spec, overrides, backend, out, nodes, gpus_per_node, colocate, vllm_engines, cluster_dir, wandb_project):
    """Compile SPEC into a launch bundle for BACKEND in --out. OVERRIDES: path.to.field=value."""
    from composer.backends.openrlhf.bundle import BundleError, compile_bundle
    from composer.backends.openrlhf.flags import Layout, Unsupported
    from composer.errors import dotted

    v = validated_or_exit(spec, overrides)
    layout = Layout(nodes=nodes, gpus_per_node=gpus_per_node, colocate=colocate, vllm_engines=vllm_engines,
                    cluster_dir=f"{cluster_dir.rstrip('/')}/{v.spec.name}", wandb_project=wandb_project)
    try:
        compile_bundle(v, Path(out), layout)
    except Unsupported as e:
        where = v.loaded.locate(e.path) if e.path else None
        click.echo(f"{where or spec}: error: {dotted(e.path) or 'spec'}: OpenRLHF cannot express this: {e.reason}"
                   + (f"\n    hint: {e.hint}" if e.hint else ""), err=True)
        sys.exit(EXIT_INVALID)
    except (BundleError, ImportError) as e:
        click.echo(f"{spec}: error: {e}", err=True)
        sys.exit(EXIT_INVALID)
    click.echo(f"wrote {out} (README.md says what it does; ./launch.sh [HEAD_ADDRESS] submits it)")
