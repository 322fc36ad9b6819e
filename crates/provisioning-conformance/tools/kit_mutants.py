#!/usr/bin/env python3
"""Hand-made behavioural mutants of the core, judged by the kit's batteries alone.

Usage: kit_mutants.py TREE [NAME...]

TREE is a scratch copy of the repository (for example `git archive HEAD | tar -x -C TREE`);
never the working tree others edit. Each mutant replaces one exact snippet (which must occur
once) in a core source file, runs `cargo test -p provisioning-conformance --test level1
--test level2` (the Level 1 and Level 2 batteries, nothing else), records caught (the tests
failed), missed (they passed) or unviable (it did not build), and restores the file. Set
CARGO_TARGET_DIR to reuse a target directory. docs/testing.md lists the results.
"""

import pathlib
import subprocess
import sys

# name, file, original snippet, mutated snippet, what it models
MUTANTS = [
    ("reached-strict", "crates/provisioning/src/time.rs",
     "self >= deadline", "self > deadline",
     "every deadline compared with > instead of >= (due a tick late)"),
    ("reached-inverted", "crates/provisioning/src/time.rs",
     "self >= deadline", "self < deadline",
     "deadlines inverted"),
    ("delay-rounds-down", "crates/provisioning/src/time.rs",
     "delay.subsec_nanos() % 1_000_000 != 0", "delay.subsec_nanos() % 1_000_000 == 0",
     "sub-millisecond delays rounded the wrong way"),
    ("contains-off-by-one", "crates/provisioning/src/shape.rs",
     ".is_some_and(|g| node.index() < g.count)", ".is_some_and(|g| node.index() <= g.count)",
     "one slot too many is desired (a shrinking group keeps its highest index)"),
    ("contains-from-the-bottom", "crates/provisioning/src/shape.rs",
     ".is_some_and(|g| node.index() < g.count)", ".is_some_and(|g| node.index() >= g.count.saturating_sub(g.count))",
     "every index of a wanted group stays desired: scale-down never sheds a slot"),
    ("spec-off-by-one", "crates/provisioning/src/shape.rs",
     "(node.index() < group.count).then(", "(node.index() <= group.count).then(",
     "a spec is built for one slot past the group"),
    ("ready-keeps-count", "crates/provisioning/src/observe.rs",
     "node.retry.consecutive_failures = 0;", "node.retry.consecutive_failures += 0;",
     "the failure count is not reset when the node becomes ready"),
    ("restart-resets-count", "crates/provisioning/src/driver/step.rs",
     ".map_or(0, |n| n.retry.consecutive_failures),", ".map_or(0, |_| 0),",
     "a replacement starts counting failures from zero"),
    ("delete-keeps-backoff", "crates/provisioning/src/driver/step.rs",
     "if node.retry.ambiguous.is_none() {\n                        node.retry.next_effect_at = None;",
     "if node.retry.ambiguous.is_none() && false {\n                        node.retry.next_effect_at = None;",
     "a node that begins deletion keeps its old backoff"),
    ("wrong-kind-is-definite", "crates/provisioning/src/observe.rs",
     "let error = EffectError::ambiguous(format!(", "let error = EffectError::definite(format!(",
     "an answer of another method's output is taken as a definite failure"),
    ("readiness-from-the-journal", "crates/provisioning/src/driver/recover.rs",
     "                await_rejoin(node, rejoin_by);\n", "",
     "a node the journal held as ready is ready again at recovery, before its agent re-joined (G37)"),
]

COMMAND = ["cargo", "test", "-p", "provisioning-conformance", "--test", "level1", "--test", "level2"]


def run(tree: pathlib.Path, mutant) -> str:
    name, file, original, mutated, _ = mutant
    path = tree / file
    text = path.read_text()
    if text.count(original) != 1:
        return "stale (the snippet is not in the file exactly once)"
    path.write_text(text.replace(original, mutated))
    try:
        build = subprocess.run(COMMAND + ["--no-run"], cwd=tree, capture_output=True, text=True)
        if build.returncode != 0:
            return "unviable"
        tests = subprocess.run(COMMAND, cwd=tree, capture_output=True, text=True)
        if tests.returncode == 0:
            return "missed"
        caught = [line for line in tests.stdout.splitlines() if " violated (" in line]
        return "caught" + (f": {caught[0][:160]}" if caught else "")
    finally:
        path.write_text(text)


def main() -> int:
    tree = pathlib.Path(sys.argv[1])
    wanted = set(sys.argv[2:])
    baseline = subprocess.run(COMMAND, cwd=tree, capture_output=True, text=True)
    if baseline.returncode != 0:
        print("the unmutated tree fails the batteries; nothing to judge")
        return 1
    for mutant in MUTANTS:
        if wanted and mutant[0] not in wanted:
            continue
        print(f"{mutant[0]}: {run(tree, mutant)}  [{mutant[4]}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
