"""The component registry: every kind of every section is declared once and found here.

A component is a pydantic config class with `kind: Literal[...]` plus its implementation, in one
file, registered under its section with `@register("objective")`. The spec's tagged unions, the JSON
Schema and `composer list` are all built from this registry. Third-party packages register through
the `composer.components` entry-point group (each entry point names a module to import).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import types
import typing
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from composer.capabilities import Capable

SECTIONS = ("sources", "guide", "signal", "objective", "estimator", "token_selection", "off_policy_weight",
            "correction", "environment")
ENTRY_POINT_GROUP = "composer.components"
ALLOW_PLUGINS_ENV = "COMPOSER_ALLOW_PLUGINS"
TRUST_REMOTE_CODE_ENV = "COMPOSER_TRUST_REMOTE_CODE"
ENTRY_POINT_MODULES: set[str] = set()  # the modules installed entry points name (the user installed them)

_REGISTRY: dict[str, dict[str, type["Component"]]] = {s: {} for s in SECTIONS}
VERIFIERS: dict[str, "VerifierInfo"] = {}
_LOADED = {"builtins": False, "entry_points": False}
PLUGIN_ERRORS: list[str] = []
SPEC_PLUGIN_ERRORS: list[str] = []  # the subset a spec's `plugins:` caused (reported as that spec's warnings)
# The trust boundary of names: a plugin adds kinds and verifiers, it never replaces a built-in one (a plugin's
# `grpo` or `math` would run instead of the one the spec's reader expects, and `composer check` would vouch for
# it). Each refused registration is kept here under the plugin module being loaded, and is an error (exit 2)
# wherever that plugin is loaded: every command for an installed entry point, the spec for a `plugins:` module.
REFUSED: dict[str, list[str]] = {}  # plugin module -> why its registrations were refused
_LOADING = {"module": "", "label": ""}  # the plugin being imported now (set by `loading_plugin`)


def _scalar_types(annotation) -> set:
    """The scalar types an annotation takes at its top level; {object} when it takes anything (Any)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _scalar_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_scalar_types(a) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return {type(a) for a in typing.get_args(annotation)}
    if annotation in (int, float, bool, str, type(None)):
        return {annotation}
    if origin is not None or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return set()  # containers and models never take a bare true/false
    return {object}


