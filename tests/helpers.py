"""What the Ray end-to-end tests import from here; it lives in tests.support."""

from tests.support.checkpoints import manifest_in, zombie_commit  # noqa: F401
from tests.support.images import make_image_tree  # noqa: F401
from tests.support.loggers import check_loggers  # noqa: F401
from tests.support.processes import ctrl_c_reaches_it, read_until, run_ftjob, start_ftjob  # noqa: F401
