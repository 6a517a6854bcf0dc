"""Fuzz `composer validate`, `run` and `compile`: mutate every spec in specs/ and check a bad spec never crashes them.

Every case must end with exit 0 (valid, maybe with warnings) or exit 2 (invalid, with a message that
names file:line:col), never a traceback or an "internal error". Mutations work on the parsed data
(drop, duplicate, retype, rename keys; wrong kinds; broken references; deep nesting; huge numbers;
NaN/inf; unicode; bad `extends`; odd overrides) and on the text (YAML anchors and aliases including
alias bombs, Python and other tags, random bytes, truncation, tabs, unbalanced brackets).

    python examples/bench/fuzz_validate.py --cases 10000 [--seed 0]                  # validate only, in process
    python examples/bench/fuzz_validate.py --cases 100 --through run,compile [--save DIR]

Cases also point `data:` at files that block or never end (/proc/kmsg, a FIFO, /dev/zero), a tokenizer at
hostile chat templates (nested loops, 'x' * 10**10) with `chat_template_kwargs` that are no template variable,
and override values YAML 1.1 would coerce (`010`, `1:30`, `yes`) or settings only the user may turn on.

    python examples/bench/fuzz_validate.py --cases 20 --through run,compile,env,tamper

`env`: one step with the environment aimed elsewhere (COMPOSER_RUN_DIR + LOCAL_RANK naming the finished run,
MLflow at a closed port, trust_remote_code without the opt-in); the finished run must stay as it was.
`tamper`: a copy of the finished run tampered with one way (a .lock link to an outside file, a bad
metrics.csv cell, a wrong-typed RNG entry, a truncated checkpoint or one linked to /dev/zero, model/ with
its own code, samples.jsonl as a FIFO or with malformed rows, export over a base model's folder), then
resumed, exported or shown: no traceback or hang, no outside file touched, no shipped code run.

With --through, every case (valid or not) also goes, as subprocesses with a wall-clock limit, through
`composer run` (one step on tiny batches, into a new folder), `composer run` into the folder of an
earlier finished run (with a sentinel file) without --resume, `composer compile --backend openrlhf`
(into an absent folder, or over an earlier bundle), and `composer compile` into the finished run's
folder. Each command's verdict is accepted (exit 0), refused cleanly (exit 2 or 130 with a message),
traceback (a "Traceback" or "internal error" in the output, another exit code, or a silent refusal)
or hang (killed at the limit); data is lost when the finished run's files (metrics.csv,
checkpoints/last.ckpt, the sentinel, any other) or the earlier bundle change or vanish, or when a
compile that did not succeed leaves a folder behind. It prints a table of these counts per command
and exits 1 if there is any traceback, hang or loss. The test suite (tests/test_fuzz.py) drives the
same `mutate` with hypothesis, and pushes a few seeded mutants through run and compile.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
LOCATED = re.compile(r"^\S.*:\d+:\d+: (error|warning): ", re.MULTILINE)

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
                     "swap", "dup_item", "extends", "phases", "stages", "terms", "empty", "template", "datapath"])
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
    elif op == "template":  # a tokenizer whose chat template hangs or explodes, kwargs that are not its variables
        data["data"] = {"train": f"{FIXTURE}/data/train.jsonl", "prompt_field": "q", "answer_field": "a",
                        "prompt_format": rnd.choice(["auto", "chat"]),
                        **({"chat_template_kwargs": rnd.choice(TEMPLATE_KWARGS)} if rnd.random() < 0.6 else {})}
        policy = data.setdefault("policy", {}) if isinstance(data.get("policy", {}), dict) else {}
        policy["tokenizer"] = f"{FIXTURE}/tok/{rnd.choice(sorted(HOSTILE_TEMPLATES))}"
        data["policy"] = policy
    elif op == "datapath":  # files that block, never end, or are not what they say
        data["data"] = {"train": rnd.choice(DATA_PATHS), "prompt_field": "q", "answer_field": "a"}
        if rnd.random() < 0.5:
            data["data"]["eval"] = {"test": rnd.choice(DATA_PATHS)}
    return op


FIXTURE = "@FUZZ@"  # replaced by the harness's scratch folder when a case is written (fixtures live there)
HOSTILE_TEMPLATES = {
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
             "{{ messages[-1]['content'] }}",
    "repeat": "{{ 'x' * 10000000000 }}{{ messages[-1]['content'] }}",
    "center": "{{ 'x'.center(1000000000) }}{{ messages[-1]['content'] }}",
    "power": "{{ 10 ** 100000000 }}{{ messages[-1]['content'] }}",
    "format": "{{ '%2000000000d' % 1 }}{{ messages[-1]['content'] }}",
    "raises": "{{ raise_exception('no') }}",
    "ok": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
          "{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}<assistant>",
}
TEMPLATE_KWARGS = [{"chat_template": "{{ 'replaced' }}"}, {"enable_thinking": False}, {"thinking_budget": 3},
                   {"tools": "x"}, {"tokenize": True}, {"add_generation_prompt": False}, {"messages": "x"}, {}]
DATA_PATHS = ["/proc/kmsg", "/proc/self/status", "/sys/kernel/notes", "/dev/zero", "/dev/null", "/dev/stdin",
              f"{FIXTURE}/data/fifo.jsonl", f"{FIXTURE}/data/proc-link.jsonl", f"{FIXTURE}/data/dup.jsonl",
              f"{FIXTURE}/data/train.jsonl", f"{FIXTURE}/data", "/proc", "/"]


def make_fixtures(root: Path) -> None:
    """The files `template` and `datapath` cases point at: data (good, a FIFO, a link into /proc, duplicate
    keys) and tokenizer folders with hostile chat templates (built from the tiny random checkpoint's)."""
    d = root / "data"
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.jsonl").write_text("".join(f'{{"q": "{a}+{b}", "a": "{a + b}"}}\n' for a in range(4) for b in range(4)))
    (d / "dup.jsonl").write_text('{"q": "1+1", "a": "2"}\n{"q": "2+2", "a": "5", "a": "4"}\n')
    if not (d / "fifo.jsonl").exists():
        os.mkfifo(d / "fifo.jsonl")
    if not (d / "proc-link.jsonl").is_symlink():
        (d / "proc-link.jsonl").symlink_to("/proc/self/status")


def make_tokenizers(root: Path) -> None:
    """One tokenizer folder per HOSTILE_TEMPLATES entry (needs transformers: only for run and compile)."""
    import json as _json

    from components.tasks.bootstrap import tiny_random_checkpoint

    base = Path(tiny_random_checkpoint(str(root / "tiny")))
    for name, template in HOSTILE_TEMPLATES.items():
        folder = root / "tok" / name
        if folder.exists():
            continue
        folder.mkdir(parents=True)
        for f in base.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy(f, folder / f.name)
        cfg = _json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(_json.dumps(cfg))


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
             "terms.0.weight=2", "extends=grpo.yaml", "plugins=[os]", "plugins=[no_such_module_xyz]",
             # YAML 1.1 coercions a file would not make, and settings only the user may turn on
             "train.steps=010", "train.steps=1:30", "train.seed=0x10", "train.steps=0o10", "name=yes", "name=on",
             "train.lr=1e-3", "train.steps=1_000", "train.steps=+5", "summary=2001-12-14", "train.lr=.5",
             "extends=sft.yaml", "extends.x=1", "plugins=[json]", "plugins=[logging]", "policy.trust_remote_code=true",
             "data.chat_template_kwargs={chat_template: x}", "train.loggers=[csv, mlflow]", "train.num_nodes=2",
             "policy.lora.target_modules=[]", "policy.lora.target_modules=[nope]", "train.strategy=fsdp",
             "train.devices=[0,1]", "policy.model=.", "policy.model=../specs"]


