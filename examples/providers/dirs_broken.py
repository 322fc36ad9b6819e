#!/usr/bin/env python3
"""dirs.py with one deliberate defect: create_node never adopts.

Asked again for an attempt whose machine already exists — the retry after
a lost reply, the everyday case — it makes a second machine instead of
answering the first. The driver would then leak a machine on every
ambiguous create. The seam contract suite must fail it, naming
create-twice-adopts (and the other contracts that retry a create), and the
battery must fail it too, naming G08 (no double-create):

    provision conformance --plugin "python3 examples/providers/dirs_broken.py"

Standard library only; takes the same arguments as dirs.py.
"""

import os
import sys

# Leave no __pycache__ next to the examples.
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dirs  # noqa: E402  (the path above makes the sibling importable)


class CreatesAnew(dirs.Provider):
    """The defect: create_node does not look before it creates."""

    program = "dirs-provider-creates-anew"

    def existing(self, ident):
        return []


if __name__ == "__main__":
    sys.exit(dirs.main(sys.argv[1:], CreatesAnew))
