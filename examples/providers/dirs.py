#!/usr/bin/env python3
"""A reference provider program: its "machines" are directories on disk.

It speaks the plugin protocol of docs/plugin-protocol.md over stdin/stdout
and needs nothing but the Python standard library. Each machine is a
directory under ROOT/machines/, named by a fresh token that is also its
lease. The machine's attempt key is written into it (key.json) as its tag,
so the program finds its machines again by looking, as a provider of a real
cloud would look up instances by tag: a restarted program, or a second one
on the same root, adopts what an earlier one created.

    python3 dirs.py [--root DIR]

With no --root, a fresh temporary directory is used and removed at exit.

What lives in a machine directory:
    key.json      the attempt key (the tag)
    lease         the lease handle, the directory's own name
    session       the bootstrap session handle, while a session is open
    joined        present once the session's agent joined (harness mode)
    template.json the node template the last bootstrap was started with

Every test hook of the protocol is implemented (inject_fault with every
fault, lose_node with a cause, and the battery's live, emit and release;
docs/plugin-protocol.md section 6), so both the seam contract suite and the
battery run against it:

    provision conformance --plugin "python3 examples/providers/dirs.py --root /tmp/x"

A hung call (the "hang" fault) is parked: the program keeps reading and
answering other lines, and performs the parked request only when a
"release" lets it go. When the handshake says "harness": true, sessions
report nothing on their own; the harness makes them report with "emit".

dirs_broken.py is the same provider with one deliberate defect, for showing
that the suite catches it.
"""

import fcntl
import json
import os
import secrets
import shutil
import sys
import tempfile

PROTOCOL = "provisioning-plugin"
VERSION = 1
PROGRAM = "dirs-provider"
KIND = "dirs"
METHODS = (
    "create_node",
    "lookup_endpoint",
    "start_bootstrap",
    "complete_bootstrap",
    "cancel_bootstrap",
    "destroy_node",
    "list_nodes",
)
FAULTS = ("definite", "ambiguous_done", "ambiguous_undone", "hang")
HOOKS = ("live", "emit", "release", "lose_cause")
LOSS_CAUSES = ("agent_gone", "lease_gone", "workload_exited")
FAILURES = ("connect_failed", "boot_check_failed", "start_failed", "join_failed", "stream_error")
STAGES = (
    "created",
    "connecting",
    "connected",
    "streaming",
    "boot_checking",
    "agent_starting",
    "waiting_for_join",
)
# The longest request line this program reads; the host never sends more.
LINE_MAX = 1 << 20


class CallError(Exception):
    """An error reply: the disposition tells the host what may have happened."""

    def __init__(self, disposition, message):
        Exception.__init__(self, message)
        self.disposition = disposition
        self.message = message


def parse_key(key):
    """The attempt key as a comparable tuple; a definite error when malformed."""
    try:
        node = key["node"]
        run, group = key["run"], node["group"]
        index, attempt = node["index"], key["attempt"]
    except (TypeError, KeyError):
        raise CallError("definite", "the request has no valid attempt key")
    if not (isinstance(run, str) and isinstance(group, str)):
        raise CallError("definite", "run and group must be strings")
    if not (isinstance(index, int) and isinstance(attempt, int)):
        raise CallError("definite", "index and attempt must be integers")
    return (run, group, index, attempt)


def describe(ident):
    run, group, index, attempt = ident
    return "%s/%s-%d/a%d" % (run, group, index, attempt)


def canonical_key(ident):
    run, group, index, attempt = ident
    return {"run": run, "node": {"group": group, "index": index}, "attempt": attempt}


