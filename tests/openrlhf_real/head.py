"""A private local Ray 2.55 head with the job server for tests/test_openrlhf_real.py (run in a subprocess).

    python head.py PORT GPUS     (env: RAY_TMP, a private temp dir; PYTHONPATH with site/ and the stubs)

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


def main() -> None:
    import ray

    port, gpus = int(sys.argv[1]), int(sys.argv[2])
    ray.init(num_cpus=8, num_gpus=gpus, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
             _temp_dir=os.environ["RAY_TMP"], log_to_driver=False)
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
