"""ftjob's Hydra launcher (``hydra/launcher=ftjob``): see :mod:`ftjob.cli.launcher`."""
