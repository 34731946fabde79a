"""`python -m pc_rag.demo`: the demo, as `pc-rag demo` runs it."""

import sys

from ..cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
