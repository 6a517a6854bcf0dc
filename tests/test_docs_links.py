"""README.md and docs/: the front page stays a front page, and nothing they name is dead or stale.

Checked on README.md and docs/**/*.md: every relative markdown link resolves to a file (and a `#anchor` to a
heading of that file, as GitHub slugs it); every `composer SUBCOMMAND` in code is a subcommand of the CLI, with
options that subcommand has, and every `composer list ARG` is one `composer list` knows; every `make TARGET` is a
Makefile target; every `specs/...yaml` and every repository path in code exists.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 400

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SPAN = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)  # a span ends with its paragraph


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _code_blocks(text: str) -> list[str]:
    """Fenced blocks, and indented (4-space) blocks that follow a blank line outside lists."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    rest = FENCE.sub("", text)
    cur: list[str] = []
    prev_blank = True
    for line in rest.splitlines():
        if line.startswith("    ") and (cur or prev_blank) and not re.match(r"\s*([-*]|\d+\.)\s", line):
            cur.append(line[4:])
        else:
            if cur:
                blocks.append("\n".join(cur))
                cur = []
        prev_blank = not line.strip()
    if cur:
        blocks.append("\n".join(cur))
    return blocks


def _prose(text: str) -> str:
    """The text outside fenced blocks, with inline code blanked (links inside code are not links)."""
    text = FENCE.sub("", text)
    return SPAN.sub(lambda m: " " * len(m.group(0)), text)


def _spans(text: str) -> list[str]:
    return [m.group(2) for m in SPAN.finditer(FENCE.sub("", text))]


def _code(text: str) -> list[str]:
    """Every piece of code on a page: inline spans, and code blocks line by line (continuations joined)."""
    out = [s.strip() for s in _spans(text)]
    for b in _code_blocks(text):
        out += [ln.strip() for ln in b.replace("\\\n", " ").splitlines()]
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE.sub("", page.read_text()), re.MULTILINE):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(page.read_text()))]


def test_the_readme_is_a_front_page():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move the detail to docs/"


def test_the_readme_links_every_docs_page():
    named = {(README.parent / t.split("#")[0]).resolve() for t in links(README) if not re.match(r"\w+:", t)}
    missing = [_rel(p) for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in named]
    assert not missing, f"README.md's 'Read on' does not link {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_resolves(page):
    dead = []
    for target in links(page):
        if re.match(r"[a-z][\w+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            dead.append(f"{target}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
            dead.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    assert not dead, f"{_rel(page)}: dead links:\n" + "\n".join(dead)


def test_anchor_slugs_follow_github():
    assert slug("Comparing methods: `composer bench`") == "comparing-methods-composer-bench"
    assert slug("The field's methods by their data flow (`specs/methods/`)") == \
        "the-fields-methods-by-their-data-flow-specsmethods"
    assert slug("Engines: hf and vLLM") == "engines-hf-and-vllm"


# ------------------------------------------------------------------------------------------- commands

def _cli():
    from composer.cli.main import main

    return main


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """(subcommand, its arguments) for every `composer SUBCOMMAND ...` in the page's code."""
    out = []
    for piece in _code(text):
        for m in re.finditer(r"(?:^|[\s(=;&|])composer[ \t]+([a-z][\w-]*)(.*)", piece):
            rest = re.split(r"\s#|;|&&|\s\|\s|`", m.group(2))[0]
            out.append((m.group(1), rest.split()))
    return out


def _throughput_options() -> set[str]:
    """`composer bench --throughput` hands its other arguments to the throughput parser: its options."""
    import contextlib
    import io

    from composer.bench import throughput

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        throughput.parse_args(["--help"])
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", buf.getvalue()))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_composer_command_named_is_real(page):
    main = _cli()
    bad = []
    for name, args in _commands(page.read_text()):
        cmd = main.commands.get(name)
        if cmd is None:
            bad.append(f"composer {name}: no such subcommand (composer --help lists {sorted(main.commands)})")
            continue
        opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
        if name == "bench" and any(a.strip("[]") == "--throughput" for a in args):
            opts |= _throughput_options()
        for a in args:
            flag = re.match(r"\[?(--?[a-zA-Z][\w-]*)", a)
            if flag and flag.group(1) not in opts:
                bad.append(f"composer {name} {' '.join(args)}: `{flag.group(1)}` is no option of `composer {name}`")
    assert not bad, f"{_rel(page)}: stale commands:\n" + "\n".join(bad)


def test_every_composer_list_argument_is_known():
    from click.testing import CliRunner

    main = _cli()
    args = set()
    for page in PAGES:
        for name, rest in _commands(page.read_text()):
            if name == "list" and rest and re.fullmatch(r"[a-z_]+(/[a-z_]+)?", rest[0]):
                args.add(rest[0])
    assert args, "the docs name no `composer list KEY`: the pattern is broken"
    runner = CliRunner()
    bad = {a: r.output[-300:] for a in sorted(args) if (r := runner.invoke(main, ["list", a])).exit_code != 0}
    assert not bad, f"`composer list ARG` named in the docs that composer does not know: {bad}"


def test_every_make_target_named_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+)[ \t]*:(?!=)", makefile, re.MULTILINE))
    bad = []
    for page in PAGES:
        for piece in _code(page.read_text()):
            for m in re.finditer(r"(?:^|[\s;&|])make[ \t]+([a-z][\w-]*)", piece):
                if m.group(1) not in targets:
                    bad.append(f"{_rel(page)}: make {m.group(1)} (the Makefile has {sorted(targets)})")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------------- paths

