"""Install and run perf_analyzer against our tritonserver.

perf_analyzer ships only inside the manylinux1 `tritonclient` wheels. The one of tritonclient
2.51.0 (same release as the server in nvidia-pytriton 0.7.0) runs on glibc >= 2.34; the 2.55.0
binary needs glibc 2.38. It links libb64 (Debian `libb64-0d`, installed by the Makefile) and
libcudart.so.12 (PyPI `nvidia-cuda-runtime-cu12`, even with no GPU).

  python -m ensemble.perf_analyzer setup          # extract the binary, install libcudart
  python -m ensemble.perf_analyzer run -- -m ensemble -i grpc --streaming ...
  eval "$(python -m ensemble.perf_analyzer env)"  # perf_analyzer on PATH, e.g. for genai-perf
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

TRITONCLIENT_VERSION = "2.51.0"
CUDA_RUNTIME = "nvidia-cuda-runtime-cu12==12.6.77"
INSTALL_DIR = Path(sys.prefix) / "opt" / f"perf_analyzer-{TRITONCLIENT_VERSION}"
BINARY = INSTALL_DIR / "perf_analyzer"


def cudart_dir() -> Path | None:
    for entry in sys.path:
        candidate = Path(entry) / "nvidia" / "cuda_runtime" / "lib"
        if (candidate / "libcudart.so.12").exists():
            return candidate
    return None


def environment() -> dict[str, str]:
    env = dict(os.environ)
    lib = cudart_dir()
    if lib is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(lib), env.get("LD_LIBRARY_PATH")) if p
        )
    return env


def missing() -> str | None:
    """Why perf_analyzer cannot run here, or None when it can."""
    if not BINARY.exists():
        return f"{BINARY} is missing (run: python -m ensemble.perf_analyzer setup)"
    if cudart_dir() is None:
        return f"libcudart.so.12 is missing (pip install {CUDA_RUNTIME})"
    try:
        result = subprocess.run(
            [str(BINARY), "--version"],
            env=environment(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError as exc:
        return f"{BINARY} does not start: {exc}"
    if result.returncode != 0:
        return f"{BINARY} does not start: {(result.stderr or result.stdout).strip()[:300]}"
    return None


def setup() -> Path:
    pip = [sys.executable, "-m", "pip"]
    if cudart_dir() is None:
        subprocess.run(pip + ["install", "--quiet", CUDA_RUNTIME], check=True)
    if not BINARY.exists():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                pip
                + [
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--platform",
                    "manylinux1_x86_64",
                    "--dest",
                    tmp,
                    f"tritonclient=={TRITONCLIENT_VERSION}",
                ],
                check=True,
            )
            wheel = next(Path(tmp).glob("tritonclient-*.whl"))
            member = f"tritonclient-{TRITONCLIENT_VERSION}.data/data/bin/perf_analyzer"
            INSTALL_DIR.mkdir(parents=True, exist_ok=True)
            with (
                zipfile.ZipFile(wheel) as archive,
                archive.open(member) as src,
                open(BINARY, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst)
            BINARY.chmod(0o755)
    problem = missing()
    if problem:
        raise RuntimeError(problem + " (libb64: apt-get install -y libb64-0d)")
    return BINARY


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(BINARY), *args], env=environment(), **kwargs)


def main(argv: list[str]) -> int:
    if argv[:1] == ["setup"]:
        print(f"perf_analyzer ready: {setup()}")
        print(f"export LD_LIBRARY_PATH={cudart_dir()}:$LD_LIBRARY_PATH")
        return 0
    if argv[:1] == ["env"]:  # for tools that call perf_analyzer themselves (genai-perf)
        print(f"export PATH={BINARY.parent}:$PATH")
        print(f"export LD_LIBRARY_PATH={cudart_dir()}:$LD_LIBRARY_PATH")
        return 0
    if argv[:1] == ["run"]:
        rest = argv[1:]
        return run(rest[1:] if rest[:1] == ["--"] else rest).returncode
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(__doc__)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
