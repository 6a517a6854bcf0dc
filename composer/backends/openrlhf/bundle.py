"""Write an OpenRLHF launch bundle for a validated spec (`composer compile --backend openrlhf`).

    plan.json      the resolved Plan plus the OpenRLHF runs (argument lists and what the plugin installs)
    args.json      {run: OpenRLHF argument list}, each checked against OpenRLHF's real parser
    command.txt    the full command of each run, in order
    launch.sh      `ray job submit` of the bundle folder (its working_dir) with one entry command per run
    runtime_env.json  relative paths only: the bundle is self-contained and can be copied to any head node
    composer/, components/  a copy of the composer code the entry point and the Ray workers import
    README.md      what the bundle does, what the cluster needs, native flags vs plugin
    reward.py      OpenRLHF reward function over the spec's verifier (runs without a guide)
    agent.py       OpenRLHF AgentExecutor for the spec's guide (runs with one)
    data/          the prompts (and demonstrations) as jsonl with a JSON label per row
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shlex
import shutil
from pathlib import Path

from composer.backends.openrlhf import OPENRLHF_VERSION, parser
from composer.backends.openrlhf.batch import encode_label, label_of
from composer.backends.openrlhf.flags import Inputs, Layout, Run, build_runs

HOOK = "composer.backends.openrlhf.hooks.setup_worker"
PACKAGES = ("composer", "components")  # copied into the bundle: the working_dir puts them on every worker's path


class BundleError(Exception):
    """The bundle cannot be written (the spec is fine, but OpenRLHF or the inputs are not)."""


def _examples(v):
    """(train examples, eval examples by datasource) of a data spec, bound as the Lightning backend binds them."""
    if v.spec.data.train is None:
        return None, None
    from composer.runtime.binding import DataError, bind_task

    try:
        task = bind_task(v.spec)
    except DataError as e:
        raise BundleError(str(e)) from None
    return task.train, task.eval


def _rows_needed(v) -> dict[str, int]:
    segs = v.segments
    if v.spec.stages:
        return {s.name: s.spec.train.steps * s.spec.train.prompts_per_step for s in segs}
    return {"main": v.spec.train.steps * v.spec.train.prompts_per_step}


def write_data(v, out: Path, eos: str | None) -> tuple[dict, Inputs]:
    """data/train.jsonl (shuffled, as many rows as the longest run needs) and data/eval.jsonl."""
    from composer.data import Example

    spec = v.spec
    need = _rows_needed(v)
    n = max(need.values())
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, evals = _examples(v)
    if train is None:  # the toy testbed, written by its own writer
        from components.tasks.toy import write_jsonl

        d = spec.data
        per_tier = math.ceil(n / len(d.train_tiers))
        paths = write_jsonl(str(data / "toy"), {"tiers": tuple(d.tiers), "train_tiers": tuple(d.train_tiers),
                                                "train_per_tier": per_tier, "eval_per_tier": spec.train.eval_samples,
                                                "seed": spec.train.seed})

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
    with open(data / "train.jsonl", "w") as f:
        for ex in rows:
            rec = {"prompt": ex.prompt, "label": encode_label(label_of(ex))}
            if ex.solution is not None:
                rec["target"] = ex.solution + (eos or "")
            f.write(json.dumps(rec) + "\n")
    eval_file = None
    if evals:
        eval_file = "data/eval.jsonl"
        with open(out / eval_file, "w") as f:
            for source, exs in evals.items():
                for ex in exs:
                    f.write(json.dumps({"prompt": ex.prompt, "label": encode_label(label_of(ex, eval=True)),
                                        "datasource": source}) + "\n")
    every = rows + [e for exs in evals.values() for e in exs]
    inputs = Inputs(policy_path="", source_paths={}, train_file="data/train.jsonl", train_rows=need,
                    eval_file=eval_file, max_prompt_chars=max(len(e.prompt) for e in every),
                    max_solution_chars=max(len(e.solution or "") for e in every), sft_eos=eos,
                    toy=spec.data.train is None, max_problem_chars=max(len(e.problem or e.prompt) for e in every))
    return {"train": len(rows), "eval": sum(len(x) for x in evals.values())}, inputs


def _models(v) -> tuple[str, dict[str, str]]:
    """The policy's and every external policy_model source's local path (toy:* bootstrapped if missing)."""
    from composer.runtime.models import resolve

    policy = resolve(v.spec.policy.model or "toy:student")
    sources = {}
    for seg in v.segments:
        for name, src in seg.spec.sources.items():
            if src.kind_name() == "policy_model":
                sources[name] = "self" if src.is_self else resolve(src.model)
    return policy, sources


def _eos(path: str, v) -> str | None:
    """The eos text SFT targets end with (OpenRLHF would otherwise append ' ' + eos)."""
    from composer.graph import signal_objective_pairs

    if not any(sig is not None and sig.kind_name() == "sft" for s in v.segments
               for sig, _ in signal_objective_pairs(s.spec)):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path).eos_token
    except Exception:  # noqa: BLE001 - a hub id or a directory only the cluster has
        return None


def compile_bundle(v, out: Path, layout: Layout) -> dict:
    """Write the bundle for validated spec `v` into `out`. Raises Unsupported, parser.ArgsError, BundleError."""
    from composer.plan import compile_plan

    parser.require()
    plan = compile_plan(v, backend="openrlhf")
    plan["file"] = spec_name(v.loaded.file)
    out.mkdir(parents=True, exist_ok=True)
    policy, sources = _models(v)
    counts, inputs = write_data(v, out, _eos(policy, v))
    inputs.policy_path, inputs.source_paths = policy, sources
    runs = build_runs(v, layout, inputs)
    warnings = {}
    for run in runs:
        try:
            args, printed = parser.check(run.trainer, run.argv)
        except parser.ArgsError as e:
            raise BundleError(f"run '{run.name}': OpenRLHF {OPENRLHF_VERSION} rejects the generated arguments: {e}")
        _launch_checks(run, args)
        warnings[run.name] = printed
    plan["openrlhf"] = {
        "version": OPENRLHF_VERSION, "toy": inputs.toy, "policy_path": policy, "source_paths": sources,
        "layout": dataclasses.asdict(layout), "data": counts,
        "runs": [dataclasses.asdict(r) for r in runs],
    }
    commands = [command(r) for r in runs]
    (out / "plan.json").write_text(json.dumps(plan, indent=1, default=str) + "\n")
    (out / "args.json").write_text(json.dumps({r.name: r.argv for r in runs}, indent=1) + "\n")
    (out / "command.txt").write_text("\n".join(commands) + "\n")
    env = runtime_env(layout)
    (out / "runtime_env.json").write_text(json.dumps(env, indent=1) + "\n")
    (out / "launch.sh").write_text(launch_script(v.spec.name, [entry_words(r) for r in runs], layout))
    ship_code(out)
    os.chmod(out / "launch.sh", 0o755)
    if any(not r.plugin.get("agent") and r.trainer == "ppo" for r in runs):
        r = next(r for r in runs if not r.plugin.get("agent") and r.trainer == "ppo")
        (out / "reward.py").write_text(reward_file(v.spec.name, r.plugin["verifier"], policy))
    if any(r.plugin.get("agent") for r in runs):
        (out / "agent.py").write_text(agent_file(v.spec.name))
    (out / "README.md").write_text(readme(v, plan, runs, layout, inputs, warnings, commands))
    return plan


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
    # $CHECK is left unquoted on purpose: empty, it is no word at all
    entry = " ".join(w if w == "$CHECK" else shlex.quote(w) for w in entrypoint(runs_words, ["$CHECK"]))
    wandb = ""
    if layout.wandb_project:
        wandb = ('if [ -n "${WANDB_API_KEY:-}" ]; then\n  ENV=$(python3 -c \'import json,os,sys; e=json.load(sys.stdin); '
                 'e["env_vars"]["WANDB_API_KEY"]=os.environ["WANDB_API_KEY"]; print(json.dumps(e))\' <<< "$ENV")\nfi\n')
    return f"""#!/usr/bin/env bash
