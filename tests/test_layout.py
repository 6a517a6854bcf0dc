"""The import rules of the layout (docs/architecture.md, "Import rules"), checked on the source with `ast`.

- components/ reach the runtime only through the run context they are handed: no module of components/
  imports composer.runtime or composer.backends (not even lazily, inside a function);
- composer/ finds the toy testbed through the registry (`composer.registry.part`), never by importing
  components.tasks; only the bench harnesses, outside the core import path, may.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth (lazy imports inside functions included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def offenders(folder: str, forbidden: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel.startswith(s) for s in skip):
            continue
        for line, mod in imported_modules(path):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                bad.append(f"{rel}:{line} imports {mod}")
    return sorted(set(bad))


def test_the_walk_sees_lazy_imports(tmp_path):
    """The checker itself: an import inside a function, and `from composer import runtime`, are found."""
    (tmp_path / "m.py").write_text("def f():\n    from composer.runtime.rollout import run\n"
                                   "from composer import runtime\n")
    mods = [m for _l, m in imported_modules(tmp_path / "m.py")]
    assert "composer.runtime.rollout" in mods and "composer.runtime" in mods


def test_components_never_import_the_runtime_or_a_backend():
    assert offenders("components", ("composer.runtime", "composer.backends")) == []


def test_what_components_import_imports_no_runtime():
    """The contract side: every composer module a component imports (the contract and its vocabulary) imports
    nothing of composer.runtime or composer.backends either, so no import path leads from a component into
    the runtime."""
    used = set()
    for path in (ROOT / "components").rglob("*.py"):
        used |= {m for _l, m in imported_modules(path) if m.startswith("composer.")}
    files = {ROOT / (m.replace(".", "/") + ".py") for m in used} | {ROOT / m.replace(".", "/") / "__init__.py" for m in used}
    files = sorted(f for f in files if f.is_file())
    assert ROOT / "composer" / "contract.py" in files and ROOT / "composer" / "protocol.py" in files
    bad = [f"{f.relative_to(ROOT)}:{line} imports {mod}" for f in files for line, mod in imported_modules(f)
           if mod.startswith(("composer.runtime", "composer.backends"))]
    assert bad == []


def test_backends_import_no_component():
    """A backend drives components through the contract (composer/contract.py, components/objectives/base.py via the
    step) and the step (composer/step.py); it never imports a concrete component (the bundle only copies the
    package: `import components` for its folder)."""
    bad = [f"{p.relative_to(ROOT)}: imports {m}" for p in ROOT.joinpath("composer", "backends").rglob("*.py")
           for _l, m in imported_modules(p) if m.startswith("components.")]
    assert bad == []


def test_the_step_and_the_runtime_import_no_backend():
    """composer/step.py (the step, written once) knows no backend and no runtime: a backend hands it data and its
    forward passes; the runtime (evaluation, export, the checkpoint format) imports no backend."""
    assert offenders("composer/runtime", ("composer.backends",)) == []
    bad = [f"composer/step.py:{line} imports {m}" for line, m in imported_modules(ROOT / "composer" / "step.py")
           if m.startswith(("composer.runtime", "composer.backends"))]
    assert bad == []


def test_the_plan_imports_no_runtime():
    """The Plan is a function of the spec: composer/plan imports nothing of the runtime or a backend (what this
    machine adds, example prompts and the engine's note, is composer/runtime/example_prompts.py `machine_notes`)."""
    assert offenders("composer/plan", ("composer.runtime", "composer.backends")) == []


def test_composer_finds_the_toy_testbed_through_the_registry():
    assert offenders("composer", ("components.tasks",), skip=("composer/bench",)) == []


def test_toy_parts_are_registered_and_load():
    from composer.registry import PARTS, part

    task = part("toy.task")(tiers=(1,), train_tiers=(1,), eval_per_tier=1, train_per_tier=1, seed=0)
    assert task.train and {"toy.task", "toy.checkpoints", "toy.write_jsonl"} <= set(PARTS)


def test_the_core_path_never_imports_the_bench(tmp_path):
    """`import composer`, validate, compile a Plan and a 2-step Lightning run on the toy testbed load no
    module of composer.bench (the harnesses are imported only by `composer bench`)."""
    import subprocess
    import sys

    script = f"""
import sys
import composer
from composer.checks.validate import validate_file
from composer.plan.compile import compile_plan
from pathlib import Path
from composer.backends.lightning.run import train
v = validate_file({str(ROOT / "specs" / "grpo.yaml")!r}, ["train.steps=2", "train.prompts_per_step=2",
    "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "train.eval_every=0", "train.eval_samples=2"])
compile_plan(v)
train(v, Path({str(tmp_path / "run")!r}), progress=False)
loaded = sorted(m for m in sys.modules if m == "composer.bench" or m.startswith("composer.bench."))
print("BENCH", loaded)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "BENCH []" in r.stdout, r.stdout[-2000:]
    assert (tmp_path / "run" / "metrics.csv").exists()  # the run did run
