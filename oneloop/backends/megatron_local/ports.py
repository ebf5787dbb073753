"""Free TCP ports for rendezvous: `torch.distributed` process groups of the Megatron ranks and the
NCCL weight groups of `weight_sync.nccl` (one home for both)."""

import random
import socket

RENDEZVOUS_PORTS = (20000, 32000)
"""Where `free_port` looks: below Linux's ephemeral range (32768+, where the OS hands out the
ports of every outgoing connection and every `bind(0)`) and above Ray's worker ports (10002-19999).
A port picked from the ephemeral range can be taken by any socket in the gap between the pick and
the process group's bind (seen in CI: EADDRINUSE while Ray started workers); here only another
explicit pick can take it."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now (the caller binds it soon after): a random one of
    `RENDEZVOUS_PORTS` that binds, else one the OS picks."""
    pick = random.SystemRandom()
    for _ in range(64):
        port = pick.randrange(*RENDEZVOUS_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