# Submit the composer bundle '{name}' to a Ray cluster running OpenRLHF {OPENRLHF_VERSION}.
# usage: ./launch.sh [--check] [HEAD_ADDRESS] [ray job submit options, e.g. --no-wait]
#   HEAD_ADDRESS: default $RAY_ADDRESS, else the local head http://127.0.0.1:8265
#   --check: start every run's entry point on the cluster in check mode (plan, OpenRLHF's parser, the worker
#            setup hook, the shipped code) and exit without training
set -euo pipefail
cd "$(dirname "$0")"
CHECK=""
if [ "${{1:-}}" = "--check" ]; then CHECK="--check"; shift; fi
ADDRESS="${{1:-${{RAY_ADDRESS:-http://127.0.0.1:8265}}}}"
shift || true
ENV=$(cat runtime_env.json)
{wandb}exec ray job submit --address "$ADDRESS" --runtime-env-json "$ENV" "$@" -- {entry}
"""


def reward_file(name: str, verifier: str, tokenizer: str) -> str:
    return f'''"""OpenRLHF reward function for spec '{name}' (written by `composer compile`).

`--reward.remote_url reward.py`: OpenRLHF calls reward_func(queries, prompts, labels) in its vLLM engine
actors; the reward is the composer's registered '{verifier}' verifier on the response.
"""

from composer.backends.openrlhf.reward import make_reward_func

reward_func = make_reward_func(verifier={verifier!r}, tokenizer={tokenizer!r})
'''


def agent_file(name: str) -> str:
    return f'''"""OpenRLHF agent for spec '{name}' (written by `composer compile`).

