"""Read an HF checkpoint directory: config.json and (sharded) safetensors, memory-mapped and
yielded tensor by tensor so the checkpoint is never held twice in memory."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tokenmill.models.registry import config_from_hf_dict


class HFCheckpoint:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        config_path = directory / "config.json"
        try:
            raw = json.loads(config_path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{config_path} is missing") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from None
        self.config = config_from_hf_dict(raw)
        self.quantization_config: dict | None = raw.get("quantization_config")
        if self.quantization_config is not None and not isinstance(self.quantization_config, dict):
            raise ValueError(f"{config_path}: quantization_config must be an object")
        self.files = self._weight_files()

    @property
    def quant_method(self) -> str | None:
        """The checkpoint's quantization method (its quantization_config's quant_method), if any."""
        return None if self.quantization_config is None else str(self.quantization_config.get("quant_method"))

    def tensor_names(self) -> set[str]:
        names: set[str] = set()
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                names.update(f.keys())
        return names

    def _weight_files(self) -> list[Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index} is corrupt: {e}") from None
            files = [self.directory / f for f in sorted(set(weight_map.values()))]
            for f in files:
                if not f.is_file():
                    raise FileNotFoundError(f"{f} is listed in {index.name} but missing")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            hint = (
                " (only PyTorch .bin files found; convert them to safetensors)"
                if any(self.directory.glob("*.bin"))
                else ""
            )
            raise FileNotFoundError(f"no *.safetensors weights in {self.directory}{hint}")
        return files

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            except SafetensorError as e:
                raise ValueError(f"{path} is not a valid safetensors file: {e}") from None
