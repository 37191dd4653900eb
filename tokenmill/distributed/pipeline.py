"""What a pipeline stage's model holds and hands on: `PPMissingLayer` stands where a decoder layer
of another stage would be (no weights; the checkpoint's tensors for it are skipped), and a stage
that is not the last returns `IntermediateTensors` (the hidden state and the residual stream) for
the next stage instead of the final hidden state."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class IntermediateTensors(NamedTuple):
    hidden: torch.Tensor
    residual: torch.Tensor


class PPMissingLayer(nn.Identity):
    """A decoder layer another pipeline stage runs."""
