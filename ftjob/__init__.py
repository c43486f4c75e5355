"""ftjob: declarative, fault-tolerant training jobs on Ray Train."""

__version__ = "0.1.0"
