"""`python -m eagle3.evaluate`: the command users type; the application is eagle3.evaluation
(run: this command's parser and run)."""

import sys

from eagle3.evaluation.run import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