def mutate(rnd: random.Random, sources: dict[str, str]) -> Case:
    """A random mutation of one of `sources` (relpath -> text)."""
    relpath = rnd.choice(sorted(sources))
    text = sources[relpath]
    ops: list[str] = []
    if rnd.random() < 0.65:
        data = yaml.safe_load(text)
        names = list(data.get("sources") or {}) if isinstance(data, dict) else []
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


class Hang(BaseException):
    """Raised by the in-process deadline; a BaseException so that the CLI's `except Exception` cannot swallow it."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Interrupt the block after `seconds` (main thread only): an in-process validate that never returns is a hang."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise Hang

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Harness:
    """A scratch copy of specs/ to write cases into, and the in-process CLI to run them."""

    def __init__(self, validate_timeout_s: float = 30.0):
        from click.testing import CliRunner

        from composer.cli.main import main

        self.dir = Path(tempfile.mkdtemp(prefix="composer-fuzz-"))
        shutil.copytree(REPO / "specs", self.dir / "specs")
        self.sources = {str(p.relative_to(REPO)): p.read_text() for p in spec_files()}
        self.runner, self.main = CliRunner(), main
        self.timeout_s = validate_timeout_s
        self.fixtures = self.dir / "fixtures"
        make_fixtures(self.fixtures)

    def write(self, case: Case) -> Path:
        path = self.dir / case.relpath
        path.write_bytes(case.text.replace(FIXTURE.encode(), str(self.fixtures).encode()))
        return path

    def run(self, case: Case) -> tuple[int, str, str]:
        """Exit code, problem ('' when the outcome is acceptable; 'hang ...' past the deadline), and the output."""
        path = self.write(case)
        try:
            with deadline(self.timeout_s):
                result = self.runner.invoke(self.main, ["validate", str(path), *case.overrides], catch_exceptions=True)
        except Hang:
            return -1, f"hang: validate ran past {self.timeout_s:g} s", ""
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


# ---------------------------------------------------------------------------------------------- run and compile

# one step on tiny batches: a `composer run` costs seconds (mostly importing torch), not minutes
FAST = ["train.prompts_per_step=2", "rollout.max_new_tokens=16", "train.eval_every=0", "train.eval_samples=2"]
SENTINEL = "SENTINEL.txt"
MUST_SURVIVE = ("metrics.csv", "checkpoints/last.ckpt", SENTINEL)
BUNDLE_MARKS = ("plan.json", "launch.sh", "args.json")


@dataclass
class Outcome:
    """What one command did with one case: its verdict, what it harmed (empty: nothing), and its output."""

    step: str
    verdict: str
    lost: list[str]
    out: str


def verdict(rc: int | None, stdout: str, stderr: str) -> str:
    """accepted (exit 0), refused (exit 2 or 130 with a message), traceback, or hang (rc None: killed at the limit).

    The CLI turns unexpected exceptions into 'internal error: ... please report it' with exit 2: that is a crash
    wearing a clean exit code, so it counts as a traceback; so does a refusal that says nothing on stderr."""
    if rc is None:
        return "hang"
    if "Traceback" in stdout + stderr or "internal error" in stdout + stderr or rc not in (0, 2, 130):
        return "traceback"
    if rc == 0:
        return "accepted"
    return "refused" if stderr.strip() else "traceback"


COMPOSER = (sys.executable, "-m", "composer")


TRUST_ENV = ("COMPOSER_ALLOW_PLUGINS", "COMPOSER_TRUST_REMOTE_CODE")


def cli(args: list[str], cwd: Path, timeout_s: float, program=COMPOSER, env: dict | None = None
        ) -> tuple[int | None, str, str]:
    """`composer ARGS` in a fresh process with a wall-clock limit: (exit code or None on a hang, stdout, stderr).

    The process gets its own session so that a hang is killed with everything it started (data loaders, sandboxes).
    Plugins and remote code stay disallowed, as for any untrusted spec; `env` adds variables (env-driven cases)."""
    env = {**{k: v for k, v in os.environ.items() if k not in TRUST_ENV}, **(env or {})}
    p = subprocess.Popen([*program, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
        rc: int | None = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc = None
    return rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` but the run lock (which every run attempt rewrites with its pid)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def losses(before: dict[str, str], folder: Path) -> list[str]:
    """The files of `before` that vanished from `folder` or changed: data lost (new files are not a loss)."""
    now = snapshot(folder) if folder.is_dir() else {}
    return [f"{name} {'vanished' if name not in now else 'changed'}" for name, digest in before.items()
            if now.get(name) != digest]


def run_overrides(path: Path, case: Case, valid: bool) -> list[str]:
    """One step on tiny batches, then the case's own overrides (last, so that they win as they did in validate).

    A staged spec refuses a top-level train.steps, so it gets stages.N.train.steps=1 for each stage; a phased spec
    keeps its phases (the validator warns they are cut). An invalid case gets nothing added: an override could mend
    it (train.steps=1 over a broken train.steps), and `run` must refuse it exactly as validate did."""
    from composer.checks.validate import validate_file

    if not valid:
        return list(case.overrides)
    stages = validate_file(str(path), list(case.overrides)).spec.stages or []  # validate accepted it a moment ago
    steps = [f"stages.{i}.train.steps=1" for i in range(len(stages))] if stages else ["train.steps=1"]
    return [*FAST, *steps, *case.overrides]


class Through:
    """Pushes cases through `composer run` (one step) and `composer compile` as subprocesses, each with a wall-clock
    limit, and checks that no earlier output is harmed: a finished run's folder (with a sentinel file) that runs and
    compiles are aimed at without --resume, and an earlier bundle or an absent folder as compile's --out."""

    def __init__(self, harness: Harness, steps=("run", "compile"), run_timeout_s=180.0, compile_timeout_s=90.0):
        self.h, self.steps = harness, tuple(steps)
        self.run_timeout_s, self.compile_timeout_s = run_timeout_s, compile_timeout_s
        self.work = harness.dir / "through"
        self.work.mkdir()
        self.finished = self._made("finished-run", ["run", "specs/grpo.yaml", "train.steps=1", *FAST, "--no-progress"],
                                   run_timeout_s, "metrics.csv", "checkpoints/last.ckpt")
        (self.finished / SENTINEL).write_text("an earlier run's results: must survive every later command\n")
        self.bundle = self._made("earlier-bundle", ["compile", "specs/grpo.yaml", "--backend", "openrlhf"],
                                 compile_timeout_s, *BUNDLE_MARKS)
        self.finished_snap, self.bundle_snap = snapshot(self.finished), snapshot(self.bundle)
        self.pristine = self.work / "pristine-run"
        shutil.copytree(self.finished, self.pristine)
        if {"run", "env"} & set(self.steps):
            make_tokenizers(harness.fixtures)
        self.victim = self.work / "victim.txt"  # a file outside every run folder that a link in one points at
        self.victim.write_text("a file a tampered run folder must never touch\n")

    def _made(self, name: str, args: list[str], timeout_s: float, *expect: str) -> Path:
        """A reference output made from a shipped spec; without it no loss can be measured, so failing is fatal."""
        folder = self.work / name
        rc, out, err = cli([*args, "--out", str(folder)], self.h.dir, timeout_s)
        if rc != 0 or not all((folder / e).is_file() for e in expect):
            raise RuntimeError(f"could not make the {name} ({' '.join(args)}): exit {rc}\n{out[-2000:]}{err[-2000:]}")
        return folder

    def push(self, case: Case, index: int, valid: bool) -> list[Outcome]:
        """Every step of `self.steps` for one case (already written by Harness.run; `valid`: validate accepted it)."""
        path = self.h.dir / case.relpath
        outcomes = []
        if "run" in self.steps:
            ov = run_overrides(path, case, valid)
            outcomes += [self._run_fresh(path, ov, index), self._into_finished("run", ["run", str(path), *ov,
                                                                                         "--no-progress"])]
        if "env" in self.steps:
            outcomes.append(self._env_driven(path, run_overrides(path, case, valid), index))
        if "tamper" in self.steps:
            outcomes.append(self._tampered(index))
        if "compile" in self.steps:
            outcomes += [self._compile(path, case, index),
                         self._into_finished("compile", ["compile", str(path), *case.overrides])]
        return outcomes

    def _run_fresh(self, path: Path, ov: list[str], index: int) -> Outcome:
        """One step into a new folder: the run itself must not crash or hang."""
        out = self.work / f"run-{index}"
        rc, so, se = cli(["run", str(path), *ov, "--out", str(out), "--no-progress"], self.h.dir, self.run_timeout_s)
        shutil.rmtree(out, ignore_errors=True)  # a checkpoint is ~16 MB
        return Outcome("run", verdict(rc, so, se), [], so + se)

    ENV_CASES = ("run_dir_rank0", "run_dir_rank1", "mlflow_closed_port", "trust_unset")

    def _env_driven(self, path: Path, ov: list[str], index: int) -> Outcome:
        """One step with the environment pointing elsewhere (another run's folder as COMPOSER_RUN_DIR with a
        LOCAL_RANK, MLflow at a closed port): the run keeps its own folder, the finished run is untouched."""
        kind = self.ENV_CASES[index % len(self.ENV_CASES)]
        env, extra = {}, []
        if kind.startswith("run_dir"):
            env = {"COMPOSER_RUN_DIR": str(self.finished), "LOCAL_RANK": kind[-1], "RANK": kind[-1]}
        elif kind == "mlflow_closed_port":
            import socket

            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{s.getsockname()[1]}"}
            s.close()
            extra = ["train.loggers=[csv,mlflow]"]
        else:
            extra = ["policy.trust_remote_code=true"]
        out = self.work / f"env-{index}"
        rc, so, se = cli(["run", str(path), *ov, *extra, "--out", str(out), "--no-progress"], self.h.dir,
                         self.run_timeout_s, env=env)
        shutil.rmtree(out, ignore_errors=True)
        lost = losses(self.finished_snap, self.finished)
        if lost:
            shutil.rmtree(self.finished, ignore_errors=True)
            shutil.copytree(self.pristine, self.finished)
        return Outcome(f"run (env: {kind})", verdict(rc, so, se), lost, so + se)

    TAMPERS = ("lock_symlink", "metrics_bad_cell", "rng_wrong_type", "ckpt_truncated", "ckpt_dev_zero",
               "model_custom_code", "samples_fifo", "samples_garbage", "export_over_a_base_model")

    def _tampered(self, index: int) -> Outcome:
        """A copy of the finished run, tampered with one way, then resumed, exported or shown: every command must
        end cleanly and touch nothing outside (the file a link points at, a base model's folder), and no code a
        folder ships may run."""
        kind = self.TAMPERS[index % len(self.TAMPERS)]
        folder = self.work / f"tampered-{index}"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(self.pristine, folder)
        victim_before = self.victim.read_bytes()
        marker = self.work / f"RAN-{index}"
        args = ["run", "--resume", str(folder), "train.steps=2", "--no-progress"]
        base = None
        if kind == "lock_symlink":
            (folder / ".lock").unlink(missing_ok=True)
            (folder / ".lock").symlink_to(self.victim)
        elif kind == "metrics_bad_cell":
            with open(folder / "metrics.csv", "a") as f:
                f.write("x" * 10 + "\n")
        elif kind == "rng_wrong_type":
            import torch

            ckpt = folder / "checkpoints" / "last.ckpt"
            state = torch.load(ckpt, weights_only=True)
            state["composer"]["rng"] = ["not", "a", "state"]
            torch.save(state, ckpt)
        elif kind == "ckpt_truncated":
            ckpt = folder / "checkpoints" / "last.ckpt"
            ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
        elif kind == "ckpt_dev_zero":
            ckpt = folder / "checkpoints" / "last.ckpt"
            ckpt.unlink()
            ckpt.symlink_to("/dev/zero")
        elif kind == "model_custom_code":
            import json as _json

            cfg = _json.loads((folder / "model" / "config.json").read_text())
            cfg.update(model_type="fuzz_custom", auto_map={"AutoConfig": "custom.C", "AutoModelForCausalLM": "custom.M"})
            (folder / "model" / "config.json").write_text(_json.dumps(cfg))
            (folder / "model" / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
            args = ["export", str(folder), "--out", str(self.work / f"export-{index}")]
        elif kind == "samples_fifo":
            (folder / "samples.jsonl").unlink(missing_ok=True)
            os.mkfifo(folder / "samples.jsonl")
            args = ["samples", str(folder)]
        elif kind == "samples_garbage":
            (folder / "samples.jsonl").write_text('{"step": 1, "spans": "x"}\n{"step": 1, "reward": "hi"}\n'
                                                  '{"step": 1, "prompt": "\\u001b]0;pwned\\u0007"}\n[1]\n')
            args = ["samples", str(folder)]
        elif kind == "export_over_a_base_model":
            base = self.work / f"base-{index}"
            shutil.copytree(folder / "model", base)
            (base / "README.md").write_text("the user's notes\n")
            args = ["export", str(folder), "--out", str(base)]
        rc, so, se = cli(args, self.h.dir, self.run_timeout_s)
        lost = []
        if self.victim.read_bytes() != victim_before:
            lost.append("a file outside the run folder changed through its .lock link")
            self.victim.write_bytes(victim_before)
        if marker.exists():
            lost.append("code the run folder's model/ ships ran")
        if base is not None and not (base / "README.md").is_file():
            lost.append("export replaced a folder that was not an export")
        if "\x1b" in so:
            lost.append("escape bytes from samples.jsonl reached the terminal")
        for extra in (folder, base, self.work / f"export-{index}"):
            if extra is not None:
                shutil.rmtree(extra, ignore_errors=True)
        return Outcome(f"tampered run folder ({kind})", verdict(rc, so, se), lost, so + se)

    def _into_finished(self, command: str, args: list[str]) -> Outcome:
        """The same command aimed at the finished run's folder without --resume: it must refuse and leave the folder
        as it was. The folder is restored after a loss so that one loss does not count again for every later case."""
        timeout_s = self.run_timeout_s if command == "run" else self.compile_timeout_s
        rc, so, se = cli([*args, "--out", str(self.finished)], self.h.dir, timeout_s)
        v = verdict(rc, so, se)
        lost = losses(self.finished_snap, self.finished)
        if v == "accepted":
            lost.append(f"`{command}` accepted a folder holding a finished run")
        if lost:
            shutil.rmtree(self.finished, ignore_errors=True)
            shutil.copytree(self.pristine, self.finished)
        return Outcome(f"{command} --out <finished run>", v, lost, so + se)

    def _compile(self, path: Path, case: Case, index: int) -> Outcome:
        """Compile into an absent folder (even cases) or over an earlier bundle (odd cases, which compiling may
        replace): a compile that does not succeed must leave --out absent, or the earlier bundle unchanged."""
        out = self.work / f"bundle-{index}"
        if index % 2:
            shutil.copytree(self.bundle, out)
        rc, so, se = cli(["compile", str(path), *case.overrides, "--backend", "openrlhf", "--out", str(out)],
                         self.h.dir, self.compile_timeout_s)
        v, lost = verdict(rc, so, se), []
        if v != "accepted":
            if not index % 2 and out.exists():
                lost = [f"a compile that did not succeed left {out.name}/ behind"]
            elif index % 2:
                lost = losses(self.bundle_snap, out)
        shutil.rmtree(out, ignore_errors=True)
        return Outcome("compile", v, lost, so + se)


# ---------------------------------------------------------------------------------------------- tally and CLI

class Tally:
    """Counts per step: how many cases each verdict got, and how many cases lost data."""

    def __init__(self):
        self.verdicts: dict[str, Counter] = {}
        self.lost: Counter = Counter()
        self.ops: Counter = Counter()
        self.cases = 0

    def add(self, outcome: Outcome) -> None:
        self.verdicts.setdefault(outcome.step, Counter())[outcome.verdict] += 1
        self.lost[outcome.step] += bool(outcome.lost)

    def total(self, what: str) -> int:
        if what == "lost":
            return sum(self.lost.values())
        return sum(c[what] for c in self.verdicts.values())

    def bad(self) -> int:
        return self.total("traceback") + self.total("hang") + self.total("lost")

    def table(self) -> str:
        rows = [("step", "tried", "accepted", "refused cleanly", "tracebacks", "hangs", "data lost")]
        for step, c in self.verdicts.items():
            rows.append((step, sum(c.values()), c["accepted"], c["refused"], c["traceback"], c["hang"],
                         self.lost[step]))
        rows.append(("all steps", sum(sum(c.values()) for c in self.verdicts.values()), self.total("accepted"),
                     self.total("refused"), self.total("traceback"), self.total("hang"), self.total("lost")))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w) for i, (v, w) in
                                   enumerate(zip(r, widths))) for r in rows)


