"""What the S3 tests import from here; it lives in tests.support."""

from tests.support.fault_proxy import FaultProxy  # noqa: F401
