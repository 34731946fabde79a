"""`python -m pc_rag`: the `pc-rag` command (with no arguments, the demo)."""

import sys

from .cli import main

sys.exit(main())
