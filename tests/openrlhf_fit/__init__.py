"""OpenRLHF 0.11.2's own PPO fit loop on CPU, in one process (issue 14; tests/test_openrlhf_fit.py).

`driver.py` runs a compiled bundle's entry point (`python -m composer.backends.openrlhf --plan plan.json
--run NAME`, i.e. the composer's hooks, then OpenRLHF's real `train_ppo_ray` parser and `train(args)`)
in a subprocess whose cwd is the bundle, with the CPU import stand-ins of tests/openrlhf_cpu_stubs on its
path. `standins.py` replaces only what needs a GPU cluster: Ray's cluster (an in-process object store
and in-process actors built from the classes Ray would ship), vLLM's engine (a CPU sampler returning
vLLM's output shapes), DeepSpeed's distributed parts (a gloo world of one and a world-size-1 engine),
and CUDA's device calls. The driver records what crossed the Ray boundary and writes one JSON report.
"""
