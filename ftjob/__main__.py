"""``python -m ftjob [hydra overrides]``: see README.md."""

import sys

from ftjob.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
