"""A local Ray 2.55 head with the job server, for test_openrlhf_ray.py (started in a subprocess).

`ray start --head` would leave daemons only `ray stop` (every Ray of the machine) ends; a head started
by ray.init belongs to this process and ends with it. Prints `head: {"address": ...}` once the job
server answers, then holds the head until its standard input closes.
"""

import json
import os
import sys
import time
import urllib.request


def main() -> None:
    import ray

    port = int(sys.argv[1])
    ray.init(num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=port,
             _temp_dir=os.environ["RAY_TMP"], log_to_driver=False)
    address = f"http://127.0.0.1:{port}"
    for _ in range(120):  # the dashboard's job module starts after ray.init returns
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
