"""Write an OpenRLHF launch bundle for a validated spec (`composer compile --backend openrlhf`).

    plan.json      the resolved Plan plus the OpenRLHF runs (argument lists and what the plugin installs)
    args.json      {run: OpenRLHF argument list}, each checked against OpenRLHF's real parser
    command.txt    the full command of each run, in order
    launch.sh      `ray job submit` of the bundle folder (its working_dir) with one entry command per run
    runtime_env.json  relative paths only: the bundle is self-contained and can be copied to any head node
    composer/, components/  a copy of the composer code the entry point and the Ray workers import
    <plugin>/ or <plugin>.py  a copy of every plugin module the spec's components come from (spec `plugins:`,
                   installed entry-point packages): plan.json's segment specs name them under `plugins`, so
                   the bundle imports them from its own folder (their third-party dependencies stay the cluster's)
    README.md      what the bundle does, what the cluster needs, native flags vs plugin
    reward.py      OpenRLHF reward function over the spec's verifier (runs without a guide)
    agent.py       OpenRLHF AgentExecutor for the spec's guide or environment (runs with one)
    data/          the prompts (and demonstrations) as jsonl with a JSON label per row
    composer_bundle.json  the files above (`files`): compiling into the folder again replaces only those
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import random
import shlex
import shutil
import sys
from pathlib import Path

from composer.backends.openrlhf import OPENRLHF_VERSION, parser
from composer.backends.openrlhf.batch import encode_label, label_of
from composer.backends.openrlhf.flags import Inputs, Layout, Run, build_runs

HOOK = "composer.backends.openrlhf.hooks.setup_worker"
PACKAGES = ("composer", "components")  # copied into the bundle: the working_dir puts them on every worker's path
RESERVED = (*PACKAGES, "data", "reward", "agent")  # bundle entries a plugin module may not be named after


class BundleError(Exception):
    """The bundle cannot be written (the spec is fine, but OpenRLHF or the inputs are not)."""


MANIFEST = "composer_bundle.json"  # the bundle's own files (`files`): an earlier bundle is replaced by this list
FIXED_FILES = ("plan.json", "args.json", "command.txt", "launch.sh", "runtime_env.json", "README.md", "reward.py",
               "agent.py", "data/train.jsonl", "data/eval.jsonl")
COPIED_TREES = (*PACKAGES, "models", "data/toy")  # copies of the composer's code and the toy testbed


def legacy_file(rel: str) -> bool:
    """Whether `rel` is a file an older bundle (one without MANIFEST) wrote: a name every bundle uses or a file of
    the trees it copies. Anything else in its folder is taken for the user's and kept."""
    return rel in FIXED_FILES or any(rel.startswith(tree + "/") for tree in COPIED_TREES)


