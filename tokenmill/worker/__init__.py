"""What runs on a device: the model runner (batch tensors, forward pass, sampling) and its sampler."""
