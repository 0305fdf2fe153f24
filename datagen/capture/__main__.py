"""``python -m datagen.capture``: the command line is :mod:`datagen.capture.cli`."""

import sys

from datagen.capture.cli import main

sys.exit(main())