def older_bundle(folder: Path) -> bool:
    """Whether `folder` holds a bundle of an older version (no MANIFEST): plan.json, launch.sh and args.json, and
    a plan.json with the `openrlhf` part every bundle's has (a project folder with those names is not one)."""
    if not all((folder / name).is_file() and not (folder / name).is_symlink()
               for name in ("plan.json", "launch.sh", "args.json")):
        return False
    try:
        plan = json.loads((folder / "plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(plan, dict) and isinstance(plan.get("openrlhf"), dict)


def _examples(v):
    """(train examples, eval examples by datasource, prompt format) of a data spec, bound as the Lightning
    backend binds them: each prompt already rendered (chat template, system prompt, prompt template)."""
    if v.spec.data.train is None:
        return None, None, None
    from composer.runtime.binding import DataError, bind_task
    from composer.runtime.models import ModelLoadError

    try:
        task = bind_task(v.spec)
    except DataError as e:
        raise BundleError(str(e)) from None
    except ModelLoadError as e:
        raise BundleError(f"{e}; the bundle's prompts are rendered at compile time with the policy's tokenizer "
                          f"(data.prompt_format {v.spec.data.prompt_format}), so it must be readable here; or set "
                          "data.prompt_format: plain") from None
    return task.train, task.eval, task.prompt_format


def pin_prompt_format(plan: dict, fmt) -> None:
    """The cluster renders teachers' and judges' prompts as the bundle's data was rendered: plan.json's segment
    specs name the format resolved here (`auto` -> `chat` or `plain`), so no second guess happens there."""
    if fmt is None or fmt.mode == "task":
        return
    for seg in plan["segments"]:
        seg["spec"] = {**seg["spec"], "data": {**(seg["spec"].get("data") or {}), "prompt_format": fmt.mode}}
    plan["data"] = {**plan["data"], "prompt_format": fmt.mode}


def round_trip_problem(fmt, prompts: list[str]) -> str | None:
    """Why reward.py could not strip a prompt off its query (OpenRLHF decodes prompt + response ids with special
    tokens and the reward removes the prompt text): the first prompt whose ids do not decode to its text."""
    tok = getattr(fmt, "tokenizer", None)
    if tok is None:
        return None
    for text in prompts:
        back = tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False)
        if back != text:
            return (f"the tokenizer does not decode the rendered prompt back to its text (e.g. {text[:60]!r} -> "
                    f"{back[:60]!r}); reward.py strips the prompt by text and may leave part of it in the response")
    return None


def _rows_needed(v) -> dict[str, int]:
    """Prompt rows per run: steps x prompts_per_step, times pool_factor where dynamic filtering refills
    dropped prompts from the same pool (flags.pool_factor)."""
    from composer.backends.openrlhf.flags import pool_factor

    segs = v.segments
    if v.spec.stages:
        return {s.name: s.spec.train.steps * s.spec.train.prompts_per_step
                * pool_factor([x.spec for x in segs if x.name == s.name]) for s in segs}
    return {"main": v.spec.train.steps * v.spec.train.prompts_per_step * pool_factor([s.spec for s in segs] or [v.spec])}


def write_data(v, out: Path, eos: str | None) -> tuple[dict, Inputs]:
    """data/train.jsonl (shuffled, as many rows as the longest run needs) and data/eval.jsonl."""
    from composer.data import Example

    spec = v.spec
    need = _rows_needed(v)
    n = max(need.values())
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, evals, fmt = _examples(v)
    if train is None:  # the toy testbed, written by its own writer
        from composer.registry import part

        write_jsonl = part("toy.write_jsonl")
        d = spec.data
        per_tier = math.ceil(n / len(d.train_tiers))
        paths = write_jsonl(str(data / "toy"), {"tiers": tuple(d.tiers), "train_tiers": tuple(d.train_tiers),
                                                "train_per_tier": per_tier, "eval_per_tier": spec.train.eval_samples,
                                                "seed": spec.train.seed, "task": d.toy_task})

        def read(path):
            rows = [json.loads(x) for x in open(path) if x.strip()]
            return [Example(prompt=r["prompt"], answer=r["answer"], solution=r["solution"], problem=r["problem"],
                            tier=r.get("tier")) for r in rows]

        train = read(paths["train"])
        evals = {f"tier{k.removeprefix('eval_')}": read(p) for k, p in paths.items() if k.startswith("eval_")}
    if not train:
        raise BundleError(f"{spec.data.train}: no training rows")
    rng = random.Random(spec.train.seed)
    order = []
    while len(order) < n:  # cycle through shuffled passes, like the Lightning backend's data order
        block = list(range(len(train)))
        rng.shuffle(block)
        order += block
    rows = [train[i] for i in order[:n]]
    convs = train[0].conversation is not None  # messages rows: written as messages (OpenRLHF's multiturn SFT)
    with open(data / "train.jsonl", "w") as f:
        for ex in rows:
            rec = {"prompt": ex.prompt, "label": encode_label(label_of(ex))}
            if convs:
                rec = {"messages": ex.conversation.messages}
            elif ex.solution is not None:
                rec["target"] = ex.solution + (eos or "")
            f.write(json.dumps(rec) + "\n")
    eval_file = None
    if evals:
        eval_file = "data/eval.jsonl"
        with open(out / eval_file, "w") as f:
            for source, exs in evals.items():
                for ex in exs[:spec.train.eval_samples]:  # as the Lightning backend: the first eval_samples rows
                    rec = {"prompt": ex.prompt, "label": encode_label(label_of(ex, eval=True)), "datasource": source}
                    if ex.conversation is not None:
                        rec["messages"] = ex.conversation.messages
                    elif ex.solution is not None:  # train_sft evaluates its loss on the reference solution
                        rec["target"] = ex.solution + (eos or "")
                    f.write(json.dumps(rec) + "\n")
    every = rows + [e for exs in evals.values() for e in exs]
    inputs = Inputs(policy_path="", source_paths={}, train_file="data/train.jsonl", train_rows=need,
                    eval_file=eval_file, max_prompt_chars=max(len(e.prompt) for e in every),
                    max_solution_chars=max(len(e.solution or "") for e in every), sft_eos=eos,
                    toy=spec.data.train is None, max_problem_chars=max(len(e.problem or e.prompt) for e in every),
                    eval_targets=bool(evals) and all(e.solution is not None and (e.conversation is not None) == convs
                                                     for exs in evals.values() for e in exs[:spec.train.eval_samples]))
    if convs:
        inputs.conversations = conversation_mapping(fmt, spec, train, evals)
        inputs.max_conversation_chars = max(len(fmt.tokenizer.decode(e.conversation.ids)) for e in every
                                            if e.conversation is not None)
    if fmt is not None and fmt.mode != "task":  # the prompts above are rendered: say how, and what it adds
        inputs.prompt_format = fmt.describe()
        inputs.prompt_overhead_chars = len(fmt.wrap(""))
        inputs.prompt_example = rows[0].prompt
        inputs.prompt_note = round_trip_problem(fmt, [e.prompt for e in rows[:8]])
    return {"train": len(rows), "eval": sum(len(x) for x in evals.values())}, inputs, fmt


def conversation_mapping(fmt, spec, train: list, evals: dict) -> str:
    """"native" when OpenRLHF's multiturn SFT (train_sft --data.multiturn --data.apply_chat_template) trains exactly
    the tokens the composer trains on every conversation the bundle writes (each assistant turn through its end of
    turn, with the same ids before it: composer/conversations.py `openrlhf_difference`, a copy of OpenRLHF 0.11.2's
    masking); else why not, naming the first row where it differs. Templates that write text after an end of turn
    (ChatML's newline) differ: OpenRLHF trains that text too."""
    from composer.conversations import openrlhf_difference

    if fmt.kwargs:
        return (f"data.chat_template_kwargs {fmt.kwargs}: OpenRLHF's multiturn SFT renders the chat template without "
                "them")
    seen = set()
    for ex in list(train) + [e for exs in evals.values() for e in exs[:spec.train.eval_samples]]:
        if ex.conversation is None or id(ex) in seen:
            continue
        seen.add(id(ex))
        why = openrlhf_difference(fmt.tokenizer, ex.conversation)
        if why:
            where = (ex.meta or {}).get("file", spec.data.train)
            return f"on row {ex.row} of {where}, {why}"
    return "native"


def _models(v) -> tuple[str, dict[str, str]]:
    """The policy's and every external policy_model source's local path (toy:* bootstrapped if missing)."""
    from composer.runtime.models import resolve

    policy = resolve(v.spec.policy.model or "toy:student")
    sources = {}
    for seg in v.segments:
        for name, src in seg.spec.sources.items():
            if src.model_path is not None:
                sources[name] = "self" if src.model_path == "self" else resolve(src.model_path)
    return policy, sources


def _critic_paths(v) -> dict[str, str]:
    """A ppo critic's own checkpoint (critic.model), resolved (toy:* bootstrapped if missing): {"critic": path}."""
    from composer.checks.terms import terms
    from composer.runtime.models import resolve

    for seg in v.segments:
        for _n, _s, obj, _w in terms(seg.spec):
            critic = obj.value_model() if obj is not None else None
            if critic is not None and critic.model is not None:
                return {"critic": resolve(critic.model)}
    return {}


def _eos(path: str, v) -> str | None:
    """The text SFT targets end with (OpenRLHF would otherwise append ' ' + eos): the chat template's end of turn
    under chat prompts, else the tokenizer's eos (composer/stops.py, as on Lightning)."""
    from composer.checks.graph import signal_objective_pairs

    if not any(sig is not None and "demonstration" in sig.origins(s.spec.rollout.guide) for s in v.segments
               for sig, _ in signal_objective_pairs(s.spec)):  # no term trains on demonstration text
        return None
    try:
        from transformers import AutoTokenizer

        from composer.stops import for_spec

        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code(v))
        end = for_spec(tok, v.spec).end
        return tok.eos_token if end is None or end == getattr(tok, "eos_token_id", None) else \
            tok.convert_ids_to_tokens(end)
    except Exception:  # noqa: BLE001 - a hub id or a directory only the cluster has
        return None


