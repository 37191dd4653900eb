"""LoRA adapters over the base model's linear layers, several in one batch (as vLLM's punica path).

- `peft.py`: read a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
  into low-rank factors per base layer and shard.
- `weights.py`: `LoRAWeights`, one per adapted linear layer: every slot's factors stacked, and the
  per-token-group delta added to the layer's output (whatever its weight format): on CPU float32 one
  C++ call for the whole batch (`tokenmill.kernels.lora`, also inside the compiled decode step),
  elsewhere torch ops per adapter.
- `manager.py`: `LoRAManager`, the runner's slots (adapter name -> slot), loading and unloading at
  run time, and the step's `LoRABatch` (which tokens run which adapter).
"""
