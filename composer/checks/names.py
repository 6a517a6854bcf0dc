"""Names that travel as command-line words: the spec's name and its stages' names reach launch.sh, `ray job
submit` and the entry point's `--run NAME`, source names the named Ray actors (`composer-judge-NAME`).
Names are [a-z0-9_-]+, shell-safe, but one starting with `-` reads as an option there (`--run -x` fails at
launch, after the bundle compiled): refused at validate."""

from __future__ import annotations

from composer.checks.rules import _d, rule


def _named(spec):
    yield ("name",), spec.name
    for i, st in enumerate(spec.stages or []):
        yield ("stages", i, "name"), st.name
    for name in spec.sources or {}:
        yield ("sources", name), name


@rule("names_are_words")
def names_are_words(spec, segment):
    if segment != "base":
        return []
    return [_d("names_are_words", f"the name '{name}' starts with '-': launch.sh, `ray job submit` and the entry "
               "point's --run would read it as an option", path, f"rename it, e.g. '{name.lstrip('-') or 'x'}'")
            for path, name in _named(spec) if name.startswith("-")]