def _asks_remote_code(v) -> bool:
    """The spec, in any segment, asks to run a model folder's code (the policy or a policy_model source)."""
    return any(bool(getattr(seg.spec.policy, "trust_remote_code", False))
               or any(bool(getattr(src, "trust_remote_code", False)) for src in seg.spec.sources.values())
               for seg in v.segments)


def trust_remote_code(v) -> bool:
    """The spec's `policy.trust_remote_code` (default False), passed to every tokenizer the bundle loads."""
    return bool(v.spec.policy.trust_remote_code)


def compile_bundle(v, out: Path, layout: Layout) -> dict:
    """Write the bundle for validated spec `v` into `out`. Raises Unsupported, parser.ArgsError, BundleError."""
    from composer.plan.compile import compile_plan
    from composer.runtime.example_prompts import machine_notes

    parser.require()
    plan = {**compile_plan(v, backend="openrlhf"), **machine_notes(v)}
    plan["file"] = spec_name(v.loaded.file)
    out.mkdir(parents=True, exist_ok=True)
    policy, sources = _models(v)
    counts, inputs, fmt = write_data(v, out, _eos(policy, v))
    pin_prompt_format(plan, fmt)
    inputs.policy_path, inputs.source_paths = policy, sources
    inputs.critic_paths = _critic_paths(v)
    runs = build_runs(v, layout, inputs)
    warnings = {}
    for run in runs:
        try:
            args, printed = parser.check(run.trainer, run.argv)
        except parser.ArgsError as e:
            raise BundleError(f"run '{run.name}': OpenRLHF {OPENRLHF_VERSION} rejects the generated arguments: {e}")
        _launch_checks(run, args)
        warnings[run.name] = printed
    plugins = plugin_sources(v, runs)  # before anything else is written: a plugin that cannot ship refuses
    policy, sources = ship_toy_models(out, runs, inputs)
    name_plugins(plan, plugins)
    plan["openrlhf"] = {
        "version": OPENRLHF_VERSION, "toy": inputs.toy, "policy_path": policy, "source_paths": sources,
        "layout": dataclasses.asdict(layout), "data": counts,
        "runs": [dataclasses.asdict(r) for r in runs], "plugins": {m: shipped_name(m, p) for m, p in plugins.items()},
    }
    commands = [command(r) for r in runs]
    (out / "plan.json").write_text(json.dumps(plan, indent=1, default=str) + "\n")
    (out / "args.json").write_text(json.dumps({r.name: r.argv for r in runs}, indent=1) + "\n")
    (out / "command.txt").write_text("\n".join(commands) + "\n")
    env = runtime_env(layout)
    if _asks_remote_code(v):  # compiled with the user's --trust-remote-code (validation refuses it otherwise)
        env["env_vars"]["COMPOSER_TRUST_REMOTE_CODE"] = "1"
    (out / "runtime_env.json").write_text(json.dumps(env, indent=1) + "\n")
    (out / "launch.sh").write_text(launch_script(v.spec.name, [entry_words(r) for r in runs], layout))
    ship_code(out)
    ship_plugins(out, plugins)
    os.chmod(out / "launch.sh", 0o755)
    if any("--reward.remote_url" in r.argv and not r.plugin.get("agent") and r.trainer == "ppo" for r in runs):
        r = next(r for r in runs if "--reward.remote_url" in r.argv and not r.plugin.get("agent") and r.trainer == "ppo")
        (out / "reward.py").write_text(reward_file(v.spec.name, r.plugin["verifier"], policy, trust_remote_code(v),
                                                   list(plugins)))
    if any(r.plugin.get("agent") for r in runs):
        (out / "agent.py").write_text(agent_file(v.spec.name))
    (out / "README.md").write_text(readme(v, plan, runs, layout, inputs, warnings, commands))
    return plan


