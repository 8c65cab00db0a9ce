"""``python -m ddplab``: see ddplab/cli.py."""

import sys

from .cli import main

sys.exit(main())
