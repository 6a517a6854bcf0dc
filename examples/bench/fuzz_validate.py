"""Fuzz `composer validate`: mutate every spec in specs/ and check that a bad spec never crashes it.

Every case must end with exit 0 (valid, maybe with warnings) or exit 2 (invalid, with a message that
names file:line:col), never a traceback or an "internal error". Mutations work on the parsed data
(drop, duplicate, retype, rename keys; wrong kinds; broken references; deep nesting; huge numbers;
NaN/inf; unicode; bad `extends`; odd overrides) and on the text (YAML anchors and aliases including
alias bombs, Python and other tags, random bytes, truncation, tabs, unbalanced brackets).

    python examples/bench/fuzz_validate.py --cases 10000 [--seed 0]

prints `N cases, K crashes` and the exit-code histogram; exits 1 if any case crashed. The test suite
(tests/test_fuzz.py) drives the same `mutate` with hypothesis.
"""

from __future__ import annotations

import argparse
import math
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
LOCATED = re.compile(r"^\S.*:\d+:\d+: (error|warning): ", re.M)

KINDS = ["outcome_reward", "reference_solution", "feedback", "sibling_success", "policy_model", "oracle",
         "none", "prefix", "intervention", "reward", "distillation", "sft", "cross_entropy", "divergence",
         "grpo", "advantage_regression", "length_penalized_grpo", "", "GRPO", "grpo ", "kind"]
SECTIONS = ["name", "summary", "extends", "plugins", "policy", "data", "sources", "rollout", "signal", "objective",
            "terms", "sync", "phases", "stages", "train", "guide", "kind", "until", "loss_tokens", "anchor",
            "context", "judge", "teacher", "source", "from", "reference", "target", "steps", "every"]
WEIRD_STRINGS = ["", " ", "self", "guided", "verifier", "reference", "teacher", "judge", "é", "日本語", "🙂",
                 "a" * 300, "\t", "\n", "x\ny", "null", "~", "${oc.env:HOME}", "../specs/grpo.yaml", "-", "[",
                 "{", "*", "&", "!", "%", "@", "`", "\\", "\"", "'", "\u202e", "\u0000", "\ufeff"]
TAGS = ["!!python/object/apply:os.system [\"true\"]", "!!python/name:os.system", "!!python/tuple [1, 2]",
        "!!binary aGVsbG8=", "!!set {a, b}", "!!timestamp 2001-12-14", "!!omap [{a: 1}]", "!foo bar",
        "!!str 3", "!!int x", "!!float nope", "!!null ''", "!!bool maybe", "!<tag:yaml.org,2002:map> {}"]


@dataclass
class Case:
    """One fuzz case: the bytes of the spec file, where it lies relative to the repo, and overrides."""

    text: bytes
    relpath: str  # e.g. specs/hybrids/fuzz.yaml, so that `extends` of the original still resolves
    overrides: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)


def spec_files() -> list[Path]:
    return sorted((REPO / "specs").glob("*.yaml")) + sorted((REPO / "specs" / "hybrids").glob("*.yaml"))


# ---------------------------------------------------------------------------------------------- values

def random_value(rnd: random.Random, depth: int = 0):
    pick = rnd.randrange(16 if depth < 3 else 11)
    if pick == 0:
        return rnd.choice([0, 1, -1, 2, 7, 10**rnd.randrange(1, 40), -(10**rnd.randrange(1, 40)), 2**63, 2**64 + 1])
    if pick == 1:
        return rnd.choice([0.5, -0.0, 1e-308, 1e308, math.inf, -math.inf, math.nan, 3.14])
    if pick == 2:
        return rnd.choice([True, False, None])
    if pick in (3, 4):
        return rnd.choice(WEIRD_STRINGS)
    if pick in (5, 6):
        return rnd.choice(KINDS)
    if pick == 7:
        return "".join(chr(rnd.choice([rnd.randrange(32, 127), rnd.randrange(0x80, 0x3000),
                                       rnd.randrange(0x1F300, 0x1F600)])) for _ in range(rnd.randrange(1, 12)))
    if pick == 8:
        return rnd.choice(["policy", "guide_intervention", "guide_prefix", "prompt", "demonstration", "control",
                           "all", "chunk", "end", "reverse_kl", "jsd", "top_k", "sampled", "full", "ema", "initial"])
    if pick == 9:
        return rnd.randrange(-5, 600)
    if pick == 10:
        return round(rnd.uniform(-2, 2), 3)
    if pick in (11, 12):
        return [random_value(rnd, depth + 1) for _ in range(rnd.randrange(0, 4))]
    if pick == 13:
        return {rnd.choice(SECTIONS): random_value(rnd, depth + 1) for _ in range(rnd.randrange(0, 4))}
    if pick == 14:
        return {"kind": rnd.choice(KINDS), **{rnd.choice(SECTIONS): random_value(rnd, depth + 1)
                                              for _ in range(rnd.randrange(0, 3))}}
    return nested(rnd, rnd.choice([2, 10, 40, 63, 64, 65, 70, 200]))


