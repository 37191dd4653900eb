"""Write a GGUF model as an HF checkpoint directory (float32 safetensors, config, tokenizer), so that
lm-eval's `hf` backend and `tokenmill serve` read the very same weights.

    python eval/gguf_to_hf.py [MODEL] OUT_DIR      # MODEL: a tokenmill alias or a .gguf path (default model)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill.loader.source import resolve_model


def main(argv: list[str]) -> None:
    if len(argv) not in (1, 2):
        raise SystemExit(__doc__)
    model, out = (None, argv[0]) if len(argv) == 1 else argv
    source = resolve_model(model)
    if source.kind != "gguf":
        raise SystemExit(f"{source.path} is not a GGUF file")
    directory, name = str(source.path.parent), source.path.name
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    # transformers will not save a model it loaded from GGUF: copy the (dequantized) weights into a plain one
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    print(Path(out).resolve())


if __name__ == "__main__":
    main(sys.argv[1:])
