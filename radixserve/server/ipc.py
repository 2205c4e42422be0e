"""Addresses of the three ZMQ pipes that join the server's processes, and socket helpers.

  TokenizerManager --PUSH--> scheduler_inputs[r] (PULL, bound by replica r's scheduler)
  Scheduler        --PUSH--> detokenizer_input   (PULL, bound by the detokenizer)
  Detokenizer      --PUSH--> tokenizer_input     (PULL, bound by the TokenizerManager)

The receiving side binds, senders connect; ZMQ queues what is sent before the peer binds.
Addresses are ipc:// sockets in a private temporary folder, removed on shutdown.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import zmq


@dataclass(frozen=True)
class PortArgs:
    ipc_dir: str
    scheduler_inputs: tuple[str, ...]  # one per data-parallel replica
    detokenizer_input: str
    tokenizer_input: str

    @classmethod
    def create(cls, dp_size: int = 1) -> "PortArgs":
        folder = tempfile.mkdtemp(prefix="radixserve-")
        return cls(ipc_dir=folder,
                   scheduler_inputs=tuple(f"ipc://{os.path.join(folder, f'scheduler{r}')}"
                                          for r in range(dp_size)),
                   detokenizer_input=f"ipc://{os.path.join(folder, 'detokenizer')}",
                   tokenizer_input=f"ipc://{os.path.join(folder, 'tokenizer')}")

    @property
    def scheduler_input(self) -> str:
        """Replica 0's (the only one without data parallelism)."""
        return self.scheduler_inputs[0]

    def cleanup(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def pull_socket(context: zmq.Context, address: str) -> zmq.Socket:
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    return sock


def push_socket(context: zmq.Context, address: str) -> zmq.Socket:
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a slow peer: memory is the bound
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock
