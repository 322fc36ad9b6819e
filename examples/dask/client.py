"""Submits a computation to the Dask cluster of examples/dask.toml.

    python3 examples/dask/client.py --workers 3 [--run dask-demo]

Finds the scheduler with `provision peers --json` (the list every node's
peers file holds), waits until the given number of workers registered,
runs one small task on every worker and a sum over many tasks, and prints
what it saw as one JSON line: the worker names and the sum.
"""

import argparse
import json
import os
import subprocess
import sys

from dask.distributed import Client


def scheduler_address(provision, run, group, port):
    command = [provision, "peers", "--json", "--group", group]
    if run:
        command += ["--run", run]
    peers = json.loads(subprocess.run(command, check=True, capture_output=True,
                                      text=True).stdout)["peers"]
    if not peers:
        sys.exit("the run has no ready %s" % group)
    return "tcp://%s:%d" % (peers[0]["address"], port)


def square(x):
    return x * x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--run")
    parser.add_argument("--provision", default=os.environ.get("PROVISION", "provision"))
    parser.add_argument("--scheduler-group", default="scheduler")
    parser.add_argument("--port", type=int, default=8786)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    address = scheduler_address(args.provision, args.run, args.scheduler_group, args.port)
    with Client(address, timeout=args.timeout) as client:
        client.wait_for_workers(args.workers, timeout=args.timeout)
        # One task on every worker: each answers with its own name.
        names = client.run(lambda dask_worker: dask_worker.name)
        total = client.submit(sum, client.map(square, range(100))).result(timeout=args.timeout)
    print(json.dumps({"workers": sorted(str(n) for n in names.values()), "sum": total}))


if __name__ == "__main__":
    main()
