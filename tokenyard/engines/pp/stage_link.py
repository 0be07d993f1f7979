"""The messages between pipeline ranks, as torch.distributed point-to-point ops.

Per step, along each link (previous stage -> next stage, and rank 0 -> its tensor-parallel peers):
    header   int64 [2] = (payload bytes, tokens), on the ctrl group; payload bytes -1 means stop
    payload  uint8 [n]: the step's StepInputs, pickled (plain lists), on the ctrl group
    (payload bytes STATS instead asks every rank for its busy time: each hands the request on and
    sends float64 [busy seconds, seconds since the last request, busy thread-CPU seconds] to
    rank 0 on the ctrl group)
    hidden   [tokens, hidden_size] in the model dtype, on the data group (not to stage 0)
and from the last stage's first rank back to rank 0:
    logits   float32 [rows, vocab] (rows = sampled sequences), or int64 [1] when no row is
             sampled: rank 0 hears of every step's end, so it knows the batch has left the pipeline.

Every send is an isend: a stage hands its output on and goes back to receiving while the next
stage is still busy with the previous batch. Messages between two ranks with the same tag arrive
in the order sent, and every rank handles steps in rank 0's order, so no step numbers are needed.
`Outbox` keeps the sent tensors alive until their sends complete.
"""
from __future__ import annotations

import pickle
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenyard.engines.model.model_runner import StepInputs

TAG_HEADER, TAG_PAYLOAD, TAG_HIDDEN, TAG_LOGITS, TAG_STATS = 11, 12, 13, 14, 15
STOP = -1
STATS = -2
MAX_PENDING = 16   # sends left running before the oldest is waited for


def encode(inputs: StepInputs) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(inputs, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def decode(payload: torch.Tensor) -> StepInputs:
    return pickle.loads(payload.numpy().tobytes())


class Outbox:
    """Sends in flight, with the tensors they read."""

    def __init__(self) -> None:
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def isend(self, t: torch.Tensor, dst: int, group: dist.ProcessGroup | None, tag: int) -> None:
        self._pending.append((dist.isend(t, dst, group=group, tag=tag), t))
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()[0].wait()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every send; with timeout_s, for at most that long each (a hung peer)."""
        while self._pending:
            work = self._pending.popleft()[0]
            if timeout_s is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=timeout_s))

    def prune(self) -> None:
        """Drop the sends that have completed (raising, via wait, if one failed)."""
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()[0].wait()


class StageLink:
    """One rank's ends of the pipeline links."""

    def __init__(self, ctrl: dist.ProcessGroup, data: dist.ProcessGroup | None, device: torch.device,
                 dtype: torch.dtype, hidden_size: int, vocab_size: int) -> None:
        self.ctrl, self.data = ctrl, data
        self.device, self.dtype = device, dtype
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.outbox = Outbox()

    # -- sending ---------------------------------------------------------------------------
    def send_inputs(self, dst: int, payload: torch.Tensor, num_tokens: int) -> None:
        self.outbox.isend(torch.tensor([payload.numel(), num_tokens], dtype=torch.long), dst, self.ctrl, TAG_HEADER)
        self.outbox.isend(payload, dst, self.ctrl, TAG_PAYLOAD)

    def send_hidden(self, dst: int, h: torch.Tensor) -> None:
        self.outbox.isend(h.contiguous(), dst, self.data, TAG_HIDDEN)

    def send_logits(self, dst: int, logits: torch.Tensor) -> None:
        done = logits if logits.shape[0] else torch.zeros(1, dtype=torch.long, device=self.device)
        self.outbox.isend(done.contiguous(), dst, self.data, TAG_LOGITS)

    def send_stop(self, dst: int) -> None:
        self.outbox.isend(torch.tensor([STOP, 0], dtype=torch.long), dst, self.ctrl, TAG_HEADER)

    def send_stats_request(self, dst: int) -> None:
        self.outbox.isend(torch.tensor([STATS, 0], dtype=torch.long), dst, self.ctrl, TAG_HEADER)

    def send_stats(self, busy_s: float, window_s: float, busy_cpu_s: float) -> None:
        t = torch.tensor([busy_s, window_s, busy_cpu_s], dtype=torch.float64)
        self.outbox.isend(t, 0, self.ctrl, TAG_STATS)

    def recv_stats(self, src: int) -> tuple[float, float, float]:
        t = torch.empty(3, dtype=torch.float64)
        dist.recv(t, src, group=self.ctrl, tag=TAG_STATS)
        return float(t[0]), float(t[1]), float(t[2])

    # -- receiving -------------------------------------------------------------------------
    def recv_header(self, src: int) -> tuple[int, int]:
        """(payload bytes, tokens); payload bytes is STOP at shutdown. Waits as long as it takes."""
        hdr = torch.empty(2, dtype=torch.long)
        dist.recv(hdr, src, group=self.ctrl, tag=TAG_HEADER)
        return int(hdr[0]), int(hdr[1])

    def recv_payload(self, src: int, nbytes: int) -> torch.Tensor:
        payload = torch.empty(nbytes, dtype=torch.uint8)
        dist.recv(payload, src, group=self.ctrl, tag=TAG_PAYLOAD)
        return payload

    def recv_hidden(self, src: int, num_tokens: int) -> torch.Tensor:
        h = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(h, src, group=self.data, tag=TAG_HIDDEN)
        return h

    def recv_logits(self, src: int, rows: int, timeout_s: float) -> torch.Tensor:
        """A step's logits (rows sampled), waiting at most timeout_s: a stage that hangs rather
        than dies must not hang the engine."""
        if rows:
            buf = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=self.device)
        else:
            buf = torch.empty(1, dtype=torch.long, device=self.device)
        dist.irecv(buf, src, group=self.data, tag=TAG_LOGITS).wait(timedelta(seconds=timeout_s))
        return buf
