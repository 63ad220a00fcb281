"""``python -m loong_compile.cli``: the ``loong`` command."""

import sys

from loong_compile.cli.commands import main

sys.exit(main())