def _relocate(obj, moves: dict[str, str]):
    """`obj` (argv lists, plugin dicts, notes) with every moved path in its strings rewritten."""
    if isinstance(obj, str):
        for src, dst in moves.items():
            obj = obj.replace(src, dst)
        return obj
    if isinstance(obj, list):
        return [_relocate(x, moves) for x in obj]
    if isinstance(obj, dict):
        return {k: _relocate(x, moves) for k, x in obj.items()}
    return obj


def ship_toy_models(out: Path, runs: list[Run], inputs: Inputs) -> tuple[str, dict[str, str]]:
    """Copy the toy testbed's checkpoints the runs use into `models/` of the bundle and point every argument
    and plugin setting at them relative to the bundle (the job's working directory on every node), so a toy
    bundle runs anywhere and holds no path of the compiling machine. Returns (policy, sources) paths."""
    from composer.registry import part

    root = os.path.realpath(part("toy.cache_folder")())
    moves = {}
    for path in [inputs.policy_path, *inputs.source_paths.values(), *inputs.critic_paths.values()]:
        real = os.path.realpath(path) if path and path != "self" else ""
        if real.startswith(root + os.sep) and os.path.isdir(real):
            rel = "models/" + os.path.relpath(real, root).replace(os.sep, "/")
            if not (out / rel).exists():
                shutil.copytree(real, out / rel)
            moves[path] = rel
    for run in runs:
        for f in dataclasses.fields(run):
            setattr(run, f.name, _relocate(getattr(run, f.name), moves))
    inputs.policy_path = _relocate(inputs.policy_path, moves)
    inputs.source_paths = _relocate(inputs.source_paths, moves)
    inputs.critic_paths = _relocate(inputs.critic_paths, moves)
    return inputs.policy_path, inputs.source_paths


