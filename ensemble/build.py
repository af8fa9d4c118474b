"""Write a model repository: rendered configs plus the models' code from the checked-in
repository."""

from __future__ import annotations

import shutil
from pathlib import Path

from ensemble.render import MODEL_NAMES, render_configs
from ensemble.settings import ServeSettings
from ensemble.tensors import ENSEMBLE, MODELS
from ensemble.wiring import check_wiring

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SOURCE_REPOSITORY = PROJECT_ROOT / "model_repository"


def build_repository(
    settings: ServeSettings, out_dir: str | Path, source: str | Path = SOURCE_REPOSITORY
) -> Path:
    """Render every config.pbtxt into out_dir and copy each model's `1/` code beside it."""
    check_wiring(ENSEMBLE, MODELS)
    configs = render_configs(settings)
    out = Path(out_dir).resolve()
    source = Path(source).resolve()
    for name in MODEL_NAMES:
        model_dir = out / name
        version_dir = model_dir / "1"
        if version_dir.exists() and version_dir.resolve() != (source / name / "1"):
            shutil.rmtree(version_dir)
        if not version_dir.exists():
            shutil.copytree(
                source / name / "1",
                version_dir,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            )
        (model_dir / "config.pbtxt").write_text(configs[name])
    return out


def stale_configs(settings: ServeSettings, repository: str | Path = SOURCE_REPOSITORY) -> list[str]:
    """Names of the models whose config.pbtxt differs from what `settings` renders."""
    configs = render_configs(settings)
    stale = []
    for name in MODEL_NAMES:
        path = Path(repository) / name / "config.pbtxt"
        if not path.exists() or path.read_text() != configs[name]:
            stale.append(name)
    return stale
