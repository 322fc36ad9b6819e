#!/usr/bin/env python3
"""The EC2 testbed: moto's EC2 API server with what it lacks added in front.

moto (PyPI `moto[server]`) serves the real EC2 Query API wire protocol, but
it ignores `ClientToken`, shows instances `running` and `terminated` at once,
and injects no faults. This server runs moto in-process (ThreadedMotoServer on
a private port) and proxies every API call to it, adding:

- `ClientToken` idempotency: a repeated token returns the first reply; a
  repeated token with another image or instance type is refused with
  `IdempotentParameterMismatch`, as EC2 does;
- timed state transitions: an instance is `pending` for `--pending-ms`, and
  `shutting-down` for `--shutting-down-ms` after its termination;
- faults armed through the control endpoint (see `arm_fault`);
- spot interruptions and terminations "by someone else";
- booting: each instance that becomes `running` runs its user-data as a
  child process (its own session, on loopback) with `PROVISION_BOOT_DIR`
  set to a directory of its own, stopped when the instance is terminated.

`--plain` turns all of that off (except booting): plain moto, to prove the
provider does not double-create against a server that ignores tokens.

Control endpoint (JSON; `curl -s http://HOST:PORT/_testbed/instances`):
  GET  /_testbed/instances   every instance: id, state, tags, booted
  GET  /_testbed/calls       API calls received, by action
  POST /_testbed/fault       {"action": "RunInstances" | "*", "kind": KIND,
                              "count": 1, "delay_ms": 0}
       KIND: capacity (InsufficientInstanceCapacity), quota
       (VcpuLimitExceeded), instance-limit (InstanceLimitExceeded),
       throttle (RequestLimitExceeded, 503), server-error (500 before
       acting), unauthorized (UnauthorizedOperation, 403), delay (answer
       late), drop (act, then close the connection
       without a reply), server-error-after (act, then answer 500)
  POST /_testbed/clear       drops every armed fault
  POST /_testbed/interrupt   {"instance_id": "i-…"}: a spot interruption
  POST /_testbed/terminate   {"instance_id": "i-…"}: terminated outside
  POST /_testbed/config      {"pending_ms": N, "shutting_down_ms": N}

It prints `LISTENING http://HOST:PORT` once ready, and exits (stopping every
booted instance) on SIGTERM, SIGINT, or when its standard input closes (so it
dies with a test that started it, even one killed).
"""

import argparse
import logging
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moto.server import ThreadedMotoServer

NS = "http://ec2.amazonaws.com/doc/2016-11-15"
ET.register_namespace("", NS)
# moto's HTTP server logs every request; the testbed keeps quiet.
logging.getLogger("werkzeug").setLevel(logging.ERROR)
INSTANCE_ID = re.compile(r"<instanceId>(i-[0-9a-f]+)</instanceId>")
# The error codes and HTTP statuses of the injected faults.
FAULT_REPLIES = {
    "capacity": (400, "InsufficientInstanceCapacity", "We currently do not have sufficient capacity in the Availability Zone you requested."),
    "quota": (400, "VcpuLimitExceeded", "You have requested more vCPU capacity than your current vCPU limit allows."),
    "instance-limit": (400, "InstanceLimitExceeded", "You have requested more instances than your current instance limit allows."),
    "throttle": (503, "RequestLimitExceeded", "Request limit exceeded."),
    "server-error": (500, "InternalError", "An internal error has occurred."),
    "unauthorized": (403, "UnauthorizedOperation", "You are not authorized to perform this operation."),
}
# How long a stopped instance's processes get between SIGTERM and SIGKILL.
STOP_GRACE_S = 2.0


def error_body(code, message):
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors>"
        "<RequestID>testbed</RequestID></Response>"
    ).encode()


class Instance:
    def __init__(self, instance_id, user_data):
        self.id = instance_id
        self.user_data = user_data
        self.created = time.monotonic()
        self.terminated = None
        self.interrupted = False
        self.process = None


