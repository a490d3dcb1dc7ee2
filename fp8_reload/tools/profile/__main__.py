"""``python -m fp8_reload.tools.profile --worker ...``: the child process nsys / ncu profile."""

import sys

from .command import worker_main

sys.exit(worker_main())
