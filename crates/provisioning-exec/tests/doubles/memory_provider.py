#!/usr/bin/env python3
"""A reference provider for the plugin protocol (docs/plugin-protocol.md).

Standard library only. Its "machines" live in memory, keyed by the attempt
key; it implements both test hooks (inject_fault, lose_node), so the whole
seam contract suite runs against it.

    python3 memory_provider.py [--defect NAME]

Defects, for tests that the suite catches a broken provider:
    create-anew        create_node never adopts: it makes a new node each time
    garbage-create     create_node answers a result of the wrong shape
    die-on-create      the program exits when asked to create a node
    silent-create      create_node is never answered
    noisy              writes junk lines and stderr chatter between replies
"""

import json
import sys

PROTOCOL = "provisioning-plugin"
VERSION = 1
METHODS = [
    "create_node",
    "lookup_endpoint",
    "start_bootstrap",
    "complete_bootstrap",
    "cancel_bootstrap",
    "destroy_node",
    "list_nodes",
]
FAULTS = ["definite", "ambiguous_done", "ambiguous_undone"]


def key_id(key):
    node = key["node"]
    return (key["run"], node["group"], int(node["index"]), int(key["attempt"]))


def key_text(key):
    run, group, index, attempt = key_id(key)
    return "%s/%s-%d/a%d" % (run, group, index, attempt)


class Refused(Exception):
    def __init__(self, disposition, message):
        Exception.__init__(self, message)
        self.disposition = disposition
        self.message = message


