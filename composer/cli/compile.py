"""`composer compile`: write a launch bundle for a backend (heavy imports happen only when it runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from composer.cli.main import EXIT_INVALID, allow_plugins_option, main, validated_or_exit
from composer.errors import SpecError


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
    from composer.backends.openrlhf import parser
    from composer.backends.openrlhf.bundle import BundleError, compile_bundle
    from composer.backends.openrlhf.flags import Layout, Unsupported
    from composer.errors import dotted

    v = validated_or_exit(spec, overrides)
    from composer.runtime.paths import custom_code_problems

    code = custom_code_problems(v)  # a folder here with its own code: OpenRLHF would load the built-in class
    if code:
        click.echo("\n".join(f"{spec}: error: {field}: {why}" for field, why in code), err=True)
        sys.exit(EXIT_INVALID)
    absolute = local_model_paths(v)
    if absolute:  # a relative model folder would resolve against the bundle on the cluster: pinned here
        v = validated_or_exit(spec, list(overrides) + absolute)
    layout = Layout(nodes=nodes, gpus_per_node=gpus_per_node, colocate=colocate, vllm_engines=vllm_engines,
                    cluster_dir=f"{cluster_dir.rstrip('/')}/{v.spec.name}", wandb_project=wandb_project)
    folder = Path(out)
    try:
        parser.require()  # before anything is written
        _check_out(folder)
        _compile_into(folder, lambda tmp: compile_bundle(v, tmp, layout))
    except Unsupported as e:
        e.path = written_path(v.loaded, e.path)
        where = v.loaded.locate(e.path) if e.path else None
        click.echo(f"{where or spec}: error: {dotted(e.path) or 'spec'}: OpenRLHF cannot express this: {e.reason}"
                   + (f"\n    hint: {e.hint}" if e.hint else ""), err=True)
        sys.exit(EXIT_INVALID)
    except (BundleError, ImportError, SpecError) as e:
        click.echo(f"{spec}: error: {e}", err=True)
        sys.exit(EXIT_INVALID)
    except OutFolderError as e:
        click.echo(f"{out}: error: {e}", err=True)
        sys.exit(EXIT_INVALID)
    except (OSError, ValueError) as e:  # an --out under /proc, a file, a name too long, a full disk
        click.echo(f"{out}: error: cannot write the bundle: {getattr(e, 'strerror', None) or e}", err=True)
        sys.exit(EXIT_INVALID)
    except Exception as e:  # every failure is a message and exit 2, never a traceback
        from composer.cli.run import _failure

        click.echo(f"{spec}: error: {_failure(e)}", err=True)
        sys.exit(EXIT_INVALID)
    click.echo(f"wrote {out} (README.md says what it does; ./launch.sh [HEAD_ADDRESS] submits it)")


def written_path(loaded, path: tuple) -> tuple:
    """The path of a refused setting as the file writes it: a stage's or phase's (`stages[1].train...`) when that
    segment wrote it, else the top level's (a top-level `rollout` inherited by `stages[0]` is `rollout...`)."""
    from composer.checks.validate import _exists, _in_segment

    path = tuple(path or ())
    if len(path) > 2 and path[0] in ("stages", "phases") and isinstance(path[1], int):
        origin, rest = path[:2], path[2:]
        if not _in_segment(loaded, origin, rest) and _exists(loaded.data, rest[:1]):
            return rest
    return path


def local_model_paths(v) -> list[str]:
    """Overrides that make every relative model or tokenizer path that exists here absolute (`policy.model`,
    `policy.tokenizer`, a policy_model source's `model`); hub ids and absolute paths stay as they are."""
    import json
    import os

    def pinned(field: str, name) -> list[str]:
        if not isinstance(name, str) or not name or name.startswith("toy:") or name == "self" or os.path.isabs(name):
            return []
        if not os.path.exists(name):
            return []
        return [f"{field}={json.dumps(os.path.abspath(name))}"]

    spec = v.spec
    out = pinned("policy.model", spec.policy.model) + pinned("policy.tokenizer", spec.policy.tokenizer)
    for name, src in spec.sources.items():
        if getattr(src, "kind", None) == "policy_model":
            out += pinned(f"sources.{name}.model", getattr(src, "model", None))
    return out


def _compile_into(folder: Path, write) -> None:
    """Write the bundle into a staging folder beside --out, then move it in only when it is whole: a refused or
    failed compile leaves --out as it was. Into an earlier bundle, only the files that bundle's manifest lists
    (an older bundle without one: the bundle's own names, `legacy_file`) are replaced or removed; the user's
    files beside them are kept, and one at a path the new bundle writes refuses it all (OutFolderError)."""
    import os
    import shutil

    from composer import files
    from composer.backends.openrlhf.bundle import MANIFEST, legacy_file

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        files.replace_into(tmp, folder, MANIFEST, {"written_by": "composer", "kind": "openrlhf bundle"},
                           legacy=legacy_file)
    except files.FolderError as e:
        raise OutFolderError(str(e)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_out(folder: Path) -> None:
    """--out is new, empty, or an earlier bundle (whose files compiling again replaces, keeping the user's files
    beside them); a folder of other files, or a link, is refused before anything is written."""
    from composer import files
    from composer.backends.openrlhf.bundle import MANIFEST, older_bundle

    if folder.is_symlink():
        raise OutFolderError("it is a symbolic link; give the real folder")
    if not folder.exists():
        return
    if not folder.is_dir():
        raise NotADirectoryError(20, "not a directory", str(folder))
    names = {p.name for p in folder.iterdir()}
    try:
        listed = files.recorded_files(folder, MANIFEST)
    except files.FolderError as e:
        raise OutFolderError(str(e)) from None
    if names and listed is None and not older_bundle(folder):
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        raise OutFolderError(f"the folder already holds files and is not a bundle ({shown}); compiling would "
                             "mix a bundle into them\n    hint: choose a new or empty folder (an earlier bundle's "
                             "files are replaced, files you added beside them are kept)")


class OutFolderError(Exception):
    pass
