"""Tensor parallelism on torch.distributed: the process group of one engine's workers and the
collectives its layers call (`parallel_state`)."""
