"""`python -m composer.backends.openrlhf --plan plan.json --run NAME -- <OpenRLHF arguments>`

Starts one run of a compiled bundle: PPO-style runs go through `openrlhf.cli.train_ppo_ray` in this
process after the composer's hooks are installed (in the driver, and in every Ray worker through the
job's worker_process_setup_hook); SFT runs exec `torchrun -m openrlhf.cli.train_sft` on this node.
Argument values written `env:NAME` are read from the environment here (secrets such as the W&B key
never enter the bundle).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

OPENRLHF_ENV = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m composer.backends.openrlhf", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="the bundle's plan.json")
    ap.add_argument("--run", default=None, help="which run of the plan (a stage name, or main)")
    ap.add_argument("--check", action="store_true", help="check instead of training: the plan, the arguments "
                    "against OpenRLHF's parser, and (PPO runs) the worker setup hook and the shipped code in a Ray "
                    "worker; prints one `composer-check` JSON line, exit 0 when everything holds")
    ap.add_argument("--no-preflight", action="store_true", help="skip the resource preflight (by default a run first "
                    "checks that the Ray cluster has the nodes and GPUs the bundle was compiled for, and fails at once "
                    "naming what is missing, instead of OpenRLHF waiting forever for its placement group)")
    ns = ap.parse_args(own)
    plan_path = os.path.abspath(ns.plan)
    plan = json.load(open(plan_path))
    runs = plan["openrlhf"]["runs"]
    run = next((r for r in runs if r["name"] == (ns.run or runs[0]["name"])), None)
    if run is None:
        ap.error(f"--run: the plan has runs {', '.join(r['name'] for r in runs)}")
    args = [os.environ.get(a[4:], "") if a.startswith("env:") else a for a in (rest or run["argv"])]
    if ns.check:
        sys.exit(check(plan_path, plan, run, args))
    if plan.get("stop_tokens"):  # the run's first line: where every response ends (composer/stops.py)
        print(f"composer: stop tokens: {plan['stop_tokens']}", flush=True)
    if run["trainer"] == "sft":
        if not ns.no_preflight and os.environ.get("COMPOSER_JOB"):  # in the bundle's Ray job: its cluster
            import ray

            ray.init()
            preflight(plan)
            ray.shutdown()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run['nproc']}",
               "-m", "openrlhf.cli.train_sft", *args]
        os.execvp(cmd[0], cmd)
    import ray

    from composer.backends.openrlhf import hooks

    ray.init(runtime_env=runtime_env(plan_path, run))
    if not ns.no_preflight:
        preflight(plan)
    hooks.install(plan, run, driver=True)
    judges = hooks.start_judges(run["plugin"].get("judges") or {},  # noqa: F841  (kept alive with the driver)
                                run["plugin"].get("judge_max_len"))
    sys.argv = ["openrlhf.cli.train_ppo_ray", *args]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


def runtime_env(plan_path: str, run: dict) -> dict:
    """The runtime env this driver adds. Under the bundle's `ray job submit` the job already ships the bundle
    (working_dir) and names the setup hook; started by hand, it ships the plan's folder itself (relative to
    nothing on this machine but the plan: the bundle holds the composer's packages)."""
    env = {k: os.environ.get(k, v) for k, v in OPENRLHF_ENV.items()}
    env["COMPOSER_RUN"] = run["name"]
    out = {"env_vars": env}
    if not os.environ.get("COMPOSER_JOB"):
        env["COMPOSER_PLAN"] = "plan.json"
        out.update(working_dir=os.path.dirname(plan_path), worker_process_setup_hook=HOOK)
    return out


HOOK = "composer.backends.openrlhf.hooks.setup_worker"


def _probe() -> dict:
    """Runs in a Ray worker: what the setup hook installed there and where the composer code came from."""
    import composer
    from composer.backends.openrlhf import hooks

    return {"setup_hook_ran": bool(hooks._STATE.get("installed")), "run": (hooks._STATE.get("run") or {}).get("name"),
            "composer": os.path.dirname(os.path.abspath(composer.__file__)), "cwd": os.getcwd()}


def cluster_fit(layout: dict, nodes: list[dict]) -> tuple[dict, list[str]]:
    """(what the cluster has, what it lacks) for the bundle's layout: `nodes` alive Ray nodes with at least
    `gpus_per_node` GPUs each. OpenRLHF would otherwise wait forever in `ray.get(pg.ready())`."""
    want_nodes, per_node = int(layout.get("nodes", 1)), int(layout.get("gpus_per_node", 1))
    gpus = sorted((int(n.get("Resources", {}).get("GPU", 0)) for n in nodes if n.get("Alive")), reverse=True)
    have = {"nodes": len(gpus), "gpus_per_node": gpus, "gpus": sum(gpus)}
    fit = sum(1 for g in gpus if g >= per_node)
    if fit >= want_nodes:
        return have, []
    return have, [f"the bundle was compiled for {want_nodes} node(s) x {per_node} GPU(s) "
                  f"({want_nodes * per_node} GPUs); the Ray cluster has {len(gpus)} node(s) with "
                  f"{', '.join(map(str, gpus)) or 'no'} GPU(s): missing {want_nodes - fit} node(s) with "
                  f"{per_node} GPU(s) each (OpenRLHF would wait for them forever); start them, or recompile "
                  f"with --nodes / --gpus-per-node for this cluster"]


def preflight(plan: dict) -> None:
    """The resource preflight every run starts with (connected to the cluster): exit 1 naming what the
    cluster lacks for the bundle's layout; prints one `composer-preflight` JSON line."""
    import ray

    have, missing = cluster_fit(plan["openrlhf"].get("layout") or {}, ray.nodes())
    print("composer-preflight: " + json.dumps({"cluster": have, "problems": missing}), flush=True)
    if missing:
        print("\n".join(missing) + "\n(./launch.sh --no-preflight skips this check)", file=sys.stderr, flush=True)
        sys.exit(1)


def check(plan_path: str, plan: dict, run: dict, args: list[str]) -> int:
    """--check: everything the run needs before a model loads, on the machine it runs on; 0 when all holds."""
    import composer

    report = {"run": run["name"], "trainer": run["trainer"], "argv": args, "python": sys.executable,
              "cwd": os.getcwd(), "composer": os.path.dirname(os.path.abspath(composer.__file__))}
    problems = []
    try:
        from composer.backends.openrlhf import parser

        parser.check(run["trainer"], args)
        report["openrlhf_parser"] = "accepted"
    except ImportError as e:
        report["openrlhf_parser"] = f"skipped: {e}"
    except Exception as e:  # noqa: BLE001 - parser.ArgsError and whatever OpenRLHF's checks raise
        problems.append(f"OpenRLHF rejects the arguments: {e}")
    if run["trainer"] == "ppo":
        import ray

        ray.init(runtime_env=runtime_env(plan_path, run))
        report["cluster"], missing = cluster_fit(plan["openrlhf"].get("layout") or {}, ray.nodes())
        problems += missing
        report["worker"] = w = ray.get(ray.remote(num_cpus=0)(_probe).remote())
        if not w["setup_hook_ran"] or w["run"] != run["name"]:
            problems.append(f"the worker setup hook did not install run '{run['name']}' in a Ray worker: {w}")
        ray.shutdown()
    report["problems"] = problems
    print("composer-check: " + json.dumps(report), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    main()
