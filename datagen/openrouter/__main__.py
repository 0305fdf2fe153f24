"""``python -m datagen.openrouter``: the command line is :mod:`datagen.openrouter.cli`."""

import sys

from datagen.openrouter.cli import main

sys.exit(main())