`--train.agent_func_path agent.py`: OpenRLHF instantiates AgentExecutor() in each vLLM engine actor; it
runs the spec's guide (phases by the trainer's step) and scores the rollout with the spec's verifier.
"""

from composer.backends.openrlhf.agent import executor_class

AgentExecutor = executor_class("plan.json")
'''


def readme(v, plan, runs: list[Run], layout: Layout, inputs: Inputs, warnings: dict, commands: list[str]) -> str:
    spec = v.spec
    lines = [f"# OpenRLHF bundle: {spec.name}", "", spec.summary, "",
             f"Compiled from `{plan['file']}` by `composer compile --backend openrlhf` for "
             f"{layout.nodes} node(s) x {layout.gpus_per_node} GPU(s). {plan['total_steps']} steps in "
             f"{len(runs)} OpenRLHF run(s): {', '.join(r.name for r in runs)}.", "",
             "## Launch", "", "```bash", "./launch.sh                      # head at $RAY_ADDRESS or http://127.0.0.1:8265",
             "./launch.sh http://HEAD:8265     # another head",
             "./launch.sh --check              # start the entry points on the cluster, check, exit (no training)",
             "```", "", "The bundle is self-contained: copy the whole folder to the head node (any path) and run "
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
              f"- The policy model at `{inputs.policy_path}` on every node (a local path: it must exist there)."]
    for name, path in inputs.source_paths.items():
        if path != "self":
            lines.append(f"- The model of source `{name}` at `{path}` on every node.")
    lines += [f"- Writable `{layout.cluster_dir}` on the nodes (checkpoints, final models, TensorBoard logs).", ""]
    if layout.wandb_project:
        lines += [f"W&B project `{layout.wandb_project}`: export WANDB_API_KEY before ./launch.sh.", ""]
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
              + (", reward.py" if any(r.trainer == "ppo" and not r.plugin.get("agent") for r in runs) else "")
              + (", agent.py" if any(r.plugin.get("agent") for r in runs) else "") + ".", ""]
    return "\n".join(lines)
