import sys

from lmkernels_bench.cli import main

sys.exit(main())