# ---------------------------------------------------------------------------------------- plugin modules

BUILTIN_TOPS = ("composer", "components")


def _components(obj):
    """Every component config inside a spec model (sources, guide, signals, objectives, nested ones)."""
    from pydantic import BaseModel

    from composer.registry import Component

    if isinstance(obj, Component):
        yield obj
    if isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            yield from _components(getattr(obj, name, None))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _components(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _components(x)


def _class_modules(comp) -> list[str]:
    """The top-level modules of the component's class and of its component bases, built-ins left out."""
    from composer.registry import Component

    tops = [c.__module__.split(".")[0] for c in type(comp).__mro__ if issubclass(c, Component) and c is not Component]
    return [t for t in tops if t not in BUILTIN_TOPS]


def plugin_modules(v, runs: list[Run]) -> dict[str, str]:
    """{top-level module: why the bundle needs it}: the spec's `plugins:`, the modules every (non built-in)
    component class of every segment comes from (entry-point plugins included), the verifiers' modules."""
    from composer import registry

    need: dict[str, str] = {}
    for name in getattr(v.spec, "plugins", None) or []:
        need.setdefault(name.split(".")[0], f"the spec's plugins: names '{name}'")
    for seg in v.segments:
        for comp in _components(seg.spec):
            for top in _class_modules(comp):
                need.setdefault(top, f"{comp.section} kind '{comp.kind_name()}' comes from it")
    for r in runs:
        info = registry.VERIFIERS.get(r.plugin.get("verifier") or "none")
        top = info.module.split(".")[0] if info else None
        if top and top not in BUILTIN_TOPS:
            need.setdefault(top, f"verifier '{info.name}' comes from it")
    return need


def _module_spec(top: str):
    mod = sys.modules.get(top)
    try:
        return getattr(mod, "__spec__", None) or importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None


def plugin_source(top: str, why: str) -> Path:
    """The package folder or the single .py file of plugin module `top`; BundleError when it is not there as
    source files the bundle can carry (a namespace package, a zip, a compiled extension, nothing at all)."""
    def refuse(what: str) -> BundleError:
        return BundleError(f"plugin module '{top}' ({why}): {what}, so the bundle cannot carry it and the "
                           "cluster could not import it; install it as a plain package folder or .py file "
                           "(pip install -e, or a folder on PYTHONPATH) and compile again")

    if top in RESERVED:
        raise refuse(f"its name is taken by the bundle's own '{top}'")
    spec = _module_spec(top)
    if spec is None:
        raise refuse("it cannot be found on this machine")
    locations = list(spec.submodule_search_locations or [])
    if locations:
        if spec.origin in (None, "namespace") or len(locations) != 1:
            raise refuse(f"it is a namespace package ({', '.join(locations) or 'no folder'})")
        folder = Path(locations[0])
        if not (folder / "__init__.py").is_file():
            raise refuse(f"its package folder {folder} is not a folder of source files")
        return folder
    origin = Path(spec.origin or "")
    if origin.suffix != ".py" or not origin.is_file():
        raise refuse(f"it is loaded from {spec.origin or 'nowhere'}, not from a .py source file")
    return origin


def plugin_sources(v, runs: list[Run]) -> dict[str, Path]:
    """{top-level module: its package folder or .py file} of every plugin module the bundle must carry."""
    return {top: plugin_source(top, why) for top, why in plugin_modules(v, runs).items()}


def name_plugins(plan: dict, plugins: dict[str, Path]) -> None:
    """Every segment spec of plan.json names the shipped modules under `plugins` (the runtime imports those
    before it validates a segment): entry-point plugins are not installed on the cluster."""
    for seg in plan["segments"]:
        names = list(seg["spec"].get("plugins") or [])
        names += [m for m in plugins if m not in {n.split(".")[0] for n in names}]
        if names:
            seg["spec"] = {**seg["spec"], "plugins": names}


def shipped_name(top: str, src: Path) -> str:
    """Where plugin module `top` lies in the bundle: its package folder `top/` or its file `top.py`."""
    return f"{top}/" if src.is_dir() else f"{top}.py"


def ship_plugins(out: Path, plugins: dict[str, Path]) -> None:
    """Copy each plugin module next to composer/ (replacing an earlier copy): a package folder or one file."""
    for top, src in plugins.items():
        dest = out / shipped_name(top, src).rstrip("/")
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        elif dest.exists() or dest.is_symlink():
            dest.unlink()
        if src.is_dir():
            shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest)


def spec_name(file) -> str:
    """The spec's path as the bundle records it: relative to the current folder when under it, else its name
    (no path of the compiling machine goes into a bundle)."""
    p = Path(str(file))
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return p.name


