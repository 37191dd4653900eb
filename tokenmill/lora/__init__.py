"""LoRA adapters over the base model's linear layers, several in one batch (as vLLM's punica path).

- `peft.py`: read a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
  into low-rank factors per base layer and shard.
- `weights.py`: `LoRAWeights`, one per adapted linear layer: every slot's factors stacked, and the
  per-token-group delta added to the layer's output (whatever its weight format).
- `manager.py`: `LoRAManager`, the runner's slots (adapter name -> slot), loading and unloading at
  run time, and the step's `LoRABatch` (which tokens run which adapter).
"""
