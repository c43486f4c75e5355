"""``python -m ftjob.report DIR``: a sweep's tables and plots rebuilt, or a run's summary
printed (see :mod:`ftjob.cli.report`)."""

import sys

from ftjob.cli.report import main

if __name__ == "__main__":
    sys.exit(main())
