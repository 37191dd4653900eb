"""Offline tools that use the engine but are no part of serving: the draft-head trainers
(`train_head.py`: `tokenmill train-draft-head`, Medusa heads; `train_eagle.py`: its `--kind eagle3`)."""
