"""Where tritonserver is installed, and the backends directory it is started with.

The nvidia-pytriton wheel carries `tritonserver` 2.51, the Python backend and one backend stub per
Python version. Triton expects the stub inside the backend directory, so a backends directory is
assembled once per Python version (python backend + the stub matching this interpreter). A system
install (NVIDIA's containers: /opt/tritonserver, or $TRITONSERVER_ROOT) brings its own backends
directory, its stub built for the Python beside it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from backend.loading.disk_cache import cache_root

SYSTEM_TRITON_ROOT = Path("/opt/tritonserver")  # NVIDIA's Triton containers install it here


@dataclass
class TritonInstall:
    root: Path  # .../site-packages/pytriton/tritonserver, or a system install's (/opt/tritonserver)
    libs: Path  # .../site-packages/nvidia_pytriton.libs, or the system install's lib/
    system: bool = False  # a system install: its backends directory, stub built for its Python

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def stub(self) -> Path:
        if self.system:
            return self.root / "backends" / "python" / "triton_python_backend_stub"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return self.root / "python_backend_stubs" / version / "triton_python_backend_stub"


def locate_tritonserver() -> TritonInstall:
    """Find tritonserver: at $TRITONSERVER_ROOT when set (a system install), else inside the
    installed nvidia-pytriton wheel (without importing it), else at /opt/tritonserver (NVIDIA's
    containers)."""
    if os.environ.get("TRITONSERVER_ROOT"):
        return _system_install(Path(os.environ["TRITONSERVER_ROOT"]))
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        if (SYSTEM_TRITON_ROOT / "bin" / "tritonserver").exists():
            return _system_install(SYSTEM_TRITON_ROOT)
        raise RuntimeError("nvidia-pytriton is not installed; pip install 'nvidia-pytriton==0.7.0'")
    root = Path(spec.submodule_search_locations[0]).resolve() / "tritonserver"
    install = TritonInstall(root=root, libs=root.parent.parent / "nvidia_pytriton.libs")
    for path in (install.binary, install.stub, install.libs):
        if not path.exists():
            raise RuntimeError(f"incomplete nvidia-pytriton install: {path} is missing")
    return install


def _system_install(root: Path) -> TritonInstall:
    install = TritonInstall(root=root, libs=root / "lib", system=True)
    for path in (install.binary, install.stub):
        if not path.exists():
            raise RuntimeError(f"no tritonserver install at {root}: {path} is missing")
    return install


def default_backends_dir() -> Path:
    return Path(cache_root()) / f"backends-py{sys.version_info.major}.{sys.version_info.minor}"


def prepare_backends(install: TritonInstall, dest: Path | None = None) -> Path:
    """A backends directory holding the python backend and the stub for this interpreter (a
    system install's own: its stub was built for the Python beside it)."""
    if install.system:
        return install.root / "backends"
    dest = dest or default_backends_dir()
    python_dir = dest / "python"
    stub = python_dir / "triton_python_backend_stub"
    if not stub.exists() or stub.stat().st_size != install.stub.stat().st_size:
        python_dir.mkdir(parents=True, exist_ok=True)
        for item in (install.root / "backends" / "python").iterdir():
            if item.is_file():
                shutil.copy2(item, python_dir / item.name)
        shutil.copy2(install.stub, stub)
    return dest
