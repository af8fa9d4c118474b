"""docker/Dockerfile builds and serves: replayed without Docker (see replay.py), on CPU.

The replay copies what the Dockerfile COPYs, runs its Python build steps (model conversion,
`ensemble build`), then loads every Python model of the served repository the way Triton's stub
does (model directory + the real triton_python_backend_utils on sys.path, the image's
environment), so a file the image lacks or a package the stubs cannot import fails here.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from ensemble.render import MODEL_NAMES
from tests.docker.replay import DOCKERFILE, PROJECT_ROOT, Image, ReplayError, replay

BASE_IMAGE = "nvcr.io/nvidia/tritonserver:24.10-py3"
BASE_PYTHON = "3.10"  # Ubuntu 22.04's, in the 24.10 image
BASE_CUDA = (12, 6)  # 24.10 is built on CUDA 12.6.2 (driver 560+, or R525/R535 compat)
OUR_PACKAGES = ("backend", "ensemble", "preprocessing", "postprocessing")

STUB_LOAD = """
import importlib.util, json, sys
model_py, backend_utils = sys.argv[1], sys.argv[2]
sys.path[:0] = [str(__import__("pathlib").Path(model_py).parent), backend_utils]  # as the stub does
spec = importlib.util.spec_from_file_location("model", model_py)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert hasattr(module, "TritonPythonModel"), "no TritonPythonModel"
ours = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())
        if n.split(".")[0] in %r}
