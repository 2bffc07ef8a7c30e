"""The weight-sync digest computed from its documented definition in plain Python integers (numpy only for exact
int64 products): an oracle that is not the library's torch code."""

import numpy as np
import torch

MASK = (1 << 64) - 1
C = 65536
G = 0x9E3779B97F4A7C15


def mix(z: int) -> int:
    z &= MASK
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


BYTE_W = np.array(
    [[((mix((b * 8 + j) * G + 1) >> 56) | (j == 0)) - 128 for j in range(8)] for b in range(C)], dtype=np.int64
)


def oracle(t: torch.Tensor) -> int:
    """The documented definition, in Python ints (numpy only for the exact int64 products within a segment)."""
    t = t.detach().contiguous()
    k = t.element_size()
    n = t.shape[-1] if t.dim() else 1
    raw = np.frombuffer(t.reshape(-1).view(torch.uint8).numpy().tobytes(), dtype=np.int8).astype(np.int64)
    rows = raw.reshape(-1, n * k) if raw.size else raw.reshape(0, max(n * k, 1))
    segments = -(-(n * k) // C)
    total = 0
    for f, row in enumerate(rows):
        for s in range(segments):
            part = row[s * C : (s + 1) * C]
            inner = part @ BYTE_W[: len(part)]
            v = f * segments + s
            for j in range(8):
                h = mix((v * 8 + j) * G + 2) | (j == 0)
                total += h * int(inner[j])
    return total & MASK


def oracles(state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Every tensor's digest, by the definition."""
    return {k: oracle(v) for k, v in state.items()}
