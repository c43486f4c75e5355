"""Checkpoint scratch on each node: where rank 0 writes a checkpoint before it uploads it.

Private to one driver's run (an unpredictable name, mode 0700, refused if it exists as anything
else), so neither a second run of the same name nor another user shares or plants files in it.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
import tempfile


def scratch_name(run_name: str) -> str:
    """The name of one driver's run scratch: unpredictable, so no other run of the same name
    (two sweep jobs with one ``name``), and no other user, shares or pre-creates it."""
    return f"ftjob-scratch-{run_name}-{secrets.token_hex(8)}"


def run_scratch_dir(name: str) -> str:
    """This node's scratch for one driver's run (``name`` from :func:`scratch_name`):
    checkpoints are written there, then uploaded. The driver removes it when the run ends;
    leftovers of killed attempts are removed by the next attempt on the node."""
    return os.path.join(tempfile.gettempdir(), name)


def _private_dir(path: str) -> str:
    """``path`` as a directory only this user can enter (0700): created so, or, when another
    process of the run created it first, checked to be ours and not a link to elsewhere."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(
                errno.EPERM,
                f"checkpoint scratch {path} exists but is not a private directory of this "
                "user: refusing to write checkpoints there",
            ) from None
    return path


def attempt_scratch_dir(name: str, attempt: int, rank: int) -> str:
    """Scratch of one worker of one attempt; leftovers of earlier attempts of this run on
    this node (a SIGKILLed worker cleans nothing) are removed first."""
    root = _private_dir(run_scratch_dir(name))
    for entry in os.listdir(root):
        number = entry[len("attempt") :].split("-", 1)[0] if entry.startswith("attempt") else ""
        if number.isdigit() and int(number) < attempt:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    path = os.path.join(root, f"attempt{attempt:04d}-rank{rank}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path
