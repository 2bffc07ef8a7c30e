"""The achieved rate of a lab link: a timed bulk TCP transfer between two hosts over plain sockets."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

from ._lab import Lab
from ._netns import LabError, format_rate

_CHUNK = 1 << 20
_WAIT = 30.0  # seconds any socket operation of the calibration may block


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What one bulk transfer achieved.

    Attributes:
        bits_per_s: Payload bits per second, from the receiver's accept to its end of stream.
        nbytes: Payload bytes moved.
        seconds: The receiver's time.
        src: Sending host.
        dst: Receiving host.
        rate_bit: The lab's configured rate (``None``: unshaped).
    """

    bits_per_s: float
    nbytes: int
    seconds: float
    src: int
    dst: int
    rate_bit: float | None

    def __str__(self) -> str:
        shaped = "" if self.rate_bit is None else f" ({self.bits_per_s / self.rate_bit:.0%} of the shaper's rate)"
        return (
            f"calibration: {format_rate(self.bits_per_s)}{shaped}, TCP host {self.src} -> host {self.dst}, "
            f"{self.nbytes / 2**20:.0f} MiB in {self.seconds * 1e3:.0f} ms"
        )


def calibrate(lab: Lab, src: int = 0, dst: int = 1, seconds: float = 0.4, nbytes: int | None = None) -> Calibration:
    """Send ``nbytes`` (default: ``seconds`` at the lab's rate, 8 to 512 MiB) from host ``src`` to host ``dst`` over
    one TCP connection between their lab addresses; time it at the receiver.

    Raises:
        LabError: the transfer failed or stalled (a socket operation blocked more than 30 s).
    """
    if nbytes is None:
        rate = lab.rate_bit if lab.rate_bit is not None else 10e9
        nbytes = min(512 << 20, max(8 << 20, int(rate / 8 * seconds) // _CHUNK * _CHUNK))

    def listener() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((lab.addresses[dst], 0))
        s.listen(1)
        s.settimeout(_WAIT)
        return s

    server = lab.run_in(dst, listener)
    client = lab.run_in(src, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))  # connects from src's host
    client.settimeout(_WAIT)
    failed: list[BaseException] = []

    def send() -> None:
        try:
            client.connect(server.getsockname())
            payload = memoryview(bytearray(_CHUNK))
            for _ in range(nbytes // _CHUNK):
                client.sendall(payload)
            client.shutdown(socket.SHUT_WR)
        except OSError as err:
            failed.append(err)

    sender = threading.Thread(target=send, name="netlab-calibrate", daemon=True)
    try:
        sender.start()
        conn, _ = server.accept()
        with conn:
            conn.settimeout(_WAIT)
            start, got = time.perf_counter(), 0
            buf = bytearray(_CHUNK)
            while n := conn.recv_into(buf):
                got += n
            elapsed = time.perf_counter() - start
    except OSError as err:
        raise LabError(f"calibration host {src} -> host {dst} failed: {err}") from err
    finally:
        sender.join(_WAIT)
        client.close()
        server.close()
    if failed or got != nbytes:
        raise LabError(f"calibration host {src} -> host {dst}: expected {nbytes} bytes, got {got}; {failed}")
    return Calibration(got * 8 / elapsed, got, elapsed, src, dst, lab.rate_bit)
