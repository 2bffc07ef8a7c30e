"""The weight-sync digest against its definition, computed here in plain Python integers (not the library's torch
code): whole tensors of several dtypes and shapes (rows longer than one segment too), and any cut into blocks adds up
to the whole."""

import pytest
import torch
from digest_oracle import oracle

from rlightning_comm.weights.commit._digest import block_digest, digest_int, tensor_digest

CASES = [
    torch.randn(7, 13),
    torch.randn(3, 4, 5).to(torch.bfloat16),
    torch.randint(-(2**62), 2**62, (5, 3), dtype=torch.int64),
    torch.tensor(3.5),
    torch.randn(40000),  # one row of 160000 bytes: three segments
    torch.randn(3, 20000, dtype=torch.float64),  # rows of 160000 bytes
    torch.rand(6, 9) > 0.5,
    torch.randn(4, 6, dtype=torch.complex64),
]


@pytest.mark.parametrize("t", CASES, ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_digest_matches_its_definition_and_adds_up_over_blocks(t: torch.Tensor) -> None:
    want = oracle(t)
    assert tensor_digest(t) == want
    if t.dim() == 2:  # a strided copy of the same values
        assert tensor_digest(t.t().contiguous().t()) == want
    if t.dim() == 0:
        return
    # Cut the first and the last dimension at uneven points: the blocks' contributions add up to the whole.
    cuts0 = sorted({0, t.shape[0] // 3, t.shape[0]}) if t.dim() > 1 else [0, 1]
    cuts1 = sorted({0, 1, (2 * t.shape[-1]) // 3, t.shape[-1]})
    total = torch.zeros((), dtype=torch.int64)
    for a0, b0 in zip(cuts0, cuts0[1:]):
        for a1, b1 in zip(cuts1, cuts1[1:]):
            if t.dim() == 1:
                block, offsets = t[a1:b1], (a1,)
            else:
                block, offsets = t[a0:b0, ..., a1:b1], (a0,) + (0,) * (t.dim() - 2) + (a1,)
            total += block_digest(block, offsets, tuple(t.shape))
    assert digest_int(total) == want


def test_one_changed_byte_and_a_swap_change_the_digest() -> None:
    t = torch.randn(64, 33)
    d = tensor_digest(t)
    for pos in (0, 5, 2111):
        u = t.clone()
        u.view(torch.int8).view(-1)[pos] ^= 1 << 7
        assert tensor_digest(u) != d
    u = t.clone()
    u[[3, 7]] = u[[7, 3]]
    assert tensor_digest(u) != d


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the digest on CUDA tensors needs a GPU; this machine has none"
)
def test_digest_on_a_cuda_tensor_is_the_hosts_and_stays_on_the_device() -> None:
    # Shapes for both CUDA paths: the int8 kernel (more than 16 rows, a multiple of 8 bytes per row) and the float64
    # fallback (few rows, odd row lengths); blocks of them add up as on the host.
    for t in (torch.randn(64, 40), torch.randn(5, 3).to(torch.bfloat16), torch.randn(40000), torch.randn(33, 7)):
        on_gpu = t.cuda()
        assert tensor_digest(on_gpu) == oracle(t)
        part = block_digest(on_gpu[1:], (1,) + (0,) * (t.dim() - 1), tuple(t.shape))
        assert part.device == on_gpu.device  # no copy to the host until the sum is read
        assert digest_int(part + block_digest(on_gpu[:1], (0,) * t.dim(), tuple(t.shape))) == oracle(t)