def validate_outcome(code: int, problem: str, out: str) -> Outcome:
    """The in-process validate as an Outcome: its problems are tracebacks, or hangs past the deadline."""
    v = "hang" if problem.startswith("hang") else "traceback" if problem else "accepted" if code == 0 else "refused"
    return Outcome("validate", v, [], f"{problem}\n{out}")


def save_finding(folder: Path, index: int, case: Case, outcome: Outcome) -> None:
    """Keep a case that crashed, hung or lost data: the spec as written, and what happened to it."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"case{index:05d}-{re.sub(r'[^a-z]+', '-', outcome.step).strip('-')}"
    (folder / f"{stem}{Path(case.relpath).suffix}").write_bytes(case.text)
    (folder / f"{stem}.txt").write_text(f"relpath: {case.relpath}\noverrides: {case.overrides}\nops: {case.ops}\n"
                                        f"step: {outcome.step}\nverdict: {outcome.verdict}\nlost: {outcome.lost}\n"
                                        f"\n{outcome.out[-6000:]}")


def attack(h: Harness, through: Through | None, case: Case, index: int) -> list[Outcome]:
    """One case through validate (in process) and, given `through`, its run and compile steps; a case that hangs
    validate is not pushed further (run and compile validate first, so they would only hang again)."""
    outcomes = [validate_outcome(*h.run(case))]
    if through is not None and outcomes[0].verdict != "hang":
        outcomes += through.push(case, index, outcomes[0].verdict == "accepted")
    return outcomes


def fuzz(cases: int, seed: int, steps=(), save: Path | None = None, show: int = 5, log=None, **limits) -> Tally:
    """Generate `cases` mutants; validate each in process, then push it through `steps` (run, compile)."""
    rnd, tally, h = random.Random(seed), Tally(), Harness()
    found: dict[int, tuple[Case, list[Outcome]]] = {}
    try:
        through = Through(h, steps, **limits) if steps else None
        for i in range(cases):
            case = mutate(rnd, h.sources)
            tally.cases += 1
            tally.ops.update(o.split()[0] for o in case.ops)
            for o in attack(h, through, case, i):
                tally.add(o)
                if o.verdict in ("traceback", "hang") or o.lost:
                    found.setdefault(i, (case, []))[1].append(o)
                    if save is not None:
                        save_finding(save, i, case, o)
            if log and through is not None and (i + 1) % 10 == 0:
                log(f"{i + 1}/{cases} cases, {tally.bad()} problems")
    finally:
        h.close()
    for case, bad in list(found.values())[:show]:
        print(f"\n--- {'; '.join(f'{o.step}: {o.verdict} {o.lost}' for o in bad)}\nops {case.ops} overrides "
              f"{case.overrides}\n{case.text[:2000]!r}\n{bad[0].out[-3000:]}")
    return tally


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (SystemExit with argparse's message on a bad one)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--through", default="", help="also push every case through these (subprocesses): run, compile, "
                    "env (a run with COMPOSER_RUN_DIR/LOCAL_RANK or MLflow at a closed port set), tamper (a finished "
                    "run's folder tampered with one way, then resumed, exported or shown)")
    ap.add_argument("--run-timeout", type=float, default=180.0, help="seconds before a `run` counts as a hang")
    ap.add_argument("--compile-timeout", type=float, default=90.0, help="seconds before a `compile` counts as a hang")
    ap.add_argument("--save", type=Path, default=None, help="write every crashing, hanging or data-losing case here")
    ap.add_argument("--show", type=int, default=5, help="print this many crashing cases in full")
    args = ap.parse_args(argv)
    if {s for s in args.through.split(",") if s} - {"run", "compile", "env", "tamper"}:
        ap.error(f"--through takes run, compile, env and/or tamper, not {args.through!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    steps = [s for s in args.through.split(",") if s]
    t0 = time.perf_counter()
    tally = fuzz(args.cases, args.seed, steps, args.save, args.show, log=lambda m: print(m, file=sys.stderr, flush=True),
                 **({"run_timeout_s": args.run_timeout, "compile_timeout_s": args.compile_timeout} if steps else {}))
    dt = time.perf_counter() - t0
    print(f"\n{tally.cases} cases (attacks tried), {tally.bad()} problems (tracebacks + hangs + data lost)")
    print(tally.table())
    print(f"{dt:.1f} s ({1000 * dt / max(tally.cases, 1):.1f} ms per case)")
    print("mutations: " + ", ".join(f"{o} {n}" for o, n in tally.ops.most_common()))
    return 1 if tally.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