print(json.dumps(ours))
""" % (OUR_PACKAGES,)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Image:
    try:
        return replay(tmp_path_factory.mktemp("image"))
    except ReplayError as exc:
        pytest.fail(f"docker build would fail: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Image:
    """What the Dockerfile installs and runs, recorded without running it."""
    return replay(tmp_path_factory.mktemp("recipe"), execute=False)


def served_repository(image: Image) -> Path:
    """The repository the image's entry point serves: the launcher (`python3 -m ensemble serve
    --repository R`, which drains the engines on SIGTERM), not bare tritonserver."""
    assert image.cmd[:4] == ["python3", "-m", "ensemble", "serve"], image.cmd
    assert image.cmd.count("--repository") == 1, image.cmd
    return image.path(image.cmd[image.cmd.index("--repository") + 1])


def pip_requirements(install: list[str]) -> list[Requirement]:
    """The named requirements of one `pip install` (options and the project itself left out)."""
    reqs, skip_next = [], False
    for arg in install:
        if skip_next:
            skip_next = False
        elif arg in ("--index-url", "--extra-index-url", "-c", "-r"):
            skip_next = True
        elif not arg.startswith("-") and not arg.startswith("."):
            reqs.append(Requirement(arg))
    return reqs


def pyproject_field(pattern: str) -> str:
    """A value from pyproject.toml (no TOML parser in Python 3.10's standard library)."""
    match = re.search(pattern, (PROJECT_ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert match, pattern
    return match.group(1)


def project_install_index(image: Image) -> int:
    found = [
        i
        for i, args in enumerate(image.pip_installs)
        if "-e" in args or "." in [a.split("[")[0].strip("\"'") for a in args]
    ]
    assert len(found) == 1, f"one pip install of the project expected: {image.pip_installs}"
    return found[0]


def test_build_steps_run(image):
    commands = [shlex.join(argv) for argv in image.ran]
    assert any("resolve_model" in c for c in commands), commands
    assert any(c.startswith("python3 -m ensemble build") for c in commands), commands


def test_base_image_is_the_one_the_pins_are_for(recipe):
    assert recipe.base == BASE_IMAGE


def test_served_repository_is_complete(image):
    repository = served_repository(image)
    for name in MODEL_NAMES:
        config = (repository / name / "config.pbtxt").read_text()
        assert (repository / name / "1").is_dir(), f"{name}/1 missing"
        if 'backend: "python"' in config:
            assert (repository / name / "1" / "model.py").is_file(), f"{name}/1/model.py missing"
    llm = (repository / "tensorrt_llm" / "config.pbtxt").read_text()
    assert re.search(r'key: "device"\s+value: \{ string_value: "cuda" \}', llm), (
        "not built for CUDA"
    )


def test_stubs_load_every_model_from_the_image(image, tmp_path):
    from ensemble.triton_install import locate_tritonserver

    try:
        backend_utils = locate_tritonserver().root / "backends" / "python"
    except RuntimeError as exc:
        pytest.skip(str(exc))
    script = tmp_path / "stub_load.py"  # outside the image: sys.path[0] adds nothing
    script.write_text(STUB_LOAD)
    repository = served_repository(image)
    models = sorted(repository.glob("*/1/model.py"))
    assert len(models) == 4, models
    for model_py in models:
        result = subprocess.run(
            [sys.executable, str(script), str(model_py), str(backend_utils)],
            cwd=image.path(image.workdir),
            env=image.environment(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{model_py.parent.parent.name}: {result.stderr[-2000:]}"
        files = json.loads(result.stdout.strip().splitlines()[-1])
        outside = {n: f for n, f in files.items() if f and not Path(f).is_relative_to(image.root)}
        assert not outside, (
            f"{model_py.parent.parent.name} imports our packages from outside "
            f"the image (the stub would not find them there): {outside}"
        )


def test_documented_docker_run_serves_another_model(image, tmp_path):
    """The header's `docker run ... python3 -m ensemble serve --model ...` (another model): the
    repository `serve` builds from those options is servable and names the mounted model."""
    from backend.loading.model_paths import resolve_model

    text = " ".join(
        line.lstrip("# ").rstrip("\\ ")
        for line in DOCKERFILE.read_text().splitlines()
        if line.startswith("#")
    )
    match = re.search(
        r"-v (\S+):(\S+) .*? tritonllm (python3 -m ensemble serve(?: --\S+ \S+)+)", text
    )
    assert match, "no documented docker run for another model"
    mount, served_args = match.group(2), shlex.split(match.group(3))[4:]
    here = {mount: resolve_model("default"), "/tmp": str(tmp_path)}

    def local(arg: str) -> str:
        if arg.startswith("--") and "=" in arg:
            flag, value = arg.split("=", 1)
            return f"{flag}={local(value)}"
        for path, replacement in here.items():
            if arg == path or arg.startswith(path + "/"):
                return replacement + arg[len(path) :]
        return arg

    # `serve` builds this repository before it starts the server: build it here the same way.
    served = tmp_path / "repo"
    image.run_python(
        ["python3", "-m", "ensemble", "build", *map(local, served_args), "--out", str(served)]
    )
    assert (served / "tensorrt_llm" / "config.pbtxt").exists()
    assert here[mount] in (served / "tensorrt_llm" / "config.pbtxt").read_text()


def test_torch_is_a_pinned_cuda_build_the_base_image_can_run(recipe):
    installs = [
        (i, args)
        for i, args in enumerate(recipe.pip_installs)
        if any(r.name == "torch" for r in pip_requirements(args))
    ]
    assert len(installs) == 1, recipe.pip_installs
    index, args = installs[0]
    (torch,) = [r for r in pip_requirements(args) if r.name == "torch"]
    assert re.fullmatch(r"==\d+\.\d+\.\d+", str(torch.specifier)), f"torch not pinned: {torch}"
    assert "--index-url" in args, "a PyPI torch is a CUDA 13 build: newer than the image's driver"
    url = args[args.index("--index-url") + 1]
    cuda = re.fullmatch(r"https://download\.pytorch\.org/whl/cu(\d\d)(\d+)", url)
    assert (
        cuda
        and (int(cuda.group(1)), int(cuda.group(2))) <= BASE_CUDA
        and int(cuda.group(1)) == BASE_CUDA[0]
    ), f"{url}: not a CUDA {BASE_CUDA} build"
    assert index < project_install_index(recipe), "installing the project first pulls a PyPI torch"


def test_stub_numpy_is_pinned_below_2(recipe):
    """The 24.10 stub (tritonserver 2.51) reads tensors through numpy 1.x."""
    project = project_install_index(recipe)
    numpys = [
        r
        for args in recipe.pip_installs[project:]
        for r in pip_requirements(args)
        if r.name == "numpy"
    ]
    assert numpys, "numpy not pinned where the project's dependencies are installed"
    for numpy in numpys:
        assert not numpy.specifier.contains("2.0.0") and numpy.specifier.contains("1.26.4"), numpy


def test_every_installed_requirement_is_pinned_and_runs_on_the_base_python(recipe):
    assert SpecifierSet(pyproject_field(r'^requires-python = "([^"]+)"')).contains(BASE_PYTHON)
    for args in recipe.pip_installs:
        for req in pip_requirements(args):
            assert str(req.specifier), f"unpinned in the image: {req}"
    section = pyproject_field(r"^\[project\.optional-dependencies\]\n(.*?)(?:\n\[|\Z)")
    extras = set(re.findall(r"^([\w-]+) = ", section, re.M))
    project = recipe.pip_installs[project_install_index(recipe)]
    wanted = {e for a in project for e in re.findall(r"\[([^\]]+)\]", a) for e in e.split(",")}
    assert wanted <= extras, f"unknown extras {wanted - extras}"
