"""One node of the Dask example (examples/dask.toml): a scheduler or a worker.

    python3 examples/dask/node.py scheduler
    python3 examples/dask/node.py worker

Everything a node needs comes from what `provision` tells its workload:
PROVISION_ADDRESS (where it listens), PROVISION_NODE_ID (the worker's name)
and PROVISION_PEERS_FILE (where the scheduler is). A worker waits until the
peers file lists a ready scheduler, then runs `dask worker` against it; Dask
itself reconnects a worker whose scheduler restarts at the same address
(local nodes keep their slot's address across replacements).
"""

import json
import os
import sys
import time

SCHEDULER_GROUP = os.environ.get("DASK_SCHEDULER_GROUP", "scheduler")
SCHEDULER_PORT = int(os.environ.get("DASK_SCHEDULER_PORT", "8786"))
SCHEDULER_WAIT_SECONDS = 600


def scheduler_address():
    """The scheduler's address from the peers file, once it lists one."""
    deadline = time.monotonic() + SCHEDULER_WAIT_SECONDS
    while time.monotonic() < deadline:
        try:
            with open(os.environ["PROVISION_PEERS_FILE"]) as peers_file:
                peers = json.load(peers_file)["peers"]
        except (OSError, ValueError, KeyError):
            peers = []
        for peer in peers:
            if peer["group"] == SCHEDULER_GROUP:
                return "tcp://%s:%d" % (peer["address"], SCHEDULER_PORT)
        time.sleep(0.2)
    sys.exit("no ready scheduler in the peers file after %d s" % SCHEDULER_WAIT_SECONDS)


def dask_command():
    """`dask` beside the running Python (a virtual environment's bin)."""
    return os.path.join(os.path.dirname(sys.executable), "dask")


def main():
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    address = os.environ["PROVISION_ADDRESS"]
    dask = dask_command()
    if role == "scheduler":
        argv = [dask, "scheduler", "--host", address, "--port", str(SCHEDULER_PORT),
                "--no-dashboard"]
    elif role == "worker":
        argv = [dask, "worker", scheduler_address(), "--host", address,
                "--name", os.environ["PROVISION_NODE_ID"], "--nthreads", "1",
                "--nworkers", "1", "--no-dashboard", "--no-nanny"]
    else:
        sys.exit("usage: node.py scheduler|worker")
    sys.stdout.flush()
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
