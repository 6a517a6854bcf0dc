"""Files a run keeps are replaced whole or not at all: written to a temporary sibling, then renamed.

Nothing is ever written through a symbolic link: a file the tool would write (a run folder's metrics.csv,
samples, report, checkpoint, an export's or a bundle's files) that is a link is refused (`LinkError`, an
OSError: the commands print `PATH: why` and exit 2), and the file it points to is left as it is.

A folder the tool writes into (`composer compile --out`, `composer export --out`) may hold the user's files
beside an earlier output: `replace_into` replaces only the files the earlier output's manifest records as the
tool's (`files`), and keeps everything else.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


class LinkError(OSError):
    """A file the tool would write (or a folder on its way) is a symbolic link: refused, never followed."""


class FolderError(Exception):
    """An output folder whose files are not all the tool's to replace: says which, and how to fix it."""


def refuse_link(path: Path | str) -> None:
    """Raise LinkError when `path` is a symbolic link (writing through it would change the file it points to)."""
    if os.path.islink(path):
        raise LinkError(errno.ELOOP, "is a symbolic link, and composer never writes through one (the file it "
                        f"points to is left as it is)\n    hint: remove the link (rm {path}) and run again", str(path))


@contextlib.contextmanager
def atomic_path(path: Path | str):
    """Yield a temporary path next to `path` (same suffix, so writers that go by it still work); on success
    it replaces `path` in one rename, on any failure it is removed and `path` is left as it was. A `path`
    that is a symbolic link is refused (LinkError); the temporary file is new (O_EXCL), so no link is followed."""
    path = Path(path)
    refuse_link(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600: give it the mode a plain open() would
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text(path: Path | str, text: str) -> None:
    """`path` holds `text`, or (on a full disk, a kill) what it held before."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def open_append(path: Path | str, text: bool = False, **kw):
    """`path` opened to append (created if absent), never through a symbolic link (LinkError) and only when it
    is a regular file: a run's metrics.csv, samples.jsonl and eval_samples.jsonl grow only inside the run
    folder. `text`: a text file (`kw` go to it: encoding, newline), else binary."""
    if os.path.lexists(path) and not os.path.islink(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file (remove it and run again)", str(path))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path)
        raise
    return os.fdopen(fd, "a" if text else "ab", **kw)


def open_new(path: Path | str):
    """`path` made afresh for writing (binary), for a temporary file of the tool's own name (last.ckpt.tmp):
    whatever is there is removed first (what a killed write left, or a link: the link itself, never what it
    points to), then the file is created exclusively, so nothing is written through a link."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "wb")


def links_in(folder: Path | str, skip: tuple[str, ...] = ()) -> list[str]:
    """Every symbolic link in `folder` and its subfolders (not followed), as paths relative to it. The insides
    of the top-level folders named in `skip` are not looked at (W&B links its own files inside wandb/)."""
    top, found = os.fspath(folder), []
    for root, dirs, names in os.walk(top):
        for name in dirs + names:
            if os.path.islink(os.path.join(root, name)):
                found.append(os.path.relpath(os.path.join(root, name), top))
        if root == top:
            dirs[:] = [d for d in dirs if d not in skip]
    return sorted(found)


# ------------------------------------------------------------------------------------------ output folders


def files_under(root: Path | str) -> list[str]:
    """Every file under `root` as a relative path with `/` (a link counts as a file and is not followed)."""
    out = []
    for dirpath, dirs, names in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        links = [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]
        out += [(rel / n).as_posix() for n in names + links]
    return sorted(out)


def recorded_files(folder: Path, manifest: str) -> list[str] | None:
    """The files `folder/manifest` records as written by the tool (its `files` list); None without a
    manifest or without a list (an output of an older version). A list naming a path outside the folder
    (absolute, `..`) is a FolderError: such a manifest was not written by the tool."""
    path = folder / manifest
    if os.path.islink(path) or not path.is_file():
        return None
    try:
        listed = json.loads(path.read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(listed, list):
        return None
    for name in listed:
        if not isinstance(name, str) or not _inside(name):
            raise FolderError(f"{manifest} lists {name!r}, which is not a file inside the folder; the tool never "
                              f"writes such a list\n    hint: fix or remove {folder / manifest}, or choose a new "
                              "or empty folder")
    return listed


def _inside(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and all(p not in ("", ".", "..") for p in parts)


def _real_parents(folder: Path, rel: str, leaving: set[str] = frozenset()) -> bool:
    """Every folder between `folder` and `folder/rel` is a real folder (no link on the way, and no file but
    one of `leaving`, the tool's old files that are removed first)."""
    at = folder
    for part in rel.split("/")[:-1]:
        at = at / part
        if os.path.islink(at) or (os.path.lexists(at) and not at.is_dir()
                                  and at.relative_to(folder).as_posix() not in leaving):
            return False
    return True


def replace_into(staged: Path, folder: Path, manifest: str, record: dict,
                 legacy: Callable[[str], bool] = lambda rel: False) -> None:
    """Move the output written into `staged` into `folder`, keeping every file of `folder` the tool did not
    write. The tool's files are those `folder/manifest` lists (an output of an older version, with no list:
    those `legacy(rel)` accepts and those the new output writes too). They are replaced or removed; a file
    of the new output whose path holds a file that is not the tool's refuses it all (FolderError, nothing
    changed). `folder/manifest` ends up as `record` plus the new output's `files`.

    `folder` absent or empty: `staged` is renamed into place (whole or not at all)."""
    if folder.is_symlink():
        raise FolderError("it is a symbolic link; give the real folder")
    new = [f for f in files_under(staged) if f != manifest]
    if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
        write_text(staged / manifest, _manifest(record, new + [manifest]))
        if folder.exists():
            folder.rmdir()
        os.rename(staged, folder)
        return
    listed = recorded_files(folder, manifest)
    if listed is None:
        listed = [f for f in files_under(folder) if f in new or legacy(f)]
    ours = set(listed) | {manifest}
    leaving = ours - set(new) - {manifest}
    clash = [f for f in new if not _real_parents(folder, f, leaving) or (os.path.lexists(folder / f) and (
        f not in ours or (folder / f).is_dir() and not os.path.islink(folder / f)))]
    if clash:
        shown = ", ".join(clash[:5]) + (", ..." if len(clash) > 5 else "")
        raise FolderError(f"the folder holds files the tool did not write, where the new output goes ({shown}); "
                          "nothing was changed\n    hint: move them away, or choose a new or empty folder")
    # first the manifest lists the old files and the new: a write cut short leaves every file the tool wrote listed
    write_text(folder / manifest, _manifest(record, ours | set(new)))
    for f in sorted(leaving):
        _remove(folder, f)
    for f in new:
        (folder / f).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged / f, folder / f)
    write_text(folder / manifest, _manifest(record, new + [manifest]))


def _manifest(record: dict, names) -> str:
    return json.dumps({**record, "files": sorted(set(names))}, indent=1) + "\n"


def _remove(folder: Path, rel: str) -> None:
    """Remove the tool's old file `folder/rel` (the link itself when it is one, never a folder), then each
    folder on its way that it leaves empty."""
    path = folder / rel
    if not _real_parents(folder, rel) or not os.path.lexists(path) or (path.is_dir() and not path.is_symlink()):
        return
    path.unlink()
    at = path.parent
    while at != folder:
        try:
            at.rmdir()  # only an empty folder
        except OSError:
            return
        at = at.parent