class Machines:
    """The machine directories under one root, found by their tags."""

    def __init__(self, root):
        self.root = os.path.abspath(root)
        self.machines = os.path.join(self.root, "machines")
        self.scratch = os.path.join(self.root, "scratch")
        os.makedirs(self.machines, exist_ok=True)
        os.makedirs(self.scratch, exist_ok=True)
        self.lock_path = os.path.join(self.root, "lock")

    def locked(self):
        """A lock over the root, so that two programs never both create."""
        return RootLock(self.lock_path)

    def path(self, lease):
        if not isinstance(lease, str) or not lease or "/" in lease or lease.startswith("."):
            return None
        return os.path.join(self.machines, lease)

    def tag_of(self, lease):
        """The attempt key a machine is tagged with, or None if it is gone."""
        path = self.path(lease)
        if path is None:
            return None
        try:
            with open(os.path.join(path, "key.json"), encoding="utf-8") as f:
                return parse_key(json.load(f))
        except (OSError, ValueError, CallError):
            return None

    def all(self):
        """Every machine as (ident, lease), in a stable order."""
        found = []
        try:
            names = sorted(os.listdir(self.machines))
        except OSError:
            return found
        for name in names:
            ident = self.tag_of(name)
            if ident is not None:
                found.append((ident, name))
        return found

    def find(self, ident):
        """The leases of every machine tagged with `ident`."""
        return [lease for tag, lease in self.all() if tag == ident]

    def create(self, ident):
        """Makes a machine for `ident` and returns its lease.

        The directory is built in scratch/ and renamed into place, so a
        machine is either wholly there, tag included, or not there at all.
        """
        lease = "m-" + secrets.token_hex(8)
        building = os.path.join(self.scratch, lease)
        os.makedirs(building)
        with open(os.path.join(building, "key.json"), "w", encoding="utf-8") as f:
            json.dump(canonical_key(ident), f)
        with open(os.path.join(building, "lease"), "w", encoding="utf-8") as f:
            f.write(lease + "\n")
        os.rename(building, os.path.join(self.machines, lease))
        return lease

    def remove(self, lease):
        """Removes a machine; returns whether it was there."""
        path = self.path(lease)
        if path is None or not os.path.isdir(path):
            return False
        # Rename first: the machine vanishes at once, the rest is tidying.
        doomed = os.path.join(self.scratch, "gone-" + secrets.token_hex(8))
        try:
            os.rename(path, doomed)
        except OSError:
            return False
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def session(self, lease):
        path = self.path(lease)
        try:
            with open(os.path.join(path, "session"), encoding="utf-8") as f:
                return f.read().strip() or None
        except (OSError, TypeError):
            return None

    def open_session(self, lease, template):
        path = self.path(lease)
        session = "s-" + secrets.token_hex(8)
        with open(os.path.join(path, "template.json"), "w", encoding="utf-8") as f:
            json.dump(template, f)
        staged = os.path.join(path, "session.new")
        with open(staged, "w", encoding="utf-8") as f:
            f.write(session + "\n")
        os.rename(staged, os.path.join(path, "session"))
        return session

    def close_session(self, lease):
        """Ends the machine's session; returns whether one was open."""
        path = self.path(lease)
        if path is None:
            return False
        self.set_joined(lease, False)
        try:
            os.remove(os.path.join(path, "session"))
            return True
        except OSError:
            return False

    def joined(self, lease):
        path = self.path(lease)
        return path is not None and os.path.exists(os.path.join(path, "joined"))

    def set_joined(self, lease, joined):
        path = self.path(lease)
        if path is None:
            return
        marker = os.path.join(path, "joined")
        if joined:
            with open(marker, "w", encoding="utf-8"):
                pass
        else:
            try:
                os.remove(marker)
            except OSError:
                pass