def nested(rnd: random.Random, depth: int):
    value = rnd.choice([1, "x", None, []])
    for _ in range(depth):
        value = [value] if rnd.random() < 0.5 else {"k": value}
    return value


# ---------------------------------------------------------------------------------------------- data ops

def _containers(data, path=()):
    """Every (path, container) in the data, the root first."""
    yield path, data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from _containers(v, path + (k,))


def _pick(rnd, data, want=None):
    options = [(p, c) for p, c in _containers(data) if c and (want is None or isinstance(c, want))]
    return rnd.choice(options) if options else (None, None)


def _rename(rnd, key) -> str:
    key = str(key)
    how = rnd.randrange(6)
    if how == 0 and len(key) > 1:
        i = rnd.randrange(len(key) - 1)
        return key[:i] + key[i + 1] + key[i] + key[i + 2:]
    if how == 1 and key:
        i = rnd.randrange(len(key))
        return key[:i] + key[i + 1:]
    if how == 2:
        return key.upper()
    if how == 3:
        return key + rnd.choice(["s", "_", "é", " ", "2"])
    if how == 4:
        return rnd.choice(SECTIONS)
    return str(random_value(rnd))[:40]


# well-typed values that reach the graph and method-rule layers
PLAUSIBLE = [
    (("rollout", "samples_per_prompt"), [1, 2, 8, 16]), (("rollout", "guide"), [
        {"kind": "none"}, {"kind": "intervention", "judge": "judge", "control_samples": 8},
        {"kind": "intervention", "judge": "verifier"}, {"kind": "prefix", "reference": "reference"},
        {"kind": "prefix", "reference": "verifier", "guided_fraction": 1.0}, {"kind": "intervention", "judge": "self"}]),
    (("sync", "every"), [1, 2, 10]), (("sync", "off_policy_ok"), [True, False]),
    (("objective",), [{"kind": "grpo"}, {"kind": "grpo", "loss_tokens": ["policy", "guide_intervention"]},
                      {"kind": "divergence"}, {"kind": "cross_entropy"}, {"kind": "advantage_regression",
                                                                          "baseline": "control"},
                      {"kind": "divergence", "measure": "jsd", "estimator": "sampled"}]),
    (("signal",), [{"kind": "reward", "source": "verifier"}, {"kind": "sft", "target": "guided"},
                   {"kind": "sft", "target": "reference"}, {"kind": "distillation", "teacher": "teacher"},
                   {"kind": "distillation", "teacher": "verifier"}]),
    (("sources", "teacher"), [{"kind": "policy_model", "model": "big", "shares_tokenizer": False},
                              {"kind": "policy_model", "model": "big", "weights": "ema"},
                              {"kind": "policy_model", "model": "self", "context": ["teacher"]},
                              {"kind": "feedback", "from": "self"}]),
    (("sources", "reference"), [{"kind": "reference_solution"}, {"kind": "outcome_reward"}]),
    (("sources", "judge"), [{"kind": "oracle"}, {"kind": "policy_model", "model": "self", "context": ["reference"]}]),
    (("phases",), [[{"until": 10}], [{"until": 30}, {"until": 20}], [{"until": 5, "rollout": {"guide": {"kind": "none"}}},
                                                                      {"until": 60}], [{"until": 60, "train": {"steps": 3}}]]),
    (("stages",), [[{"name": "a", "train": {"steps": 5}}, {"name": "a"}], [{"name": "sft", "signal": {
        "kind": "sft", "target": "guided"}, "objective": {"kind": "cross_entropy"}}]]),
    (("train", "steps"), [1, 60, 500]),
]


def plausible_op(rnd: random.Random, data) -> str:
    path, values = rnd.choice(PLAUSIBLE)
    cur = data
    for p in path[:-1]:
        if not isinstance(cur.get(p), dict):
            cur[p] = {}
        cur = cur[p]
    cur[path[-1]] = __import__("copy").deepcopy(rnd.choice(values))
    return "plausible"


