"""``python -m loong_compile.gpu_check``: runs ``gpu_check.main`` (its options are there)."""

import sys

from loong_compile.gpu_check import main

sys.exit(main())
