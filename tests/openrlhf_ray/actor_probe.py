"""Driver for test_openrlhf_ray.py (run in a subprocess, cwd = a compiled bundle, CPU stand-ins on PYTHONPATH).

Installs the bundle's hooks as the entry point does, imports OpenRLHF 0.11.2's real
`openrlhf.trainer.ppo_trainer` (whose `@ray.remote class PPOTrainer(BasePPOTrainer)` runs at import),
starts a local Ray with the bundle's runtime env (working_dir, worker_process_setup_hook), and sends the
class Ray would instantiate for the PPOTrainer actor (`__ray_metadata__.modified_class`, pickled by value
as Ray exports actor classes) into a Ray worker. There, OpenRLHF's own `train_step` runs for `--steps`
steps on an instance whose experience maker, model groups and vLLM engines are recording fakes, and the
worker reports which steps broadcast weights to vLLM, the `composer/synced` flag and the step the samples
generator carries into the labels. Prints one JSON line.
"""

import argparse
import json
import os
import sys

HOOK = "composer.backends.openrlhf.hooks.setup_worker"


def run_in_worker(cls, steps: int) -> dict:
    """Runs in a Ray worker: OpenRLHF's train_step on the shipped class, with recording fakes around it."""
    from types import SimpleNamespace as NS

    import torch

    from composer.backends.openrlhf import hooks

    calls = []

    class Group:
        def async_run_method_batch(self, method_name, **kw):
            calls.append(method_name)
            return []

        def async_run_method(self, method_name, **kw):
            calls.append(method_name)
            return []

    exp = NS(sequences=torch.ones(1, 4, dtype=torch.long), info={"reward": torch.zeros(1)},
             response_length=torch.ones(1), truncated=torch.zeros(1))
    t = cls.__new__(cls)  # the actor's instance, without PPOTrainer.__init__'s models and datasets
    t.experience_maker = NS(make_experience_batch=lambda samples: [exp])
    t.tokenizer = NS(decode=lambda ids, skip_special_tokens=True: ["x"])
    t.args = NS(train=NS(dynamic_batch_enable=False), critic=NS(freezing_steps=-1), ds=NS(enable_sleep=False),
                vllm=NS(enable_sleep=False), rollout=NS(batch_size=1, n_samples_per_prompt=1))
    t.actor_model_group, t.critic_model_group, t.vllm_engines = Group(), None, ["engine"]
    t.kl_ctl = NS(value=0.0, update=lambda *a: None)
    t.samples_generator = NS()
    out = {"broadcast_steps": [], "synced": [], "carried_step": [],
           "setup_hook_ran": bool(hooks._STATE.get("installed")),
           "train_step": getattr(cls.train_step, "__qualname__", ""),
           "composer": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(hooks.__file__))))}
    step = 0
    for _ in range(steps):
        before = calls.count("broadcast_to_vllm")
        status, nxt = t.train_step([], step)
        if calls.count("broadcast_to_vllm") > before:
            out["broadcast_steps"].append(step)
        out["synced"].append(status.get("composer/synced"))
        out["carried_step"].append(getattr(t.samples_generator, "composer_step", None))
        step = nxt
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--local", action="store_true", help="no Ray worker: the shipped class goes through Ray's "
                    "pickling and back in this process, and train_step runs here (the fast variant)")
    ns = ap.parse_args()
    from composer.backends.openrlhf import hooks

    plan, run = hooks.load("plan.json", None)
    hooks.install(plan, run, driver=True)
    import openrlhf.trainer.ppo_trainer as mod

    shipped = mod.PPOTrainer.__ray_metadata__.modified_class
    if ns.local:
        from ray import cloudpickle
        from ray._common.serialization import pickle_dumps

        cls = cloudpickle.loads(pickle_dumps(shipped, "actor class"))  # as Ray exports actor classes
        print("probe: " + json.dumps({"driver_train_step": shipped.train_step.__qualname__,
                                      "worker": run_in_worker(cls, ns.steps)}))
        return
    import ray

    env = {"COMPOSER_PLAN": "plan.json", "COMPOSER_RUN": run["name"], "PYTHONPATH": os.environ["PYTHONPATH"]}
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=os.environ.get("RAY_TMP"),
             runtime_env={"working_dir": ".", "worker_process_setup_hook": HOOK, "env_vars": env,
                          "excludes": ["__pycache__", "*.pyc"]})
    try:
        worker = ray.get(ray.remote(num_cpus=0)(run_in_worker).remote(shipped, ns.steps), timeout=300)
    finally:
        ray.shutdown()
    print("probe: " + json.dumps({"driver_train_step": shipped.train_step.__qualname__, "worker": worker}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
