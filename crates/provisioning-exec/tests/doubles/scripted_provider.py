#!/usr/bin/env python3
"""A test double that writes whatever bytes a test prescribed.

    python3 scripted_provider.py SCRIPT.json

SCRIPT.json is a list with one entry per request after the handshake, in
order: {"junk": [HEX, ...], "reply": HEX or null}. For the n-th
request the program writes each junk line, then the reply line with every
"@ID@" replaced by the request's id (nothing when "reply" is null). Every
line is written as given followed by a newline: the bytes may be anything.
Requests beyond the script are not answered. The handshake is answered
properly. Standard library only.
"""

import json
import sys


def main(argv):
    with open(argv[1], encoding="utf-8") as f:
        script = json.load(f)
    out = sys.stdout.buffer
    served = 0
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("method") == "handshake":
            hello = {
                "protocol": "provisioning-plugin",
                "version": 1,
                "program": "scripted-provider",
                "kind": "scripted",
            }
            out.write(json.dumps({"id": request["id"], "result": hello}).encode() + b"\n")
            out.flush()
            continue
        if served >= len(script):
            continue
        entry = script[served]
        served += 1
        for junk in entry["junk"]:
            out.write(bytes.fromhex(junk) + b"\n")
        if entry["reply"] is not None:
            reply = bytes.fromhex(entry["reply"])
            out.write(reply.replace(b"@ID@", str(request["id"]).encode()) + b"\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
