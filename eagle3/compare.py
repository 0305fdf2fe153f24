"""`python -m eagle3.compare`: the command users type; the application is eagle3.evaluation
(side_by_side: this command)."""

import sys

from eagle3.evaluation.side_by_side import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
