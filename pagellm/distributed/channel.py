"""Rank 0 telling the worker ranks what to do, one message at a time.

A message is a command, small Python arguments and, for a step, a few tensors. The command
and the arguments (with the tensors' names, dtypes and shapes) are pickled into one
fixed-size header broadcast over a gloo group on the CPU; the tensors follow as a single
byte buffer over the device group (NCCL on CUDA, so they land on the GPU without a copy
through the host). A step is therefore two broadcasts. The control group's timeout is very
long on purpose: an idle engine must not time its waiting workers out, and a rank that dies
closes its sockets, which fails the others' pending collectives at once.

Commands other than a step are answered: each rank reports (error, value) to rank 0, so a
worker that fails to load its shard is a clear error on rank 0, not a hang.
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

HEADER_BYTES = 16384
_LEN = 8  # the header starts with the pickle's length, as an int64
_ALIGN = 8  # each tensor starts on an 8-byte boundary, so every dtype can be viewed in place


class Channel:
    def __init__(self, rank: int, ctrl_group: Any, data_group: Any, device: torch.device) -> None:
        self.rank = rank
        self.ctrl = ctrl_group
        self.data = data_group
        self.device = device
        self._header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)

    # ---- rank 0 --------------------------------------------------------------------------
    def send(self, command: str, args: tuple = (), tensors: dict[str, torch.Tensor] | None = None) -> None:
        specs, chunks, offset = [], [], 0
        for name, t in (tensors or {}).items():
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            pad = -flat.numel() % _ALIGN
            specs.append((name, t.dtype, tuple(t.shape), offset, flat.numel()))
            chunks.append(flat)
            if pad:
                chunks.append(torch.zeros(pad, dtype=torch.uint8, device=flat.device))
            offset += flat.numel() + pad
        blob = pickle.dumps((command, args, specs, offset), protocol=pickle.HIGHEST_PROTOCOL)
        header = self._header
        header[:_LEN] = torch.tensor([len(blob)], dtype=torch.int64).view(torch.uint8)
        inline = len(blob) <= HEADER_BYTES - _LEN
        if inline:
            header[_LEN:_LEN + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        dist.broadcast(header, src=0, group=self.ctrl)
        if not inline:
            dist.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), src=0, group=self.ctrl)
        if offset:
            payload = torch.cat([c.to(self.device) for c in chunks])
            dist.broadcast(payload, src=0, group=self.data)

    def collect(self, error: str | None, value: Any) -> list[tuple[str | None, Any]]:
        """Rank 0's side of an answered command: every rank's (error, value), rank 0 first."""
        answers: list[Any] = [None] * dist.get_world_size(self.ctrl)
        dist.gather_object((error, value), answers, dst=0, group=self.ctrl)
        return answers

    # ---- workers -------------------------------------------------------------------------
    def recv(self) -> tuple[str, tuple, dict[str, torch.Tensor]]:
        header = self._header
        dist.broadcast(header, src=0, group=self.ctrl)
        size = int(header[:_LEN].view(torch.int64)[0])
        if size <= HEADER_BYTES - _LEN:
            blob = header[_LEN:_LEN + size].numpy().tobytes()
        else:
            buf = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(buf, src=0, group=self.ctrl)
            blob = buf.numpy().tobytes()
        command, args, specs, nbytes = pickle.loads(blob)
        tensors = {}
        if nbytes:
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dist.broadcast(payload, src=0, group=self.data)
            for name, dtype, shape, offset, n in specs:
                tensors[name] = payload[offset:offset + n].view(dtype).view(shape)
        return command, args, tensors

    def answer(self, error: str | None, value: Any) -> None:
        dist.gather_object((error, value), None, dst=0, group=self.ctrl)
