import sys

from loong_compile.gpu_check import main

sys.exit(main())
