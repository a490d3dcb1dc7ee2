"""asv benchmark suite of fp8-reload (run `asv run --python=same` from the repo root).

Which fp8_reload is under test:
* ``FP8_RELOAD_SRC`` set: that tree (`fp8-reload regress` runs one suite against
  two commits' worktrees this way);
* an environment asv built (``-E virtualenv``, `asv continuous`): the commit asv
  installed into it, untouched;
* otherwise (the default ``existing`` environment, or imported by the tests): the
  checkout this suite sits in. asv imports this package without putting the
  repository on ``sys.path`` and drops ``PYTHONPATH``, so it is added here.
"""

import os
import sys
from pathlib import Path

_SRC = os.environ.get("FP8_RELOAD_SRC")
if _SRC is None and os.environ.get("ASV_ENV_TYPE", "existing") == "existing":
    _SRC = str(Path(__file__).resolve().parents[1])
if _SRC is not None and _SRC not in sys.path:
    sys.path.insert(0, _SRC)
