import sys

from rlhf_core.cli import main

sys.exit(main())
