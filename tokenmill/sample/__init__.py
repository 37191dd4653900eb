"""Sampling: `sampler.py` (the sampler and its steps: penalties, temperature, top-k/p, min-p, logprobs) and
`rejection_sampler.py` (verifying drafted tokens). Below both the model runner and the drafters, which
sample their drafts with the same steps."""