def data_op(rnd: random.Random, data, source_names: list[str]) -> str:
    if rnd.random() < 0.4:
        return plausible_op(rnd, data)
    op = rnd.choice(["drop", "retype", "rename", "kind", "ref", "deep", "huge", "nonfinite", "unicode", "add",
                     "swap", "dup_item", "extends", "phases", "stages", "terms", "empty"])
    if op == "drop":
        _, c = _pick(rnd, data)
        if isinstance(c, dict):
            c.pop(rnd.choice(list(c)))
        elif isinstance(c, list):
            c.pop(rnd.randrange(len(c)))
    elif op in ("retype", "deep", "huge", "nonfinite", "unicode"):
        _, c = _pick(rnd, data)
        if c is None:
            return op
        key = rnd.choice(list(c)) if isinstance(c, dict) else rnd.randrange(len(c))
        c[key] = {"retype": lambda: random_value(rnd),
                  "deep": lambda: nested(rnd, rnd.choice([30, 63, 64, 65, 100, 300])),
                  "huge": lambda: rnd.choice([10**rnd.randrange(18, 400), -(10**30), 1e308, 2**1000, 1e-320]),
                  "nonfinite": lambda: rnd.choice([math.nan, math.inf, -math.inf]),
                  "unicode": lambda: rnd.choice(WEIRD_STRINGS[8:12]) * rnd.randrange(1, 50)}[op]()
    elif op == "rename":
        _, c = _pick(rnd, data, dict)
        if c:
            k = rnd.choice(list(c))
            c[_rename(rnd, k)] = c.pop(k)
    elif op == "kind":
        kinded = [c for _, c in _containers(data) if isinstance(c, dict) and "kind" in c]
        if kinded:
            rnd.choice(kinded)["kind"] = rnd.choice(KINDS + [random_value(rnd)])
    elif op == "ref":
        refs = [(c, k) for _, c in _containers(data) if isinstance(c, dict)
                for k in c if k in ("source", "teacher", "judge", "reference", "from", "target", "context")]
        if refs:
            c, k = rnd.choice(refs)
            names = source_names + ["self", "guided", "nope", "verifer", ""]
            c[k] = rnd.choice(names) if rnd.random() < 0.8 else [rnd.choice(names), rnd.choice(names)]
        elif isinstance(data.get("sources"), dict) and data["sources"]:
            data["sources"].pop(rnd.choice(list(data["sources"])))
    elif op == "add":
        _, c = _pick(rnd, data, dict)
        if c is not None:
            c[rnd.choice(SECTIONS + ["unknown_key", "kindd"])] = random_value(rnd)
    elif op == "swap":
        a, ca = _pick(rnd, data, dict)
        b, cb = _pick(rnd, data, dict)
        if ca and cb and a[:len(b)] != b and b[:len(a)] != a:  # neither inside the other: no cycles
            ka, kb = rnd.choice(list(ca)), rnd.choice(list(cb))
            ca[ka], cb[kb] = cb[kb], ca[ka]
    elif op == "dup_item":
        _, c = _pick(rnd, data, list)
        if c:
            c.append(c[rnd.randrange(len(c))])
    elif op == "extends":
        data["extends"] = rnd.choice(["grpo.yaml", "../grpo.yaml", "fuzz.yaml", "missing.yaml", "../mintrl.yaml",
                                      "/", ".", "", "a" * 300, "hybrids/oapl-pope.yaml", "../../specs/sft.yaml",
                                      "/dev/null", "x\x00y", 3, ["grpo.yaml"], {"a": 1}])
    elif op == "phases":
        steps = rnd.choice([1, 5, 100, 500])
        data["phases"] = [{"until": rnd.choice([0, 1, 50, steps, 200, 500, -1, "x"]),
                           **({rnd.choice(["rollout", "objective", "signal", "sync", "train", "sources", "terms",
                                           "bogus"]): random_value(rnd)} if rnd.random() < 0.6 else {})}
                          for _ in range(rnd.randrange(0, 4))]
    elif op == "stages":
        data["stages"] = [{"name": rnd.choice(["a", "b", "sft", "rl", "A B", ""]),
                           **({rnd.choice(["rollout", "objective", "signal", "train", "terms"]): random_value(rnd)}
                              if rnd.random() < 0.7 else {})}
                          for _ in range(rnd.randrange(0, 4))]
    elif op == "terms":
        sig = data.pop("signal", None) if rnd.random() < 0.7 else data.get("signal")
        obj = data.pop("objective", None) if rnd.random() < 0.7 else data.get("objective")
        data["terms"] = [{"signal": sig, "objective": obj, "weight": random_value(rnd)},
                         {"signal": random_value(rnd), "objective": {"kind": rnd.choice(KINDS)}}][:rnd.randrange(0, 3)]
    elif op == "empty":
        _, c = _pick(rnd, data, dict)
        if c:
            c[rnd.choice(list(c))] = rnd.choice([{}, [], None, ""])
    return op