class RootLock:
    def __init__(self, path):
        self.path = path
        self.file = None

    def __enter__(self):
        self.file = open(self.path, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
        return False


class Provider:
    """The protocol's methods over `Machines`."""

    program = PROGRAM

    def __init__(self, machines):
        self.machines = machines
        self.armed = {}  # method -> [fault, ...], in the order they were armed
        self.after_reply = []  # observations to send once the reply is out
        # Requests held by a "hang" fault, oldest first, until "release".
        self.held = []
        # Whether a harness drives the sessions (handshake "harness": true).
        self.harness = False
        # Set while a released request runs: its fault was the hang.
        self.releasing = False

    # Output.

    def send(self, message):
        sys.stdout.write(json.dumps(message, separators=(",", ":")) + "\n")
        sys.stdout.flush()

    def observe(self, kind, ident, **fields):
        message = {"observation": kind, "key": canonical_key(ident)}
        message.update(fields)
        self.send(message)

    # Faults.

    def fault_for(self, method):
        if self.releasing:
            return None
        queue = self.armed.get(method)
        return queue.pop(0) if queue else None

    def takes_hang(self, method):
        """Whether the next fault armed for `method` is a hang (taken if so)."""
        queue = self.armed.get(method)
        if queue and queue[0] == "hang":
            queue.pop(0)
            return True
        return False

    @staticmethod
    def refuse_before(fault, method):
        """A fault that leaves the work undone."""
        if fault == "definite":
            raise CallError("definite", "injected fault: %s refused" % method)
        if fault == "ambiguous_undone":
            raise CallError("ambiguous", "injected fault: %s timed out" % method)

    @staticmethod
    def refuse_after(fault, method):
        """A fault that hides work done: the reply was lost."""
        if fault == "ambiguous_done":
            raise CallError("ambiguous", "injected fault: the reply of %s was lost" % method)

    def machine_of(self, ident, lease):
        """The lease if it names a live machine tagged with `ident`."""
        if self.machines.tag_of(lease) != ident:
            raise CallError("not_found", "no machine %r for %s" % (lease, describe(ident)))
        return lease

    # The methods.

    def existing(self, ident):
        """The leases of the key's machines: create_node looks here first."""
        return self.machines.find(ident)

    def create_node(self, ident, args):
        fault = self.fault_for("create_node")
        with self.machines.locked():
            found = self.existing(ident)
            if found:
                # A definite fault never hides a live machine: adopt it (or
                # say ambiguous, which promises nothing).
                if fault == "ambiguous_undone":
                    raise CallError("ambiguous", "injected fault: create_node timed out")
                self.refuse_after(fault, "create_node")
                return {"lease": found[0], "endpoint": None, "adopted": True}
            self.refuse_before(fault, "create_node")
            lease = self.machines.create(ident)
        self.refuse_after(fault, "create_node")
        return {"lease": lease, "endpoint": None, "adopted": False}

    def lookup_endpoint(self, ident, args):
        fault = self.fault_for("lookup_endpoint")
        self.refuse_before(fault, "lookup_endpoint")
        lease = self.machine_of(ident, args.get("lease"))
        self.refuse_after(fault, "lookup_endpoint")
        if fault == "not_ready":
            return {"ready": False}
        return {"ready": True, "endpoint": "file://" + self.machines.path(lease)}

    def start_bootstrap(self, ident, args):
        fault = self.fault_for("start_bootstrap")
        lease = self.machine_of(ident, args.get("lease"))
        session = self.machines.session(lease)
        if session is not None:
            # As with create_node, a definite fault never hides the live
            # session: adopt it (or say ambiguous).
            if fault == "ambiguous_undone":
                raise CallError("ambiguous", "injected fault: start_bootstrap timed out")
            self.refuse_after(fault, "start_bootstrap")
            # An adopting start opens a new stream to its caller: the agent
            # joins that caller again, and says so again once it does.
            self.machines.set_joined(lease, False)
            return {"session": session, "adopted": True}
        self.refuse_before(fault, "start_bootstrap")
        session = self.machines.open_session(lease, args.get("template"))
        if not self.harness:
            for stage in ("created", "connecting", "connected", "waiting_for_join"):
                self.observe("progress", ident, stage=stage)
            # The "agent" joins once the host knows the session.
            self.after_reply.append(("joined", ident))
        self.refuse_after(fault, "start_bootstrap")
        return {"session": session, "adopted": False}

    def complete_bootstrap(self, ident, args):
        fault = self.fault_for("complete_bootstrap")
        self.refuse_before(fault, "complete_bootstrap")
        for_key = self.machines.find(ident)
        if not for_key:
            raise CallError("not_found", "no machine for %s" % describe(ident))
        if self.machines.close_session(for_key[0]):
            self.observe("closed", ident)
        self.refuse_after(fault, "complete_bootstrap")
        return {}

    def cancel_bootstrap(self, ident, args):
        fault = self.fault_for("cancel_bootstrap")
        self.refuse_before(fault, "cancel_bootstrap")
        for lease in self.machines.find(ident):
            self.machines.close_session(lease)
        self.refuse_after(fault, "cancel_bootstrap")
        return {}  # absent counts as success

    def destroy_node(self, ident, args):
        fault = self.fault_for("destroy_node")
        self.refuse_before(fault, "destroy_node")
        # Every machine tagged with the key goes, whatever lease was named.
        for lease in self.machines.find(ident):
            self.machines.remove(lease)
        self.refuse_after(fault, "destroy_node")
        return {}  # absent counts as success

    def list_nodes(self, ident, args):
        fault = self.fault_for("list_nodes")
        self.refuse_before(fault, "list_nodes")
        run = args.get("run")
        if not isinstance(run, str):
            raise CallError("definite", "list_nodes needs a run")
        nodes = [
            {"key": canonical_key(tag), "lease": lease}
            for tag, lease in self.machines.all()
            if tag[0] == run
        ]
        self.refuse_after(fault, "list_nodes")
        return {"nodes": nodes}

    # The test hooks.

    def inject_fault(self, args):
        method, fault = args.get("method"), args.get("fault")
        offered = fault in FAULTS or (fault == "not_ready" and method == "lookup_endpoint")
        if method not in METHODS or not offered:
            return {"armed": False}
        self.armed.setdefault(method, []).append(fault)
        return {"armed": True}

    def lose_node(self, ident, args):
        cause = args.get("cause", "lease_gone")
        if cause not in LOSS_CAUSES:
            raise CallError("definite", "unknown cause %r" % (cause,))
        leases = self.machines.find(ident)
        if not leases:
            return {"lost": False}
        for lease in leases:
            if cause == "lease_gone":
                self.machines.remove(lease)
            else:
                # The agent (or its workload) is gone; the machine stays.
                self.machines.close_session(lease)
        self.observe("lost", ident, cause=cause)
        return {"lost": True}

    def live(self, args):
        """The honest ledger: what exists for the run, from the disk."""
        run = args.get("run")
        if not isinstance(run, str):
            raise CallError("definite", "live needs a run")
        leases, sessions = [], []
        for tag, lease in self.machines.all():
            if tag[0] != run:
                continue
            leases.append({"key": canonical_key(tag), "lease": lease})
            session = self.machines.session(lease)
            if session is not None:
                sessions.append(
                    {"key": canonical_key(tag), "session": session, "joined": self.machines.joined(lease)}
                )
        return {"leases": leases, "sessions": sessions}

    def emit(self, ident, args):
        """Makes the key's live session report one event."""
        event = args.get("event")
        open_sessions = [
            lease for lease in self.machines.find(ident) if self.machines.session(lease) is not None
        ]
        if not open_sessions:
            return {"emitted": False}
        lease = open_sessions[0]
        if event == "progress":
            stage = args.get("stage")
            if stage not in STAGES:
                raise CallError("definite", "unknown stage %r" % (stage,))
            self.observe("progress", ident, stage=stage)
        elif event == "joined":
            self.machines.set_joined(lease, True)
            self.observe("joined", ident)
        elif event == "converged":
            self.observe("converged", ident)
        elif event == "closed":
            self.machines.close_session(lease)
            self.observe("closed", ident)
        elif event == "failed":
            failure = args.get("failure")
            if failure not in FAILURES:
                raise CallError("definite", "unknown failure %r" % (failure,))
            self.machines.close_session(lease)
            detail = args.get("detail")
            self.observe("failed", ident, failure=failure, detail=detail if isinstance(detail, str) else "")
        else:
            raise CallError("definite", "unknown event %r" % (event,))
        return {"emitted": True}

    def release(self, args):
        """Lets the oldest (or every) held request go on: each is performed
        and answered now, before this request's own reply."""
        which = args.get("which")
        if which not in ("oldest", "all"):
            raise CallError("definite", "which must be \"oldest\" or \"all\"")
        count = 1 if which == "oldest" else len(self.held)
        released, self.held = self.held[:count], self.held[count:]
        for request in released:
            self.releasing = True
            try:
                self.reply_to(request)
            finally:
                self.releasing = False
        return {"released": len(released)}

    def handshake(self, args):
        versions = args.get("versions")
        if args.get("protocol") != PROTOCOL or not isinstance(versions, list) or VERSION not in versions:
            raise CallError("definite", "this program speaks %s version %d only" % (PROTOCOL, VERSION))
        self.harness = args.get("harness") is True
        faults = [{"method": m, "fault": f} for m in METHODS for f in FAULTS]
        faults.append({"method": "lookup_endpoint", "fault": "not_ready"})
        return {
            "protocol": PROTOCOL,
            "version": VERSION,
            "program": self.program,
            "kind": KIND,
            "faults": faults,
            "lose_node": True,
            "hooks": list(HOOKS),
        }

    # The loop.

    def answer(self, request):
        method = request.get("method")
        args = request.get("args")
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise CallError("definite", "args must be an object")
        if method == "handshake":
            return self.handshake(args)
        if method == "inject_fault":
            return self.inject_fault(args)
        if method == "list_nodes":
            return self.list_nodes(None, args)
        if method == "live":
            return self.live(args)
        if method == "release":
            return self.release(args)
        if method in METHODS or method in ("lose_node", "emit"):
            return getattr(self, method)(parse_key(request.get("key")), args)
        raise CallError("definite", "unknown method %r" % (method,))

    def reply_to(self, request):
        """Answers one request, then sends what was to follow its reply."""
        try:
            reply = {"id": request["id"], "result": self.answer(request)}
        except CallError as error:
            reply = {
                "id": request["id"],
                "error": {"disposition": error.disposition, "message": error.message},
            }
        except OSError as error:
            # The disk failed under us, perhaps halfway: promise nothing.
            reply = {
                "id": request["id"],
                "error": {"disposition": "ambiguous", "message": "I/O error: %s" % error},
            }
        self.send(reply)
        after, self.after_reply = self.after_reply, []
        for kind, ident in after:
            self.observe(kind, ident)

    def serve(self, stream):
        while True:
            line = stream.readline(LINE_MAX + 2)
            if not line:
                return
            line = line.strip()
            if not line:
                continue
            try:
                request = json.loads(line)
            except ValueError:
                sys.stderr.write("%s: not JSON, ignored: %r\n" % (self.program, line[:80]))
                continue
            if not isinstance(request, dict) or not isinstance(request.get("id"), int):
                sys.stderr.write("%s: not a request, ignored: %r\n" % (self.program, line[:80]))
                continue
            method = request.get("method")
            if method in METHODS and self.takes_hang(method):
                # Hung: no reply until "release"; other lines are served
                # meanwhile.
                self.held.append(request)
                continue
            self.reply_to(request)


def parse_args(argv):
    """The root given with --root, or None; raises ValueError on bad usage."""
    rest = list(argv)
    root = None
    while rest:
        flag = rest.pop(0)
        if flag == "--root" and rest:
            root = rest.pop(0)
        else:
            raise ValueError("usage: %s [--root DIR]" % os.path.basename(sys.argv[0]))
    return root


def main(argv, provider_class=Provider):
    try:
        root = parse_args(argv)
    except ValueError as error:
        sys.stderr.write("%s\n" % error)
        return 2
    owned = None
    if root is None:
        owned = tempfile.mkdtemp(prefix="dirs-provider-")
        root = owned
    try:
        provider_class(Machines(root)).serve(sys.stdin)
    except KeyboardInterrupt:
        pass
    finally:
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