REPO_DIRS = ("specs/", "schemas/", "composer/", "components/", "examples/", "tests/", "docs/")


def _paths(text: str) -> set[str]:
    out = set()
    for piece in _code(text):
        for word in re.findall(r"[\w./-]+", piece):
            word = word.split("::")[0].rstrip(".,:;")
            word = re.sub(r"^(\.\./)+", "", word)
            if word.startswith(REPO_DIRS) and not re.search(r"[*{}<>]|\.\.\.", word):
                out.add(word)
    return out


def test_the_pattern_finds_paths():
    found = _paths(README.read_text())
    assert "specs/mintrl.yaml" in found and "docs/reference.md" in found


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_spec_and_repository_path_named_exists(page):
    text = page.read_text()
    missing = [p for p in sorted(_paths(text)) if not (ROOT / p).exists()]
    # spec paths are also named outside code (a table's column, a sentence)
    missing += [p for p in sorted(set(re.findall(r"(?<![\w/.-])specs/[\w./-]+\.yaml", _prose(text))))
                if not (ROOT / p).exists() and p not in missing]
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


def test_the_methods_tables_name_existing_specs():
    """The README's method tables name specs relative to specs/ (`sft.yaml`, `methods/dapo.yaml`)."""
    rows = [ln for ln in README.read_text().splitlines() if ln.startswith("| ")]
    named = [m for ln in rows for m in re.findall(r"\| `((?:[\w-]+/)?[\w-]+\.yaml)` \|", ln)]
    assert len(named) >= 9 + 12 + 6, named
    missing = [n for n in named if not (ROOT / "specs" / n).exists()]
    assert not missing, f"README's methods tables name specs that do not exist: {missing}"


def test_shlex_splits_the_documented_commands():
    """Every `composer ...` line in a README/docs code block is well-formed shell (no unbalanced quotes)."""
    bad = []
    for page in PAGES:
        for b in _code_blocks(page.read_text()):
            for ln in b.replace("\\\n", " ").splitlines():
                if re.match(r"\s*(\w+=\S+\s+)*composer\s", ln):
                    try:
                        shlex.split(ln, comments=True)
                    except ValueError as e:
                        bad.append(f"{_rel(page)}: {ln!r}: {e}")
    assert not bad, "\n".join(bad)
