import sys

from lmkernels.harness.bench.cli import main

sys.exit(main())