# ---------------------------------------------------------------------------------------------- text ops

def alias_bomb(rnd: random.Random) -> str:
    width, levels = rnd.choice([(9, 9), (10, 6), (2, 30), (50, 4), (3, 12)])
    lines = ["a0: &a0 [\"lol\"]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def _char(code: int) -> str:
    return chr(code) if not 0xD800 <= code < 0xE000 else "\ufffd"  # lone surrogates are not text


def text_op(rnd: random.Random, text: str) -> tuple[str, str]:
    op = rnd.choice(["bytes", "delete", "dup_line", "truncate", "anchor", "bomb", "tab", "bracket", "tag",
                     "merge", "bom", "chars", "doc", "indent"])
    lines = text.splitlines(keepends=True) or [""]
    i = rnd.randrange(len(lines))
    if op == "delete" and text:
        a = rnd.randrange(len(text))
        text = text[:a] + text[a + rnd.randrange(1, 40):]
    elif op == "dup_line":
        lines.insert(i, lines[i])
        text = "".join(lines)
    elif op == "truncate":
        text = text[: rnd.randrange(len(text) + 1)]
    elif op == "anchor":
        # an anchor on one value, aliases of it elsewhere (sometimes as a key, a merge, or itself)
        m = [j for j, line in enumerate(lines) if re.match(r"^\s*[\w-]+:\s*\S", line)]
        if m:
            j = rnd.choice(m)
            key, val = lines[j].split(":", 1)
            lines[j] = f"{key}: &x {val.lstrip()}"
            k = rnd.choice(m)
            key2 = lines[k].split(":", 1)[0]
            lines[k] = rnd.choice([f"{key2}: *x\n", f"{key2}: [*x, *x, *x]\n", "*x : 1\n", f"{key2}: *nope\n",
                                   f"{key2}: {{<<: *x}}\n", f"{key2}: &y [*y]\n"])
            text = "".join(lines)
    elif op == "bomb":
        text = alias_bomb(rnd) + text if rnd.random() < 0.5 else text.rstrip("\n") + "\n" + alias_bomb(rnd)
    elif op == "tab":
        lines[i] = "\t" + lines[i]
        text = "".join(lines)
    elif op == "bracket":
        a = rnd.randrange(len(text) + 1)
        text = text[:a] + rnd.choice(["[", "]", "{", "}", "{{", "]]", ": ", "- ", "\"", "'", "#", "|", ">", "?"]) + text[a:]
    elif op == "tag":
        m = [j for j, line in enumerate(lines) if re.match(r"^\s*[\w-]+:\s*\S", line)]
        if m:
            j = rnd.choice(m)
            key = lines[j].split(":", 1)[0]
            lines[j] = f"{key}: {rnd.choice(TAGS)}\n"
            text = "".join(lines)
    elif op == "merge":
        text = "base: &base {kind: grpo, clip: 0.3}\n" + text + rnd.choice(
            ["objective: {<<: *base}\n", "objective: {<<: [*base, *base], kind: grpo}\n", "<<: *base\n",
             "objective:\n  <<: *base\n  clip: 0.1\n"])
    elif op == "bom":
        text = "\ufeff" + text
    elif op == "chars":
        a = rnd.randrange(len(text) + 1)
        text = text[:a] + "".join(_char(rnd.randrange(0, 0x11000)) for _ in range(rnd.randrange(1, 6))) + text[a:]
    elif op == "doc":
        text = rnd.choice(["%YAML 1.1\n---\n", "---\n", "--- !!map\n", "%TAG ! tag:x,2000:\n---\n"]) + text + \
            rnd.choice(["", "---\nname: y\n", "...\n", "\n---\n"])
    elif op == "indent":
        lines[i] = " " * rnd.randrange(1, 5) + lines[i]
        text = "".join(lines)
    if op == "bytes":
        raw = bytearray(text.encode("utf-8", "surrogatepass"))
        for _ in range(rnd.randrange(1, 8)):
            raw.insert(rnd.randrange(len(raw) + 1), rnd.randrange(256))
        return raw.decode("utf-8", "surrogateescape"), op
    return text, op


# ---------------------------------------------------------------------------------------------- cases

OVERRIDES = ["train.steps=abc", "train.steps=20", "sync.every=100", "trian.steps=3", "train.steps", "=",
             "train=5", "sources.verifier.kind=nope", "objective.kind=grpo", "rollout.samples_per_prompt=1",
             "objective.beta1=.inf", "objective.beta1=.nan", "phases.0.until=3", "train.steps=[1",
             "a..b=1", "sources={}", "name=UPPER", "train.lr=1e400", "rollout.guide.kind=none", "name=",
             "terms.0.weight=2", "extends=grpo.yaml", "plugins=[os]", "plugins=[no_such_module_xyz]"]


def mutate(rnd: random.Random, sources: dict[str, str]) -> Case:
    """A random mutation of one of `sources` (relpath -> text)."""
    relpath = rnd.choice(sorted(sources))
    text = sources[relpath]
    ops: list[str] = []
    if rnd.random() < 0.65:
        data = yaml.safe_load(text)
        names = list((data.get("sources") or {})) if isinstance(data, dict) else []
        for _ in range(rnd.choice([1, 1, 2, 3, 4])):
            ops.append(data_op(rnd, data, names))
        header = text.splitlines(keepends=True)[0] if rnd.random() < 0.8 else ""
        try:
            text = header + yaml.safe_dump(data, allow_unicode=rnd.random() < 0.5, sort_keys=False,
                                           default_flow_style=rnd.choice([None, False, True]),
                                           width=rnd.choice([80, 10**6]))
        except RecursionError:  # nesting too deep for PyYAML's emitter: write it by hand
            depth = rnd.choice([100, 500, 5000])
            text = header + "name: deep\nsummary: " + "[" * depth + "]" * depth + "\n"
    if rnd.random() < 0.35 or not ops:
        for _ in range(rnd.randrange(1, 3)):
            text, op = text_op(rnd, text)
            ops.append(op)
    raw = text.encode("utf-8", "surrogateescape") if rnd.random() < 0.97 else bytes(
        rnd.randrange(256) for _ in range(rnd.randrange(0, 200)))
    overrides = [rnd.choice(OVERRIDES) for _ in range(rnd.randrange(1, 3))] if rnd.random() < 0.1 else []
    folder = str(Path(relpath).parent)
    return Case(raw, f"{folder}/fuzz.yaml", overrides, ops + [f"override {o}" for o in overrides])


class Harness:
    """A scratch copy of specs/ to write cases into, and the in-process CLI to run them."""

    def __init__(self):
        from click.testing import CliRunner

        from composer.cli import main

        self.dir = Path(tempfile.mkdtemp(prefix="composer-fuzz-"))
        shutil.copytree(REPO / "specs", self.dir / "specs")
        self.sources = {str(p.relative_to(REPO)): p.read_text() for p in spec_files()}
        self.runner, self.main = CliRunner(), main

    def run(self, case: Case) -> tuple[int, str, str]:
        """Exit code, problem ('' when the outcome is acceptable), and the output."""
        path = self.dir / case.relpath
        path.write_bytes(case.text)
        result = self.runner.invoke(self.main, ["validate", str(path), *case.overrides], catch_exceptions=True)
        out = result.stdout + result.stderr
        code = result.exit_code
        problem = ""
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            problem = f"exception {type(result.exception).__name__}: {result.exception}"
        elif code not in (0, 2):
            problem = f"exit code {code}"
        elif "Traceback" in out or "internal error" in out:
            problem = "traceback or internal error in the output"
        elif code == 2 and not LOCATED.search(result.stderr):
            problem = "exit 2 without a file:line:col: error: message"
        elif code == 0 and ": ok" not in result.stdout:
            problem = "exit 0 without ': ok'"
        return code, problem, out

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=5, help="print this many crashing cases in full")
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)
    h = Harness()
    codes, crashes, ops = Counter(), [], Counter()
    t0 = time.perf_counter()
    try:
        for _ in range(args.cases):
            case = mutate(rnd, h.sources)
            ops.update(o.split()[0] for o in case.ops)
            code, problem, out = h.run(case)
            codes[code] += 1
            if problem:
                crashes.append((case, problem, out))
    finally:
        h.close()
    dt = time.perf_counter() - t0
    print(f"{args.cases} cases, {len(crashes)} crashes")
    print("exit codes: " + ", ".join(f"{c}: {n}" for c, n in sorted(codes.items())))
    print(f"{dt:.1f} s ({1000 * dt / max(args.cases, 1):.1f} ms per case)")
    print("mutations: " + ", ".join(f"{o} {n}" for o, n in ops.most_common()))
    for case, problem, out in crashes[: args.show]:
        print(f"\n--- {problem}; ops {case.ops}\n{case.text[:2000]!r}\n{out[-3000:]}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
