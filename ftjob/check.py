"""``python -m ftjob.check [--config-dir DIR]``: every config composed and validated (see
:mod:`ftjob.cli.check`)."""

import sys

from ftjob.cli.check import main

if __name__ == "__main__":
    sys.exit(main())