def _launch_checks(run: Run, args) -> None:
    """What OpenRLHF's train() asserts before any model loads (not part of its post-parse checks)."""
    if run.trainer != "ppo":
        return
    if args.train.colocate_all and not args.train.async_enable:
        if args.actor.num_nodes * args.actor.num_gpus_per_node != args.vllm.num_engines * args.vllm.tensor_parallel_size:
            raise BundleError(f"run '{run.name}': colocation needs actor GPUs == vLLM engines x TP")
    if (args.train.colocate_actor_ref or args.train.colocate_all) and args.algo.kl.init_coef > 0:
        if (args.actor.num_nodes, args.actor.num_gpus_per_node) != (args.ref.num_nodes, args.ref.num_gpus_per_node):
            raise BundleError(f"run '{run.name}': the colocated reference must have the actor's GPUs")


def command(run: Run) -> str:
    """The run's full command line, for people (command.txt); launch.sh starts the short form, `entry_words`."""
    return " ".join(entry_words(run) + ["--"] + [shlex.quote(a) for a in run.argv])


def entry_words(run: Run) -> list[str]:
    """The entry point of one run as separate words: the arguments come from plan.json (the same list as
    command.txt), so nothing here needs quoting for the shell the Ray job supervisor runs it with."""
    return ["python", "-m", "composer.backends.openrlhf", "--plan", "plan.json", "--run", run.name]