def _items(annotation):
    """The item annotation of a list / the value annotation of a dict (Optional unwrapped), else None."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _items(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _items(inner[0]) if len(inner) == 1 else None
    if origin in (list, dict):
        return typing.get_args(annotation)[-1]
    return None


class _Boolean:
    """Stands in for a YAML true/false given where a number is meant: no number validator accepts it,
    so pydantic reports the field itself ("Input should be a valid integer, got true")."""

    def __init__(self, value: bool):
        self.value = value

    def __repr__(self) -> str:
        return "true" if self.value else "false"


def refuse_bool_numbers(value: Any, annotation) -> Any:
    """`value` with every true/false where `annotation` means a number replaced by a _Boolean (which fails).

    pydantic's lax mode would read `steps: true` as 1 and `lr: false` as 0.0.
    """
    def fix(v, ann):
        kinds = _scalar_types(ann)
        return _Boolean(v) if isinstance(v, bool) and kinds & {int, float} and not kinds & {bool, object} else v

    inner = _items(annotation)
    if inner is not None and isinstance(value, list):
        return [fix(v, inner) for v in value]
    if inner is not None and isinstance(value, dict):
        return {k: fix(v, inner) for k, v in value.items()}
    return fix(value, annotation)


class NumbersNotBooleans:
    """Mixin for spec models: every field that takes numbers refuses booleans (YAML `true`, `false`), and every
    float field refuses infinity and nan (`.inf`, `.nan`, the strings "inf", "nan", "-inf"), which mean nothing as
    a setting. A field where infinity is a documented value opts in with `Field(allow_inf_nan=True)` (the allow-list
    is tests/test_spec_numbers.py's INFINITY_ALLOWED); its bounds (ge=0) still refuse nan and -inf.

    The config is inherited by every model built on the mixin: the spec's sections, every registered component
    (plugins' too), schedules."""

    model_config = ConfigDict(allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _numbers_not_booleans(cls, data):
        if not isinstance(data, dict):
            return data
        fields = {f.alias or n: f for n, f in cls.model_fields.items()}
        return {k: refuse_bool_numbers(v, fields[k].annotation) if k in fields else v for k, v in data.items()}


class Component(Capable, NumbersNotBooleans, BaseModel):
    """Base of every component config.

    Class-level data (not spec fields):
      needs / provides: port names, the graph layer checks that every need is provided.
      refs: field name -> source kinds the named source(s) may have (an edge in the graph).
    `capabilities()` (composer/capabilities.py): on-policy only, exact origins, the backend features its
    configuration needs; a component that declares nothing gets the safe defaults (on-policy only, no feature).
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=False)

    section: ClassVar[str] = ""
    needs: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()
    refs: ClassVar[dict[str, tuple[str, ...]]] = {}
    plugin: ClassVar[str] = ""  # the distribution/module that registered it, empty for built-ins

    @classmethod
    def kind_name(cls) -> str:
        return cls.model_fields["kind"].default

    @classmethod
    def summary(cls) -> str:
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    def ref_names(self) -> dict[str, list[str]]:
        """The source names this component refers to, per reference field."""
        out = {}
        for field in self.refs:
            value = getattr(self, field, None)
            if value is None:
                continue
            names = value if isinstance(value, list) else [value]
            out[field] = [n for n in names if isinstance(n, str)]
        return out


def _builtin_module(module: str) -> bool:
    """`module` is part of the built-in component library (the `components` package)."""
    return module == "components" or module.startswith("components.")


def _where(obj) -> tuple[str, str]:
    """Where a class or function is defined: its module and qualified name (a module reloaded keeps both)."""
    return obj.__module__, obj.__qualname__


def _refuse(module: str, what: str, item: str) -> None:
    """Record that the plugin being loaded (else `module`) tried to register the built-in name `what`."""
    key = _LOADING["module"] or module
    label = _LOADING["label"] or f"plugin module '{module}'"
    REFUSED.setdefault(key, []).append(
        f"{label} registers {what}, which is built in; a plugin adds names, choose another "
        f"{'verifier' if what.startswith('verifier') else 'kind'} name ({item} of {module} was not registered)")


@contextlib.contextmanager
def loading_plugin(module: str, label: str):
    """While a plugin module is imported: refusals are filed under `module` and name the plugin as `label`."""
    before = dict(_LOADING)
    _LOADING.update(module=module, label=label)
    try:
        yield
    finally:
        _LOADING.update(before)


def refusals(module: str) -> list[str]:
    """Why the plugin module `module` (or a module inside it) could not register what it tried to."""
    return [msg for key, msgs in REFUSED.items() if key == module or key.startswith(module + ".") for msg in msgs]


def entry_point_refusals() -> list[str]:
    """What installed entry-point plugins tried to replace: an error for every command that loads them."""
    load_entry_points()
    return [msg for m in sorted(ENTRY_POINT_MODULES) for msg in refusals(m)]


def register(section: str, plugin: str = "") -> Callable[[type[Component]], type[Component]]:
    if section not in SECTIONS:
        raise ValueError(f"unknown section {section!r}; sections are {SECTIONS}")

    def deco(cls: type[Component]) -> type[Component]:
        cls.section = section
        cls.plugin = plugin or ("" if _builtin_module(cls.__module__) else cls.__module__)
        existing = _REGISTRY[section].get(cls.kind_name())
        if existing is not None and not existing.plugin and _where(existing) != _where(cls):
            # a plugin may add kinds, never replace a built-in one (a class of the same name included)
            _refuse(cls.__module__, f"kind '{cls.kind_name()}' of {section}", f"class {cls.__qualname__}")
            return cls
        _REGISTRY[section][cls.kind_name()] = cls
        return cls

    return deco


class VerifierInfo:
    def __init__(self, name: str, module: str, attr: str, description: str, check: str = "", preflight: str = ""):
        self.name, self.module, self.attr, self.description = name, module, attr, description
        self.check, self.preflight = check, preflight

    def load(self) -> Callable:
        return getattr(importlib.import_module(self.module), self.attr)

    def answer_problem(self, example) -> str | None:
        """Why this verifier cannot read `example`'s answer (its `check`), or None (also without a check)."""
        return getattr(importlib.import_module(self.module), self.check)(example) if self.check else None

    def run_preflight(self) -> None:
        """What must hold on this machine before a run uses the verifier (a sandbox); raises when it does not."""
        if self.preflight:
            getattr(importlib.import_module(self.module), self.preflight)()


def register_verifier(name: str, description: str, check: str = "", preflight: str = ""):
    """Register `fn(response_text, example) -> VerifierResult` as `verifier: name`.

    check: the name of a function of the same module, `check(example) -> reason or None`, that says why a
    dataset row's answer cannot be read by this verifier (data binding refuses or skips the row);
    preflight: the name of a function of the same module run before any training (raises when the
    machine lacks what the verifier needs). Registration stores only where the functions live, so that
    naming a verifier in a spec never imports what it needs (math-verify, a sandbox) during validation.
    """

    def deco(fn):
        existing = VERIFIERS.get(name)
        if existing is not None and _builtin_module(existing.module) and (existing.module, existing.attr) != \
                (fn.__module__, fn.__name__):  # a plugin adds verifiers, never replaces a built-in one
            _refuse(fn.__module__, f"verifier '{name}'", f"function {fn.__name__}")
            return fn
        VERIFIERS[name] = VerifierInfo(name, fn.__module__, fn.__name__, description, check, preflight)
        return fn

    return deco


PARTS: dict[str, str] = {}  # name -> "module:attribute": the built-in testbed's parts the runtime finds by name


def register_part(name: str, target: str) -> None:
    """Declare `target` ("module:attribute") as the part `name` (the toy testbed's task, checkpoints, data
    writer, templates): the runtime and the backends look parts up here by name, so they never import the
    component library, and the target is imported only when it is used (validation stays light)."""
    PARTS[name] = target


def part(name: str):
    """The object registered as part `name` (imported now); KeyError naming the known parts otherwise."""
    load_builtins()
    if name not in PARTS:
        raise KeyError(f"part '{name}' is not registered (known: {', '.join(sorted(PARTS))})")
    module, attr = PARTS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def load_builtins() -> None:
    if not _LOADED["builtins"]:
        _LOADED["builtins"] = True
        importlib.import_module("components")


def load_entry_points() -> None:
    if _LOADED["entry_points"]:
        return
    load_builtins()  # first: a plugin's attempt to replace a built-in name is then seen and refused
    _LOADED["entry_points"] = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        module = ep.value.split(":")[0].strip()
        ENTRY_POINT_MODULES.add(module)
        try:
            with loading_plugin(module, f"plugin {ep.name} (entry point {ep.name} = {ep.value})"):
                ep.load()
        except Exception as e:  # a broken plugin must not break validation of every spec
            PLUGIN_ERRORS.append(f"plugin {ep.name} ({ep.value}) failed to load: {type(e).__name__}: {e}")


_SPEC_PLUGINS = {"allowed": None}  # None: the environment decides


def allow_spec_plugins(allowed: bool | None) -> None:
    """Whether the modules a spec names in `plugins:` may be imported (the CLI's --allow-plugins)."""
    _SPEC_PLUGINS["allowed"] = allowed


def spec_plugins_allowed() -> bool:
    """Importing a spec-named module runs its code, so it is the user's explicit choice: --allow-plugins or
    COMPOSER_ALLOW_PLUGINS=1. Installed entry-point plugins are the user's own choice already."""
    if _SPEC_PLUGINS["allowed"] is not None:
        return _SPEC_PLUGINS["allowed"]
    return _env_on(ALLOW_PLUGINS_ENV)


# The trust boundary: what runs code (a spec's `plugins:`, a model folder's own Python) is the choice of the
# person running the command, on the command line (--allow-plugins, --trust-remote-code) or in the
# environment. Nothing a spec, a model folder, a checkpoint or a run folder says can turn either on.
_REMOTE_CODE = {"allowed": None}  # None: the environment decides


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def allow_remote_code(allowed: bool | None) -> None:
    """Whether a model folder's own Python may run (the CLI's --trust-remote-code)."""
    _REMOTE_CODE["allowed"] = allowed


def remote_code_allowed() -> bool:
    """A spec's `trust_remote_code: true` takes effect only with --trust-remote-code or
    COMPOSER_TRUST_REMOTE_CODE=1; without them such a spec is refused."""
    if _REMOTE_CODE["allowed"] is not None:
        return _REMOTE_CODE["allowed"]
    return _env_on(TRUST_REMOTE_CODE_ENV)


def installed_plugin(name: str) -> bool:
    """`name` is (inside) a module an installed `composer.components` entry point names."""
    load_entry_points()
    return any(name == m or name.startswith(m + ".") or m.startswith(name + ".") for m in ENTRY_POINT_MODULES)


def load_all() -> None:
    load_builtins()
    load_entry_points()


def kinds(section: str) -> dict[str, type[Component]]:
    load_all()
    return dict(_REGISTRY[section])


def lookup(section: str, kind: str) -> type[Component]:
    return kinds(section)[kind]
