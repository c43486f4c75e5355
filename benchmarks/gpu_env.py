"""What the GPU check runs on, and whether everything it needs imports there: the device, the
Python, torch, torchvision and the packages gpu_site.sh carried (Ray, Hydra, pyarrow...),
every ftjob module, and the optional decoders (TorchCodec, DALI). Printed in one go, first, so
that a site that lacks a package costs seconds of a lease, not a part.

``--install``: first makes ftjob's conf/ importable as the package ``ftjob.conf`` (what ``python
-m ftjob`` composes from) where it is not: an editable install of the checkout, without network
or dependencies (``pip install --no-deps --no-build-isolation --no-index -e .``, with the
machine's own setuptools), as a developer's ``pip install -e .`` maps it here.

    python benchmarks/gpu_env.py [--install]
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

NEEDED = (
    "ray",
    "ray.train",
    "ray.train.torch",
    "ray.data",
    "hydra",
    "omegaconf",
    "pyarrow",
    "pyarrow.parquet",
    "fsspec",
    "tenacity",
    "xxhash",
    "yaml",
    "pandas",  # Ray Data's: the machine's own unless gpu_site.sh was asked for it
)
DISTRIBUTIONS = {"yaml": "PyYAML"}  # where a module's distribution has another name
OPTIONAL = ("torchcodec.decoders", "nvidia.dali", "matplotlib")


def version(name: str) -> str:
    """The version of an imported package, and where it was found (the site carried, or the
    machine's own)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    module = importlib.import_module(name)
    where = os.path.dirname(getattr(module, "__file__", "") or "")
    try:
        said = installed(DISTRIBUTIONS.get(name, name))
    except PackageNotFoundError:
        said = getattr(module, "__version__", "?")
    return f"{said} ({where})"


def conf_importable() -> bool:
    """Whether a fresh interpreter finds ftjob.conf (an install's finder is read at start)."""
    probe = [sys.executable, "-c", "import ftjob.conf"]
    return subprocess.run(probe, cwd=ROOT, capture_output=True, check=False).returncode == 0


def install() -> str | None:
    """ftjob.conf made importable where it is not; what went wrong, or None."""
    if conf_importable():
        return None
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
    command += ["--no-build-isolation", "--no-index", "-e", ROOT]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    print(f"ftjob installed from {ROOT} (editable): exit {done.returncode}", flush=True)
    if done.returncode != 0 or not conf_importable():
        return f"ftjob.conf (the editable install failed: {done.stderr.strip()[-300:]})"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--install", action="store_true", help="make ftjob.conf importable")
    args = parser.parse_args()
    start = time.perf_counter()
    failed = install() if args.install else None
    import torch

    print(f"Python {platform.python_version()} at {sys.executable}; {os.cpu_count()} cores")
    print(f"torch {version('torch')}, torchvision {version('torchvision')}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(
            f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA "
            f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
        )
    else:
        print("device: no CUDA device (the parts run on the CPU only with GPU_CHECK_DRY=1)")
    missing = [failed] if failed else []
    for name in NEEDED:
        try:
            said = version(name)
        except Exception as exc:  # noqa: BLE001 -- every failure to import is reported
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        if "." not in name:
            print(f"{name} {said}")
    import ftjob

    modules = [m.name for m in pkgutil.walk_packages(ftjob.__path__, "ftjob.")]
    if not conf_importable():  # conf/ is ftjob.conf only once ftjob is installed
        missing.append("ftjob.conf (python -m ftjob finds no config: run with --install)")
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    for name in OPTIONAL:
        try:
            importlib.import_module(name)
            print(f"optional {name}: importable")
        except Exception as exc:  # noqa: BLE001 -- the parts that use them skip them
            print(f"optional {name}: not importable ({type(exc).__name__}: {str(exc)[:150]})")
    print(
        f"imports: {len(NEEDED)} packages and {len(modules)} ftjob modules in "
        f"{time.perf_counter() - start:.1f} s; missing: {missing or 'none'}"
    )
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
