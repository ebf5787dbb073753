"""Free TCP ports for rendezvous: `torch.distributed` process groups of the Megatron ranks and the
NCCL weight groups of `weight_sync.nccl` (one home for both)."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now (the OS picks it; the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
