"""A private local Ray 2.55 head with the job server for tests/test_openrlhf_real.py (run in a subprocess).

    python head.py PORT GPUS     (env: RAY_TMP, a private temp dir; PYTHONPATH with site/ and the stubs)

Every port is a free one: the dashboard's (PORT), the GCS's and the workers' (Ray picks them for a head
ray.init starts), and the dashboard agent's HTTP port, which ray.init leaves at Ray's fixed 52365 (taken
when another head runs on the machine): set here to a free port through RayParams.
GPUS logical GPU resources (Ray's own bookkeeping, no device behind them), so OpenRLHF's placement groups
and `num_gpus` actors schedule as on a cluster. A head started by ray.init belongs to this process and ends
with it (no `ray stop`, which would end every Ray of the machine). Prints `head: {"address": ...}` once the
job server answers, then holds the head until its standard input closes.
"""

import json
import os
import sys
import time
import urllib.request


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_agent_port() -> None:
    """ray.init has no argument for the dashboard agent's listen port: give RayParams a free one."""
    from ray._private import parameter

    init = parameter.RayParams.__init__

    def init_(self, *args, **kwargs):
        kwargs.setdefault("dashboard_agent_listen_port", free_port())
        init(self, *args, **kwargs)

    parameter.RayParams.__init__ = init_


def main() -> None:
    import ray

    free_agent_port()

    port, gpus = int(sys.argv[1]), int(sys.argv[2])
    ray.init(num_cpus=8, num_gpus=gpus, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
             _temp_dir=os.environ["RAY_TMP"], log_to_driver=False)
    # what `ray start` does and ray.init does not: the job supervisor gives each job's driver the address in
    # TEMP/ray_current_cluster; without it, it takes any GCS running on the machine (another head's)
    from ray._private.utils import write_ray_address

    write_ray_address(ray.get_runtime_context().gcs_address, os.environ["RAY_TMP"])
    address = f"http://127.0.0.1:{port}"
    for _ in range(240):  # the dashboard's job module starts after ray.init returns
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2).read()
            break
        except OSError:
            time.sleep(0.5)
    print("head: " + json.dumps({"address": address}), flush=True)
    sys.stdin.read()
    ray.shutdown()


if __name__ == "__main__":
    main()
