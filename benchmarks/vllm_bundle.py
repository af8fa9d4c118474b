"""An offline bundle of vLLM for a GPU host without network (for benchmarks/peer_vllm.py).

Resolves vLLM's requirements for the target Python/platform, leaves out what the target already
has (`--have`: package names, one per line or space-separated, e.g. from `pip list` there) and
what a Hopper GPU running a dense model never loads, strips debug symbols, and writes one
site-packages tree as an xz archive, split into parts of `--part-mb` when asked (for hosts that
take files in pieces). On the target: concatenate the parts, unpack, put the folder on
PYTHONPATH, and set VLLM_USE_FLASHINFER_SAMPLER=0 (flashinfer is left out).

    python -m benchmarks.vllm_bundle --have image_packages.txt --out /tmp/vllm-bundle --part-mb 48
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
    "any",
]
# Requirements a dense model on Hopper never imports (MoE/Blackwell/JIT kernel stacks and the
# CUDA 12 libraries one of them pulls in); the torch family comes from the target.
SKIP_PACKAGES = re.compile(
    r"^(torch|torchaudio|torchvision|flashinfer-.*|tilelang|tokenspeed-.*|nvidia-cutlass-dsl.*"
    r"|quack-kernels|humming-kernels|z3-solver|cuda-tile|nvidia-.*-cu12|nvidia-nvvm"
    r"|nvidia-cuda-(nvcc|tileiras|crt|cccl)"
    r"|pycountry|mistral-common|anthropic|cryptography|mcp|mcp-types|sentry-sdk"
    r"|fastapi-cloud-cli|opentelemetry-.*|nvidia-cudnn-frontend|fastsafetensors"
    r"|torch-c-dlpack-ext)$"
)
# Files inside the vllm package that Hopper does not load: FlashAttention 2 (pre-Hopper), the
# MoE ops, Blackwell attention, DeepGEMM's JIT headers, the Rust front end.
SKIP_FILES = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/third_party/fmha_sm100",
    "vllm/third_party/deep_gemm",
    "vllm/vllm-rs",
    "xgrammar/lib/libxgrammar.a",
)


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def platform_args(python: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def requirements(vllm_wheel: Path) -> list[str]:
    with zipfile.ZipFile(vllm_wheel) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        lines = whl.read(meta).decode().splitlines()
    reqs = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in reqs if "extra ==" not in r]


def resolve(reqs: list[str], python: str, work: Path) -> list[tuple[str, str]]:
    """(name, version) of everything the requirements pull in, the torch family left out."""
    kept = [r for r in reqs if not SKIP_PACKAGES.match(normal(re.split(r"[ <>=!~;\[]", r)[0]))]
    (work / "req.txt").write_text("\n".join(kept) + "\n")
    report = work / "report.json"
    pip(
        "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
        "--target", str(work / "unused"), *platform_args(python), "-r", str(work / "req.txt"),
    )  # fmt: skip
    found = json.loads(report.read_text())["install"]
    return [(normal(i["metadata"]["name"]), i["metadata"]["version"]) for i in found]


def build(args) -> Path:
    out, work = Path(args.out), Path(args.out) / "work"
    wheels, site = work / "wheels", out / "site"
    for path in (wheels, site):
        path.mkdir(parents=True, exist_ok=True)
    have = {normal(n) for n in Path(args.have).read_text().split()} if args.have else set()
    pip("download", "-q", "--no-deps", *platform_args(args.python), "-d", str(wheels),
        f"vllm=={args.version}")  # fmt: skip
    vllm_wheel = next(wheels.glob(f"vllm-{args.version}-*.whl"))
    needed = [
        f"{n}=={v}"
        for n, v in resolve(requirements(vllm_wheel), args.python, work)
        if n not in have and not SKIP_PACKAGES.match(n)
    ]
    print(f"{len(needed)} packages the target lacks", flush=True)
    (work / "needed.txt").write_text("\n".join(needed) + "\n")
    pip("download", "-q", "--no-deps", *platform_args(args.python), "-d", str(wheels),
        "-r", str(work / "needed.txt"))  # fmt: skip
    for whl in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
    for rel in SKIP_FILES:
        target = site / rel
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    libraries = [str(p) for p in site.rglob("*.so*") if p.is_file()]
    if libraries and shutil.which("strip"):
        subprocess.run(["strip", "--strip-debug", *libraries], check=False)
    archive = out / "vllm-site.tar.xz"
    with lzma.open(archive, "wb", preset=4) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        tar.add(site, arcname=".")
    if args.part_mb:
        split(archive, args.part_mb * 1_000_000)
    return archive


def split(archive: Path, size: int) -> None:
    data = archive.read_bytes()
    for i in range(0, len(data), size):
        Path(f"{archive}.part{i // size}").write_bytes(data[i : i + size])
    print(f"{-(-len(data) // size)} parts of at most {size} bytes beside {archive}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_bundle", description=__doc__)
    p.add_argument("--version", default="0.24.0", help="the vLLM release (0.24.0 pins torch 2.11)")
    p.add_argument("--python", default="3.12", help="the target's Python")
    p.add_argument("--have", default=None, help="a file of the package names the target has")
    p.add_argument("--out", required=True)
    p.add_argument("--part-mb", type=int, default=0, help="also split into parts of this size")
    args = p.parse_args(argv)
    print("wrote", build(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