class Testbed:
    def __init__(self, args):
        self.plain = args.plain
        self.boot = not args.no_boot
        self.pending_s = args.pending_ms / 1000.0
        self.shutting_down_s = args.shutting_down_ms / 1000.0
        self.lock = threading.Lock()
        self.run_lock = threading.Lock()
        self.instances = {}
        self.tokens = {}
        self.faults = []
        self.calls = {}
        self.boot_dir = args.boot_dir or tempfile.mkdtemp(prefix="ec2-testbed-")
        self.own_boot_dir = args.boot_dir is None
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.moto_url = f"http://{host}:{port}/"
        self.stopping = threading.Event()

    # -- moto -------------------------------------------------------------

    def forward(self, body, headers):
        request = urllib.request.Request(self.moto_url, data=body, method="POST")
        for name in ("Authorization", "Content-Type", "X-Amz-Date", "X-Amz-Security-Token"):
            if headers.get(name):
                request.add_header(name, headers[name])
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def moto_call(self, params):
        body = urllib.parse.urlencode({"Version": "2016-11-15", **params}).encode()
        headers = {
            "Authorization": "AWS4-HMAC-SHA256 Credential=testbed/20250101/us-east-1/ec2/aws4_request, SignedHeaders=host, Signature=0",
            "Content-Type": "application/x-www-form-urlencoded",
        }
        return self.forward(body, headers)

    # -- state overlay ----------------------------------------------------

    def overlay(self, instance_id, moto_state):
        """The state the testbed shows for an instance moto calls `moto_state`."""
        if self.plain:
            return moto_state
        with self.lock:
            instance = self.instances.get(instance_id)
        if instance is None:
            return moto_state
        now = time.monotonic()
        if instance.terminated is not None:
            if now - instance.terminated < self.shutting_down_s:
                return "shutting-down"
            return "terminated"
        if moto_state == "running" and now - instance.created < self.pending_s:
            return "pending"
        return moto_state

    def rewrite_states(self, body):
        """Rewrites the instance states (and spot reasons) of a reply."""
        try:
            root = ET.fromstring(body)
        except ET.ParseError:
            return body
        codes = {"pending": "0", "running": "16", "shutting-down": "32", "terminated": "48"}
        for item in root.iter():
            if not item.tag.endswith("}item") and item.tag != "item":
                continue
            id_node = child(item, "instanceId")
            state_node = child(item, "instanceState")
            if state_node is None:
                state_node = child(item, "currentState")
            if id_node is None or state_node is None:
                continue
            name = child(state_node, "name")
            if name is None:
                continue
            shown = self.overlay(id_node.text, name.text)
            name.text = shown
            code = child(state_node, "code")
            if code is not None and shown in codes:
                code.text = codes[shown]
            with self.lock:
                instance = self.instances.get(id_node.text)
            if instance is not None and instance.interrupted:
                reason = child(item, "stateReason")
                if reason is None:
                    reason = ET.SubElement(item, f"{{{NS}}}stateReason")
                for part in list(reason):
                    reason.remove(part)
                ET.SubElement(reason, f"{{{NS}}}code").text = "Server.SpotInstanceTermination"
                ET.SubElement(reason, f"{{{NS}}}message").text = "Server.SpotInstanceTermination: Spot instance termination"
        return b'<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root)

    # -- faults -----------------------------------------------------------

    def take_fault(self, action):
        with self.lock:
            for fault in self.faults:
                if fault["action"] in (action, "*"):
                    fault["count"] -= 1
                    if fault["count"] <= 0:
                        self.faults.remove(fault)
                    return fault
        return None

    # -- the API ----------------------------------------------------------

    def handle_api(self, body, headers):
        """Returns (status, body) or None for a dropped reply."""
        params = dict(urllib.parse.parse_qsl(body.decode(), keep_blank_values=True))
        action = params.get("Action", "")
        with self.lock:
            self.calls[action] = self.calls.get(action, 0) + 1
        fault = None if self.plain else self.take_fault(action)
        if fault is not None:
            kind = fault["kind"]
            if kind in FAULT_REPLIES:
                status, code, message = FAULT_REPLIES[kind]
                return status, error_body(code, message)
            if kind == "delay":
                time.sleep(fault.get("delay_ms", 0) / 1000.0)
        if action == "RunInstances":
            status, reply = self.run_instances(params, body, headers)
        else:
            status, reply = self.forward(body, headers)
            if action == "TerminateInstances" and status == 200:
                for instance_id in INSTANCE_ID.findall(reply.decode()):
                    self.mark_terminated(instance_id, interrupted=False)
        if status == 200 and not self.plain and action in ("DescribeInstances", "RunInstances", "TerminateInstances"):
            reply = self.rewrite_states(reply)
        if fault is not None and fault["kind"] == "drop":
            return None
        if fault is not None and fault["kind"] == "server-error-after":
            status, code, message = FAULT_REPLIES["server-error"]
            return status, error_body(code, message)
        return status, reply

    def run_instances(self, params, body, headers):
        token = params.get("ClientToken")
        fingerprint = (params.get("ImageId"), params.get("InstanceType"))
        # One RunInstances at a time: a token's first call finishes before
        # its second is looked at.
        with self.run_lock:
            if token and not self.plain:
                seen = self.tokens.get(token)
                if seen is not None:
                    if seen[0] != fingerprint:
                        return 400, error_body(
                            "IdempotentParameterMismatch",
                            "The client token you have provided is associated with a resource that is already deleted or has different parameters.",
                        )
                    return 200, seen[1]
            status, reply = self.forward(body, headers)
            if status != 200:
                return status, reply
            user_data = params.get("UserData", "")
            try:
                user_data = base64.b64decode(user_data).decode() if user_data else ""
            except ValueError:
                user_data = ""
            with self.lock:
                for instance_id in INSTANCE_ID.findall(reply.decode()):
                    self.instances[instance_id] = Instance(instance_id, user_data)
            if token and not self.plain:
                self.tokens[token] = (fingerprint, reply)
            return status, reply

    def mark_terminated(self, instance_id, interrupted):
        with self.lock:
            instance = self.instances.get(instance_id)
            if instance is None:
                instance = self.instances[instance_id] = Instance(instance_id, "")
            if instance.terminated is None:
                instance.terminated = time.monotonic()
            instance.interrupted = instance.interrupted or interrupted
            process = instance.process
        stop_process(process)

    def end_outside(self, instance_id, interrupted):
        status, reply = self.moto_call({"Action": "TerminateInstances", "InstanceId.1": instance_id})
        if status != 200:
            return status, {"error": reply.decode()}
        self.mark_terminated(instance_id, interrupted)
        return 200, {"instance_id": instance_id, "interrupted": interrupted}

    def list_instances(self):
        status, reply = self.moto_call({"Action": "DescribeInstances"})
        if status != 200:
            return []
        root = ET.fromstring(reply)
        listed = []
        for item in root.iter():
            id_node = child(item, "instanceId")
            state_node = child(item, "instanceState")
            if id_node is None or state_node is None:
                continue
            tags = {}
            tag_set = child(item, "tagSet")
            for tag in list(tag_set) if tag_set is not None else []:
                key, value = child(tag, "key"), child(tag, "value")
                if key is not None:
                    tags[key.text] = value.text if value is not None and value.text else ""
            with self.lock:
                instance = self.instances.get(id_node.text)
                booted = instance is not None and instance.process is not None
            listed.append({
                "id": id_node.text,
                "state": self.overlay(id_node.text, child(state_node, "name").text),
                "tags": tags,
                "booted": booted,
            })
        return listed

    # -- booting ----------------------------------------------------------

    def boot_loop(self):
        while not self.stopping.wait(0.05):
            now = time.monotonic()
            with self.lock:
                due = [
                    i for i in self.instances.values()
                    if i.process is None and i.terminated is None and i.user_data
                    and (self.plain or now - i.created >= self.pending_s)
                ]
            for instance in due:
                self.boot_instance(instance)

    def boot_instance(self, instance):
        directory = os.path.join(self.boot_dir, instance.id)
        os.makedirs(directory, exist_ok=True)
        script = os.path.join(directory, "user-data")
        with open(script, "w") as file:
            file.write(instance.user_data)
        env = dict(os.environ, PROVISION_BOOT_DIR=directory)
        log = open(os.path.join(directory, "user-data.log"), "ab")
        process = subprocess.Popen(
            ["/bin/sh", script], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,
        )
        log.close()
        with self.lock:
            instance.process = process
            ended = instance.terminated is not None
        if ended:
            stop_process(process)

    def shutdown(self):
        self.stopping.set()
        with self.lock:
            processes = [i.process for i in self.instances.values() if i.process is not None]
        for process in processes:
            stop_process(process, wait=False)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_group(process, signal.SIGKILL)
        self.moto.stop()
        if self.own_boot_dir:
            shutil.rmtree(self.boot_dir, ignore_errors=True)


