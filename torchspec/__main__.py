"""`python -m torchspec`: the command line."""

import sys

from torchspec.cli import main

sys.exit(main())
