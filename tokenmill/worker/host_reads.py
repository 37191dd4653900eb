"""The step's one read of the device. On a GPU every read of a device tensor by the host (`.tolist()`,
`.item()`, `int(t)`) waits for all the work queued before it, so a step that reads its sampled ids, then
their logprobs, then a verify step's argmax, stalls the host several times while the device idles after
each. The runner instead registers what it will need (`HostReads.add`: tensors and what to do with their
values) and reads them all at the step's end in one copy (`HostReads.read`): the tensors flattened into
one float64 buffer (exact for token ids below 2**53 and for float32 values) and split again on the host."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class HostReads:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.uses: list[tuple[int, Callable[..., None]]] = []  # (how many tensors, what takes their values)

    def add(self, tensors: list[torch.Tensor], use: Callable[..., None]) -> None:
        """`use(*values)` runs in `read`, with each tensor's values as nested lists (`Tensor.tolist`'s)."""
        self.tensors.extend(tensors)
        self.uses.append((len(tensors), use))

    def read(self) -> None:
        """One transfer of every registered tensor, then each use in the order added."""
        values = read_to_host(self.tensors)
        k = 0
        for n, use in self.uses:
            use(*values[k : k + n])
            k += n
        self.tensors, self.uses = [], []


def read_to_host(tensors: list[torch.Tensor]) -> list[list]:
    """The tensors' values (as `tolist` gives them: ints for integer and bool tensors) in one copy."""
    if not tensors:
        return []
    if len(tensors) == 1:
        return [tensors[0].tolist()]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).numpy(force=True)
    out, k = [], 0
    for t in tensors:
        part = flat[k : k + t.numel()].reshape(t.shape)
        if not t.is_floating_point():
            part = part.astype(np.bool_ if t.dtype == torch.bool else np.int64)
        out.append(part.tolist())
        k += t.numel()
    return out
