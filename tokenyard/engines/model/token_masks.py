"""A step's grammar masks: filled before (or while) the forward runs, applied to its logits after.

    masks = TokenMasks.fill(constraints, vocab, device)   # xgrammar's fill, then the bits unpacked
    masked = masks.apply(logits, rows)                   # logits [S, V]: rows[j] gets masks row j
    tokens = masks.greedy(logits, rows)                  # or, for greedy rows, the tokens straight away

Rules:
- Everything that does not need the logits happens in `fill`: the int32 bitmask (xgrammar, one row
  per constraint, structured_output.fill_bitmasks) and, for logits on the CPU, the bits unpacked into a
  bool [R, V] (numpy's unpackbits, ~0.1 ms for 32 rows of 49,152). So when the engine fills on its
  mask thread while the forward runs (tokenyard/engines/runtime/mask_prefetch.py), what is left after
  the forward is one select over the batch.
- On a GPU the 4-byte words travel (32x less than the bools) and are unpacked there.
- `apply` returns a new tensor: forbidden logits -inf, the others bit for bit the input's (the caller's
  logits are read again for logprobs, and may be an inference tensor or a CUDA graph's output).
- `greedy` picks a greedy row's token in C from the bitmask words (tokenyard/kernels/cpu_masked_argmax.py)
  without a masked copy of the logits; the same tokens as `apply` then argmax (the torch path elsewhere).
- `PendingMasks` is a fill running elsewhere; `for_rows` takes it when the constraints it covers
  carry it (Constraint.prefetched; accept() drops it), else fills now. Same masks either way.
"""
from __future__ import annotations

import sys
from concurrent.futures import Future
from typing import Any, Sequence

import numpy as np
import torch

from tokenyard.engines.core.structured_output import fill_bitmasks
from tokenyard.kernels import cpu_masked_argmax

_NEG_INF = float("-inf")


class TokenMasks:
    """R rows of allowed tokens: `bitmask` int32 [R, ceil(V/32)], and `allowed` bool [R, V] on the host
    when the logits are on the CPU (None: unpacked where the logits are)."""

    __slots__ = ("bitmask", "allowed", "vocab")

    def __init__(self, bitmask: torch.Tensor, allowed: torch.Tensor | None, vocab: int) -> None:
        self.bitmask = bitmask
        self.allowed = allowed
        self.vocab = vocab

    @classmethod
    def fill(cls, constraints: Sequence[Any], vocab: int, device: torch.device) -> "TokenMasks":
        bitmask = torch.empty(len(constraints), (vocab + 31) // 32, dtype=torch.int32)  # the library fills host memory
        fill_bitmasks(list(constraints), bitmask)
        allowed = _unpack_host(bitmask, vocab) if device.type == "cpu" else None
        return cls(bitmask, allowed, vocab)

    def select(self, index: list[int]) -> "TokenMasks":
        """The masks of rows `index`, in that order."""
        if index == list(range(self.bitmask.shape[0])):
            return self
        at = torch.tensor(index, dtype=torch.long)
        return TokenMasks(self.bitmask.index_select(0, at),
                          None if self.allowed is None else self.allowed.index_select(0, at), self.vocab)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits [S, V] with row rows[j] masked by mask row j; a new tensor."""
        if logits.shape[-1] != self.vocab:
            raise ValueError(f"masks for a vocabulary of {self.vocab}, logits of {logits.shape[-1]}")
        allowed = self.allowed
        if allowed is None or logits.device.type != "cpu":
            allowed = _unpack_device(self.bitmask, self.vocab, logits.device)
        ninf = torch.tensor(_NEG_INF, dtype=logits.dtype, device=logits.device)
        if len(rows) == logits.shape[0]:
            return torch.where(allowed, logits, ninf)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        # index_copy, not in place: logits may be an inference tensor (and is read again for logprobs)
        return logits.index_copy(0, index, torch.where(allowed, logits.index_select(0, index), ninf))

    def greedy(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        """Row j: the first highest logit of logits[rows[j]] among the tokens mask row j allows (a NaN
        wins; 0 when nothing allowed beats -inf), as argmax over apply()'s rows would give."""
        if logits.shape[-1] != self.vocab:
            raise ValueError(f"masks for a vocabulary of {self.vocab}, logits of {logits.shape[-1]}")
        kernel = cpu_masked_argmax.load() if logits.device.type == "cpu" else None
        if kernel is not None and kernel.supports(logits):
            return kernel.argmax(logits, rows, self.bitmask, self.vocab)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        masked = TokenMasks(self.bitmask, self.allowed, self.vocab).apply(logits.index_select(0, index),
                                                                         list(range(len(rows))))
        if masked.device.type == "cpu" and masked.dtype == torch.float32:
            return masked.numpy().argmax(axis=-1).tolist()
        return masked.argmax(dim=-1).tolist()


class PendingMasks:
    """A TokenMasks being filled elsewhere for `constraints` (row j: constraints[j])."""

    __slots__ = ("_future", "_rows", "vocab")

    def __init__(self, future: "Future[TokenMasks]", constraints: Sequence[Any], vocab: int) -> None:
        self._future = future
        self._rows = {id(c): j for j, c in enumerate(constraints)}
        self.vocab = vocab

    def result(self) -> TokenMasks:
        """Wait for the fill; its exception, if it raised."""
        return self._future.result()

    def wait(self) -> None:
        """Wait for the fill to be over (its outcome is for whoever applies it)."""
        self._future.exception()

    def row_of(self, constraint: Any) -> int | None:
        return self._rows.get(id(constraint))


def for_rows(constraints: Sequence[Any], vocab: int, device: torch.device) -> TokenMasks:
    """The masks of these constraints, in order: the step's prefetched fill when every one of them
    carries the same one, else filled here."""
    pending = getattr(constraints[0], "prefetched", None)
    if isinstance(pending, PendingMasks):
        index = [pending.row_of(c) if getattr(c, "prefetched", None) is pending else None for c in constraints]
        if pending.vocab == vocab and None not in index:
            return pending.result().select(index)  # type: ignore[arg-type]
        pending.wait()   # not these rows: let it finish before the same matchers are filled here
    return TokenMasks.fill(constraints, vocab, device)


def _unpack_host(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [R, V]: bit t%32 of word t//32. On a little-endian host the words' bytes are in token
    order, each byte's bits lowest first: numpy's unpackbits with bitorder='little', one pass."""
    if sys.byteorder != "little":
        return _unpack_device(bitmask, vocab, torch.device("cpu"))
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(np.ascontiguousarray(bits[:, :vocab])).view(torch.bool)


def _unpack_device(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    bits = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((bits[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :vocab]
