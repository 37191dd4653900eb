"""`tokenmill plan`: what a model needs and how fast it can run on some hardware, from its config alone.

`model_facts` reads the architecture (parameters by kind, each attention layer's KV row), `hardware`
holds published figures and measures this machine, `roofline` turns both into memory, fit and speed
estimates, `cli` prints them. Only `model_facts` (building the model on the meta device) and the `auto`
measurement import torch; `fit` holds the engine-side helper for `serve --max-model-len auto`.
"""
