"""``python -m fp8_reload ...`` (torchrun -m fp8_reload ...): the `fp8-reload` command."""

import sys

from .tools.cli import main

sys.exit(main())
