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
    ns = ap.parse_args(own)
    plan_path = os.path.abspath(ns.plan)
    plan = json.load(open(plan_path))
    runs = plan["openrlhf"]["runs"]
    run = next((r for r in runs if r["name"] == (ns.run or runs[0]["name"])), None)
    if run is None:
        ap.error(f"--run: the plan has runs {', '.join(r['name'] for r in runs)}")
    args = [os.environ.get(a[4:], "") if a.startswith("env:") else a for a in (rest or run["argv"])]
    if run["trainer"] == "sft":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run['nproc']}",
               "-m", "openrlhf.cli.train_sft", *args]
        os.execvp(cmd[0], cmd)
    import ray

    from composer.backends.openrlhf import hooks

    env = {k: os.environ.get(k, v) for k, v in OPENRLHF_ENV.items()}
    env["COMPOSER_RUN"] = run["name"]
    runtime_env = {"env_vars": env}
    if not os.environ.get("COMPOSER_JOB"):  # not under the bundle's `ray job submit`: ship it ourselves
        import components
        import composer

        env["COMPOSER_PLAN"] = "plan.json"
        runtime_env.update(working_dir=os.path.dirname(plan_path),
                           py_modules=[os.path.dirname(composer.__file__), os.path.dirname(components.__file__)],
                           worker_process_setup_hook="composer.backends.openrlhf.hooks.setup_worker")
    ray.init(runtime_env=runtime_env)
    hooks.install(plan, run, driver=True)
    judges = hooks.start_judges(run["plugin"].get("judges") or {})  # noqa: F841  (kept alive with the driver)
    sys.argv = ["openrlhf.cli.train_ppo_ray", *args]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
