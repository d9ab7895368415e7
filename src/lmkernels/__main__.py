import sys

from lmkernels.cli import main

sys.exit(main())