def child(node, name):
    for part in list(node):
        if part.tag == name or part.tag.endswith("}" + name):
            return part
    return None


def kill_group(process, signum):
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def stop_process(process, wait=True):
    """SIGTERM to the instance's process group, SIGKILL after a grace."""
    if process is None or process.poll() is not None:
        return
    kill_group(process, signal.SIGTERM)

    def reap():
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            kill_group(process, signal.SIGKILL)
            process.wait()

    if wait:
        threading.Thread(target=reap, daemon=True).start()


def make_handler(testbed):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def reply(self, status, body, content_type="text/xml"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def reply_json(self, status, value):
            self.reply(status, json.dumps(value).encode(), "application/json")

        def read_body(self):
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def do_GET(self):
            if self.path == "/_testbed/instances":
                return self.reply_json(200, testbed.list_instances())
            if self.path == "/_testbed/calls":
                with testbed.lock:
                    return self.reply_json(200, dict(testbed.calls))
            self.reply_json(404, {"error": "unknown path"})

        def do_POST(self):
            body = self.read_body()
            if self.path.startswith("/_testbed/"):
                return self.control(self.path[len("/_testbed/"):], body)
            outcome = testbed.handle_api(body, self.headers)
            if outcome is None:
                # The action took effect; its reply is lost.
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.reply(*outcome)

        def control(self, name, body):
            try:
                request = json.loads(body or b"{}")
            except ValueError:
                return self.reply_json(400, {"error": "not JSON"})
            if name == "fault":
                kind = request.get("kind")
                if kind not in FAULT_REPLIES and kind not in ("delay", "drop", "server-error-after"):
                    return self.reply_json(400, {"error": f"unknown fault kind {kind!r}"})
                fault = {
                    "action": request.get("action", "*"),
                    "kind": kind,
                    "count": int(request.get("count", 1)),
                    "delay_ms": int(request.get("delay_ms", 0)),
                }
                with testbed.lock:
                    testbed.faults.append(fault)
                return self.reply_json(200, fault)
            if name == "clear":
                with testbed.lock:
                    testbed.faults.clear()
                return self.reply_json(200, {})
            if name in ("interrupt", "terminate"):
                status, value = testbed.end_outside(request["instance_id"], name == "interrupt")
                return self.reply_json(status, value)
            if name == "config":
                if "pending_ms" in request:
                    testbed.pending_s = request["pending_ms"] / 1000.0
                if "shutting_down_ms" in request:
                    testbed.shutting_down_s = request["shutting_down_ms"] / 1000.0
                return self.reply_json(200, {})
            self.reply_json(404, {"error": f"unknown control {name!r}"})

    return Handler


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="plain moto: no tokens, transitions or faults")
    parser.add_argument("--no-boot", action="store_true", help="do not run user-data")
    parser.add_argument("--boot-dir", help="where booted instances keep their files")
    parser.add_argument("--pending-ms", type=int, default=300)
    parser.add_argument("--shutting-down-ms", type=int, default=300)
    parser.add_argument("--exit-on-stdin-eof", action="store_true")
    args = parser.parse_args()

    testbed = Testbed(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(testbed))
    server.daemon_threads = True
    host, port = server.server_address[:2]
    threading.Thread(target=testbed.boot_loop, daemon=True).start()
    threading.Thread(target=server.serve_forever, daemon=True).start()

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    if args.exit_on_stdin_eof:
        def watch_stdin():
            while sys.stdin.buffer.read(4096):
                pass
            done.set()
        threading.Thread(target=watch_stdin, daemon=True).start()
    print(f"LISTENING http://{host}:{port}", flush=True)
    done.wait()
    server.shutdown()
    testbed.shutdown()


if __name__ == "__main__":
    main()
