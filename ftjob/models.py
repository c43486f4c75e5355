"""The public name of ftjob's models (``model._target_: ftjob.models.SmallCNN``; any callable
taking ``num_classes`` works). They live in :mod:`ftjob.worker.models`."""

from ftjob.worker.models import SmallCNN

__all__ = ["SmallCNN"]
