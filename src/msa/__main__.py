"""`python -m msa` runs the `msa` command."""

import sys

from msa.cli import main

sys.exit(main())