class Provider:
    def __init__(self, defect):
        self.defect = defect
        # key id -> {"key": key, "lease": str, "session": str or None}
        self.nodes = {}
        self.faults = {}  # method -> [fault, ...]
        self.serial = 0
        self.after_reply = []  # observations to send once the reply is out

    def send(self, message):
        sys.stdout.write(json.dumps(message, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    def observe(self, kind, key, **fields):
        message = {"observation": kind, "key": key}
        message.update(fields)
        self.send(message)

    def take_fault(self, method):
        queue = self.faults.get(method)
        if queue:
            return queue.pop(0)
        return None

    def fail_before(self, fault, method):
        """Faults that do nothing: raised before the work."""
        if fault == "definite":
            raise Refused("definite", "injected: %s refused" % method)
        if fault == "ambiguous_undone":
            raise Refused("ambiguous", "injected: %s timed out" % method)

    def fail_after(self, fault, method):
        if fault == "ambiguous_done":
            raise Refused("ambiguous", "injected: the reply of %s was lost" % method)

    # The methods.

    def create_node(self, key, args):
        if self.defect == "die-on-create":
            sys.exit(3)
        if self.defect == "silent-create":
            return None
        fault = self.take_fault("create_node")
        ident = key_id(key)
        node = self.nodes.get(ident)
        if node is not None and self.defect != "create-anew":
            # Look first: adopt. A definite fault never hides a live node.
            if fault == "ambiguous_undone":
                raise Refused("ambiguous", "injected: create_node timed out")
            result = {"lease": node["lease"], "endpoint": None, "adopted": True}
            self.fail_after(fault, "create_node")
            return result
        self.fail_before(fault, "create_node")
        self.serial += 1
        lease = "mem:%s#%d" % (key_text(key), self.serial)
        self.nodes[ident] = {"key": key, "lease": lease, "session": None}
        self.fail_after(fault, "create_node")
        if self.defect == "garbage-create":
            return {"lease": 17}
        return {"lease": lease, "endpoint": None, "adopted": False}

    def lookup_endpoint(self, key, args):
        fault = self.take_fault("lookup_endpoint")
        self.fail_before(fault, "lookup_endpoint")
        if key_id(key) not in self.nodes:
            raise Refused("not_found", "no node for %s" % key_text(key))
        self.fail_after(fault, "lookup_endpoint")
        return {"ready": True, "endpoint": "memory://%s" % key_text(key)}

    def start_bootstrap(self, key, args):
        fault = self.take_fault("start_bootstrap")
        self.fail_before(fault, "start_bootstrap")
        node = self.nodes.get(key_id(key))
        if node is None:
            raise Refused("not_found", "no node for %s" % key_text(key))
        if node["session"] is not None:
            result = {"session": node["session"], "adopted": True}
        else:
            node["session"] = "boot:%s" % key_text(key)
            self.observe("progress", key, stage="created")
            self.observe("progress", key, stage="connecting")
            self.observe("progress", key, stage="connected")
            self.observe("progress", key, stage="waiting_for_join")
            # The agent "joins" once the session is known to the host.
            self.after_reply.append(("joined", key))
            result = {"session": node["session"], "adopted": False}
        self.fail_after(fault, "start_bootstrap")
        return result

    def complete_bootstrap(self, key, args):
        fault = self.take_fault("complete_bootstrap")
        self.fail_before(fault, "complete_bootstrap")
        node = self.nodes.get(key_id(key))
        if node is None:
            raise Refused("not_found", "no node for %s" % key_text(key))
        if node["session"] is not None:
            node["session"] = None
            self.observe("closed", key)
        self.fail_after(fault, "complete_bootstrap")
        return {}

    def cancel_bootstrap(self, key, args):
        fault = self.take_fault("cancel_bootstrap")
        self.fail_before(fault, "cancel_bootstrap")
        node = self.nodes.get(key_id(key))
        if node is not None:
            node["session"] = None
        self.fail_after(fault, "cancel_bootstrap")
        return {}  # absent counts as success

    def destroy_node(self, key, args):
        fault = self.take_fault("destroy_node")
        self.fail_before(fault, "destroy_node")
        self.nodes.pop(key_id(key), None)
        self.fail_after(fault, "destroy_node")
        return {}  # absent counts as success

    def list_nodes(self, key, args):
        fault = self.take_fault("list_nodes")
        self.fail_before(fault, "list_nodes")
        run = args["run"]
        nodes = [
            {"key": node["key"], "lease": node["lease"]}
            for ident, node in sorted(self.nodes.items())
            if ident[0] == run
        ]
        self.fail_after(fault, "list_nodes")
        return {"nodes": nodes}

    # The test hooks.

    def inject_fault(self, key, args):
        method, fault = args.get("method"), args.get("fault")
        if method not in METHODS or fault not in FAULTS:
            return {"armed": False}
        self.faults.setdefault(method, []).append(fault)
        return {"armed": True}

    def lose_node(self, key, args):
        node = self.nodes.pop(key_id(key), None)
        if node is None:
            return {"lost": False}
        self.observe("lost", key, cause="lease_gone")
        return {"lost": True}

    def handshake(self, key, args):
        if VERSION not in args.get("versions", []):
            raise Refused("definite", "this program speaks only version %d" % VERSION)
        return {
            "protocol": PROTOCOL,
            "version": VERSION,
            "program": "memory-provider" + ("" if self.defect is None else "-" + self.defect),
            "kind": "memory",
            "faults": [{"method": m, "fault": f} for m in METHODS for f in FAULTS],
            "lose_node": True,
        }

    def serve(self):
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                request = json.loads(line)
            except ValueError:
                sys.stderr.write("not JSON, ignored: %r\n" % line[:100])
                continue
            ident = request.get("id")
            method = request.get("method")
            handler = getattr(self, method, None) if method in HANDLED else None
            if self.defect == "noisy":
                sys.stdout.write("this line is not JSON\n")
                sys.stdout.write("[1, 2, 3]\n")
                sys.stderr.write("noisy: handling %s\n" % method)
            try:
                if handler is None:
                    raise Refused("definite", "unknown method %r" % method)
                result = handler(request.get("key"), request.get("args") or {})
                if result is None:
                    continue  # never answered (a defect)
                self.send({"id": ident, "result": result})
            except Refused as refused:
                self.send(
                    {
                        "id": ident,
                        "error": {
                            "disposition": refused.disposition,
                            "message": refused.message,
                        },
                    }
                )
            for kind, key in self.after_reply:
                self.observe(kind, key)
            self.after_reply = []


HANDLED = set(METHODS) | {"handshake", "inject_fault", "lose_node"}


def main(argv):
    defect = None
    if len(argv) == 3 and argv[1] == "--defect":
        defect = argv[2]
    elif len(argv) != 1:
        sys.stderr.write("usage: memory_provider.py [--defect NAME]\n")
        return 2
    Provider(defect).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
