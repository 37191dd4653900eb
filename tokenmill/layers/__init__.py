"""The layer library model files are built from: linear layers whose storage a quantization method
owns, attention (one module per layer, with its KV-cache spec), rotary embedding, norms,
activations, embeddings and the LM head."""