def ship_code(out: Path) -> None:
    """Copy the composer's packages into the bundle (replacing an earlier copy), so the bundle runs from any
    folder of any machine: the job's working_dir is first on the path of the entry point and of every worker."""
    import components
    import composer

    for pkg in (composer, components):
        dest = out / pkg.__name__
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        shutil.copytree(os.path.dirname(os.path.abspath(pkg.__file__)), dest,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def runtime_env(layout: Layout) -> dict:
    """Relative paths only: `ray job submit` runs in the bundle folder and uploads it as the working_dir."""
    return {
        "working_dir": ".",
        "worker_process_setup_hook": HOOK,
        "env_vars": {"COMPOSER_PLAN": "plan.json", "COMPOSER_JOB": "1"},
        "excludes": ["__pycache__", "*.pyc"],
    }


def entrypoint(runs_words: list[list[str]], extra: list[str] = ()) -> list[str]:
    """The words after `ray job submit --`: Ray's CLI joins them with spaces (list2cmdline) and its job
    supervisor runs the line with `sh`; runs are chained with a bare `&&` word, `extra` ends each run's words."""
    out: list[str] = []
    for words in runs_words:
        out += (["&&"] if out else []) + words + list(extra)
    return out


def launch_script(name: str, runs_words: list[list[str]], layout: Layout) -> str:
    # $CHECK and $PREFLIGHT are left unquoted on purpose: empty, each is no word at all
    entry = " ".join(w if w in ("$CHECK", "$PREFLIGHT") else shlex.quote(w)
                     for w in entrypoint(runs_words, ["$CHECK", "$PREFLIGHT"]))
    wandb = ""
    if layout.wandb_project:
        wandb = ('if [ -n "${WANDB_API_KEY:-}" ]; then\n  ENV=$(python3 -c \'import json,os,sys; e=json.load(sys.stdin); '
                 'e["env_vars"]["WANDB_API_KEY"]=os.environ["WANDB_API_KEY"]; print(json.dumps(e))\' <<< "$ENV")\nfi\n')
    return f"""#!/usr/bin/env bash
# Submit the composer bundle '{name}' to a Ray cluster running OpenRLHF {OPENRLHF_VERSION}.
# usage: ./launch.sh [--check] [--no-preflight] [HEAD_ADDRESS] [ray job submit options, e.g. --no-wait]
#   HEAD_ADDRESS: default $RAY_ADDRESS, else the local head http://127.0.0.1:8265
#   --check: start every run's entry point on the cluster in check mode (plan, OpenRLHF's parser, the worker
#            setup hook, the shipped code) and exit without training
#   --no-preflight: skip the resource preflight each run starts with (by default a run fails at once when the
#            cluster lacks the nodes or GPUs the bundle was compiled for, instead of waiting for them forever)
set -euo pipefail
cd "$(dirname "$0")"
CHECK=""
PREFLIGHT=""
while [ "${{1:-}}" = "--check" ] || [ "${{1:-}}" = "--no-preflight" ]; do
  if [ "$1" = "--check" ]; then CHECK="--check"; else PREFLIGHT="--no-preflight"; fi
  shift
done
ADDRESS="${{1:-${{RAY_ADDRESS:-http://127.0.0.1:8265}}}}"
shift || true
ENV=$(cat runtime_env.json)
{wandb}exec ray job submit --address "$ADDRESS" --runtime-env-json "$ENV" "$@" -- {entry}
"""


def reward_file(name: str, verifier: str, tokenizer: str, trust_remote_code: bool = False,
                plugins: list[str] = ()) -> str:
    return f'''"""OpenRLHF reward function for spec '{name}' (written by `composer compile`).

`--reward.remote_url reward.py`: OpenRLHF calls reward_func(queries, prompts, labels) in its vLLM engine
actors; the reward is the composer's registered '{verifier}' verifier on the response.
"""

from composer.backends.openrlhf.reward import make_reward_func

reward_func = make_reward_func(verifier={verifier!r}, tokenizer={tokenizer!r},
                               trust_remote_code={bool(trust_remote_code)!r}, plugins={list(plugins)!r})
'''


def agent_file(name: str) -> str:
    return f'''"""OpenRLHF agent for spec '{name}' (written by `composer compile`).

`--train.agent_func_path agent.py`: OpenRLHF instantiates AgentExecutor() in each vLLM engine actor; it
runs the spec's guide or its environment's episodes (phases by the trainer's step) and scores the rollout with the
spec's verifier (an episode: its final answer).
"""

from composer.backends.openrlhf.agent import executor_class

AgentExecutor = executor_class("plan.json")
'''


def node_paths(runs: list[Run], inputs: Inputs, layout: Layout) -> list[tuple[str, str]]:
    """Every path a run reads or writes on the nodes: the models, the data files, the output folders (all of
    them named in the runs' arguments, so none is missed), with what each is."""
    out = {inputs.policy_path: "the policy model (read)"}
    out.update({p: f"the model of source `{n}` (read)" for n, p in inputs.source_paths.items() if p != "self"})
    out.update({p: "the critic's starting model (read)" for p in inputs.critic_paths.values()})
    keys = {"--critic.model_name_or_path": "the critic's starting model (read)",
            "--reward.model_name_or_path": "the reward model (read)", "--data.dataset": "training data (read)", "--data.prompt_dataset": "training prompts (read)",
            "--eval.dataset": "evaluation prompts (read)", "--reward.remote_url": "the reward function (read)",
            "--train.agent_func_path": "the agent (read)",
            "--actor.model_name_or_path": "the policy model (read)", "--model.model_name_or_path": "the model (read)",
            "--ckpt.path": "checkpoints (written)", "--ckpt.output_dir": "the final model (written)",
            "--logger.tensorboard_dir": "TensorBoard logs (written)"}
    for run in runs:
        for i, a in enumerate(run.argv[:-1]):
            if a in keys:
                out.setdefault(run.argv[i + 1], f"{keys[a]}, run `{run.name}`")
    out.setdefault(layout.cluster_dir, "writable: checkpoints, final models, logs")
    return [(p, what) for p, what in out.items() if p and not p.startswith("env:")]


def readme(v, plan, runs: list[Run], layout: Layout, inputs: Inputs, warnings: dict, commands: list[str]) -> str:
    spec = v.spec
    lines = [f"# OpenRLHF bundle: {spec.name}", "", spec.summary, "",
             f"Compiled from `{plan['file']}` by `composer compile --backend openrlhf` for "
             f"{layout.nodes} node(s) x {layout.gpus_per_node} GPU(s). {plan['total_steps']} steps in "
             f"{len(runs)} OpenRLHF run(s): {', '.join(r.name for r in runs)}.", "",
             "## Launch", "", "```bash", "./launch.sh                      # head at $RAY_ADDRESS or http://127.0.0.1:8265",
             "./launch.sh http://HEAD:8265     # another head",
             "./launch.sh --check              # start the entry points on the cluster, check, exit (no training)",
             "./launch.sh --no-preflight       # skip the resource preflight (by default a run fails at once "
             "when the cluster lacks the compiled nodes/GPUs)",
             "```", "", "Resume: after a preemption, run `./launch.sh` again: OpenRLHF resumes from the latest "
             "checkpoint in the run's output folder (`ckpt/`, written every train.checkpoint_every steps), and the "
             "composer's seeds (prompt order per episode, every rollout request, each update's micro-batch split) "
             "make the continuation the one the uninterrupted job would have trained; a lagged engine (sync.every "
             "> 1) resumes only from a checkpoint at a sync step or before the first sync (else refused, with the "
             "reason).", "", "The bundle is self-contained: copy the whole folder to the head node (any path) and run "
             "`./launch.sh` there. `ray job submit` uploads this folder as the job's working_dir, with the copy of "
             "the composer's `composer/` and `components/` packages it holds (runtime_env.json has relative paths "
             f"only); every Ray worker runs `{HOOK}` at start, which installs the plugin. Runs, in order "
             "(command.txt; launch.sh starts each as `python -m composer.backends.openrlhf --plan plan.json --run "
             "NAME`, which reads the same arguments from plan.json):", ""]
    lines += ["```", *commands, "```", "",
              "## What the cluster needs", "",
              f"- OpenRLHF {OPENRLHF_VERSION} with its GPU stack: vLLM, DeepSpeed, flash-attn (and Ray on every node).",
              "- Python packages of the composer itself: pydantic, omegaconf, networkx, PyYAML, transformers "
              "(and math-verify for the `math` verifier).",
              "",
              "Paths that must exist on every node (relative ones are inside this bundle, the job's working "
              "directory):", ""]
    lines += [f"- `{p}`: {what}" for p, what in node_paths(runs, inputs, layout)]
    shipped = plan["openrlhf"].get("plugins") or {}
    if shipped:
        lines.append(f"- Whatever the plugin module(s) {', '.join(f'`{m}`' for m in shipped)} import besides the "
                     f"composer (the modules themselves are in this bundle: {', '.join(shipped.values())}).")
    lines += [""]
    if layout.wandb_project:
        lines += [f"W&B project `{layout.wandb_project}`: export WANDB_API_KEY before ./launch.sh.", ""]
    lines += ["## Prompts", ""]
    if inputs.toy:
        lines += ["The toy testbed's own prompts (no chat template), as the Lightning backend sees them.", ""]
    elif inputs.conversations == "native":  # messages rows: OpenRLHF renders them itself (checked at compile time)
        lines += [("Conversations (`messages` rows), written into data/*.jsonl as they are: OpenRLHF renders each "
                   "with the policy tokenizer's chat template (`--data.apply_chat_template --data.multiturn`) and "
                   "trains every assistant turn through its end of turn; on every row written it trains the tokens "
                   "the Lightning backend trains (checked at compile time)."), ""]
    else:
        lines += [(f"Rendered by the composer at compile time ({inputs.prompt_format}), exactly as the Lightning "
                   "backend renders them, and written into data/*.jsonl as text. OpenRLHF's "
                   "`--data.apply_chat_template` stays off: OpenRLHF tokenizes that text with no special tokens "
                   "added, and the agent, reward.py and the teachers' and judges' prompts (rendered on the cluster "
                   "with the same settings, pinned in plan.json) all see the same text. The first training prompt:"),
                  "", "```", inputs.prompt_example, "```", ""]
        if inputs.prompt_note:
            lines += [f"Note: {inputs.prompt_note}.", ""]
    if plan.get("stop_tokens"):  # composer/stops.py; the entry point prints them first too
        lines += [f"Stop tokens: {plan['stop_tokens']}. A response ends at the first of them (every rollout and "
                  "evaluation request asks vLLM for all of them in its stop_token_ids); a written target ends with "
                  "the token named last.", ""]
    for r in runs:
        lines += [f"## Run `{r.name}` ({'openrlhf.cli.train_sft' if r.trainer == 'sft' else 'openrlhf.cli.train_ppo_ray'})",
                  "", "Native OpenRLHF flags:", ""] + [f"- {x}" for x in r.native] + [""]
        lines += ["Through the composer's plugin (composer/backends/openrlhf):", ""]
        lines += [f"- {x}" for x in r.via_plugin] or ["- nothing: this run is plain OpenRLHF (the entry point only starts it)"]
        lines += [""]
        if r.notes or warnings.get(r.name):
            lines += ["Notes:", ""] + [f"- {x}" for x in r.notes] + [f"- OpenRLHF says: {w}" for w in warnings[r.name]] + [""]
        lines += [f"Output: {r.output_dir}/model (final), {r.output_dir}/ckpt, {r.output_dir}/tensorboard.", ""]
    lines += ["## Files", "", "plan.json (the resolved Plan + the runs), args.json and command.txt (the OpenRLHF "
              "arguments, checked with OpenRLHF's own parser and post-parse checks at compile time), launch.sh, "
              "runtime_env.json, data/ (prompts with a JSON label: answer, reference solution, problem)"
              + (", reward.py" if any("--reward.remote_url" in r.argv and not r.plugin.get("agent") for r in runs) else "")
              + (", agent.py" if any(r.plugin.get("agent") for r in runs) else "")
              + "".join(f", {p} (plugin module `{m}`)" for m, p in (plan["openrlhf"].get("plugins") or {}).items())
              + ".", ""]
    return "\n".join(lines)
