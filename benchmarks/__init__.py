"""asv benchmark suite of fp8-reload (run `asv run --python=same` from the repo root).

asv imports this package without putting the repository on ``sys.path`` and
drops ``PYTHONPATH``, so the code under test is added here: the checkout this
suite sits in, or the tree named by ``FP8_RELOAD_SRC`` (`fp8-reload regress`
uses that to run one suite against two commits).
"""

import os
import sys
from pathlib import Path

_SRC = os.environ.get("FP8_RELOAD_SRC") or str(Path(__file__).resolve().parents[1])
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)
