"""The answer board: shared memory through which the draft's process (engine/drafts/child.py) hands the engine
(engine/drafts/process.py) a forward's logits, so that the socket carries only the answer's few fields.

Why: a draft step's answer is a row of the vocabulary, 196 KB over the embedded pair's 49,152 tokens. Written to the
socket it cost the child 0.46 ms median a step, blocked until this process had read it, and its read here 0.2-0.4 ms
median, where the copy onto the board costs the child 0.06 ms (docs/results/README.md).

How: the engine makes an anonymous file (Linux's memfd) before it starts the child, which inherits it, and both map
it. The child copies an answer that fits onto the board, then sends its fields; the engine copies the logits off the
board before it sends its next request. One board is enough because a forward's answer is read before the next
forward is asked (RemoteLM's call lock), and only a forward's answer writes the board. An answer larger than the board
(a pass over more than 42 rows; a prefill asks for its last row only) goes through the socket, as does every answer
where memfd is missing (not Linux).
"""

from __future__ import annotations

import math
import mmap
import os

import torch

BOARD_BYTES = 8 << 20  # 42 rows of a 49,152-token vocabulary; pages are backed only once written


class AnswerBoard:
    """`nbytes` of shared memory, seen as float32 values; `fd` while the child has yet to inherit it."""

    def __init__(self, fd: int, nbytes: int):
        self.fd, self.nbytes = fd, nbytes
        self._map = mmap.mmap(fd, nbytes)
        self.values = torch.frombuffer(self._map, dtype=torch.float32)  # [nbytes / 4], over the shared pages

    @classmethod
    def create(cls, nbytes: int = BOARD_BYTES) -> AnswerBoard | None:
        """A new board (the engine's side), or None where memfd is missing."""
        make = getattr(os, "memfd_create", None)
        if make is None:
            return None
        fd = make("specbranch-answers")
        os.ftruncate(fd, nbytes)
        return cls(fd, nbytes)

    def close_file(self) -> None:
        """Close the file, once the child has inherited it: the mapping is enough on either side."""
        os.close(self.fd)

    def put(self, logits: torch.Tensor) -> bool:
        """Copy float32 logits onto the board (the child's side); False, with nothing written, where they do not fit."""
        n = logits.numel()
        if n > self.values.numel():
            return False
        self.values[:n].copy_(logits.reshape(-1))
        return True

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A copy of the logits the child put, as a [shape] float32 tensor of this process's own."""
        return self.values[: math.prod(shape)].view(shape).clone()
