"""``python -m pretrain <command>``: the same as the ``pretrain`` script."""

import sys

from pretrain.cli import main

sys.exit(main())
