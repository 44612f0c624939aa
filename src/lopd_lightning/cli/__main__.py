"""``python -m lopd_lightning.cli ...``: the ``lopd`` command (e.g. under ``torchrun``)."""

import sys

from lopd_lightning.cli import main

sys.exit(main())
