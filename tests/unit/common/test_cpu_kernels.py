"""The CPU kernels (``cpu_kernels``): paged decode against PyTorch's attention, the linear kernel against
``F.linear``, and the build's failure branches."""

from __future__ import annotations

import platform
import subprocess

import pytest
import torch

from services.common import cpu_kernels
from services.common.cpu_kernels import (
    Elementwise,
    KernelUnavailable,
    LinearKernel,
    PagedDecode,
    load_elementwise,
    load_linear,
    load_paged_decode,
)


@pytest.fixture(scope="module")
def kernel() -> PagedDecode:
    built = load_paged_decode()
    assert built is not None, "the test machine has a C compiler: the kernel must build"
    return built


def _reference(query, keys, values, tables, lens, scale):
    out = []
    kv_heads, _, _, head_dim = keys.shape
    for row in range(query.shape[0]):
        n = int(lens[row])
        k = keys[:, tables[row].long()].reshape(kv_heads, -1, head_dim)[:, :n]
        v = values[:, tables[row].long()].reshape(kv_heads, -1, head_dim)[:, :n]
        out.append(
            torch.nn.functional.scaled_dot_product_attention(query[row][:, None], k, v, scale=scale, enable_gqa=True)[
                :, 0
            ]
        )
    return torch.stack(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(4, 4, 8, 4), (8, 2, 16, 16), (6, 3, 64, 5), (12, 12, 64, 16), (4, 2, 128, 3), (2, 1, 24, 7)],
)
def test_kernel_matches_attention_over_scattered_blocks(kernel, heads, kv_heads, head_dim, block_size):
    generator = torch.Generator().manual_seed(heads * head_dim)
    num_blocks, rows = 40, 7
    keys = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator)
    values = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=generator)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 17, 2, 5 * block_size], dtype=torch.int32)
    width = int(-(-lens.max() // block_size))
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(rows, width, dtype=torch.int32)
    used = 0
    for row, n in enumerate(lens.tolist()):
        needed = -(-n // block_size)
        tables[row, :needed] = order[used : used + needed].int()
        used += needed
    query = torch.randn(rows, heads, head_dim, generator=generator)
    got = kernel(query, keys, values, tables, lens, int(lens.max()), 0.3, torch.empty_like(query))
    torch.testing.assert_close(got, _reference(query, keys, values, tables, lens, 0.3), rtol=1e-5, atol=1e-5)


def test_kernel_reads_strided_queries_and_writes_strided_rows(kernel):
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 6, 4, 8, generator=generator)
    values = torch.randn(2, 6, 4, 8, generator=generator)
    tables = torch.tensor([[5, 1], [2, 0]], dtype=torch.int32)
    lens = torch.tensor([6, 8], dtype=torch.int32)
    packed = torch.randn(2, 5, 8, generator=generator)  # [heads, tokens, dim], as HF hands it over
    query = packed[:, 1:3].transpose(0, 1)  # rows 1-2, a strided view
    out = torch.zeros(5, 2, 8)
    kernel(query, keys, values, tables, lens, 8, 8**-0.5, out[1:3])
    torch.testing.assert_close(out[1:3], _reference(query, keys, values, tables, lens, 8**-0.5), rtol=1e-5, atol=1e-5)
    assert out[0].abs().sum() == 0 and out[3:].abs().sum() == 0


@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_kernel_writes_each_rows_new_key_and_value_before_attending(kernel, head_dim):
    generator = torch.Generator().manual_seed(head_dim)
    kv_heads, heads, block_size = 2, 4, 4
    keys = torch.randn(kv_heads, 8, block_size, head_dim, generator=generator)
    values = torch.randn(kv_heads, 8, block_size, head_dim, generator=generator)
    tables = torch.tensor([[6, 1, 0], [3, 5, 0], [2, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([9, 8, 1], dtype=torch.int32)  # last positions: block 0 slot 0, 5 slot 3, 2 slot 0
    query = torch.randn(3, heads, head_dim, generator=generator)
    # As HF hands them over: [KVH, tokens, D], rows 0-2 of 4 viewed as [rows, KVH, D]; values strided otherwise.
    new_keys = torch.randn(kv_heads, 4, head_dim, generator=generator)[:, :3].transpose(0, 1)
    new_values = torch.randn(4, kv_heads, head_dim, generator=generator)[:3]
    want_keys, want_values = keys.clone(), values.clone()
    for row, (block, slot) in enumerate([(0, 0), (5, 3), (2, 0)]):
        want_keys[:, block, slot] = new_keys[row]
        want_values[:, block, slot] = new_values[row]
    want = _reference(query, want_keys, want_values, tables, lens, 0.5)
    got = kernel(query, keys, values, tables, lens, 9, 0.5, torch.empty_like(query), new_keys, new_values)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)  # nothing else was written


def test_kernel_refuses_new_rows_it_would_misread(kernel):
    keys = torch.zeros(1, 2, 4, 8)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    query = torch.zeros(1, 1, 8)
    new = torch.zeros(1, 1, 8)
    for new_keys, new_values in ((new, None), (None, new), (new.double(), new), (new, torch.zeros(2, 1, 8))):
        with pytest.raises(ValueError, match="layout"):
            kernel(query, keys, keys.clone(), tables, lens, 1, 1.0, torch.empty_like(query), new_keys, new_values)
    with pytest.raises(ValueError, match="layout"):
        kernel(query, keys, keys.clone(), tables, lens, 1, 1.0, torch.empty_like(query), new, new.transpose(1, 2))


def test_kernel_refuses_tensors_it_would_misread(kernel):
    keys = torch.zeros(1, 2, 4, 8)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    query = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="layout"):
        kernel(query.double(), keys, keys, tables, lens, 1, 1.0, torch.empty_like(query))
    with pytest.raises(ValueError, match="layout"):
        kernel(query, keys, keys, tables.long(), lens, 1, 1.0, torch.empty_like(query))
    with pytest.raises(ValueError, match="layout"):
        kernel(query, keys.transpose(2, 3), keys, tables, lens, 1, 1.0, torch.empty_like(query))


def test_no_compiler_leaves_the_kernel_out(monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    load_paged_decode.cache_clear()
    try:
        assert load_paged_decode() is None
        assert "no C compiler" in caplog.text
    finally:
        load_paged_decode.cache_clear()


def test_a_failing_build_says_why_and_leaves_nothing_behind(monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    with pytest.raises(KernelUnavailable, match="failed to build"):
        cpu_kernels.build(cpu_kernels._compiler(), tmp_path / "out" / "lib.so")
    assert list((tmp_path / "out").iterdir()) == []


def test_the_build_lands_in_the_cache_and_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    path = cpu_kernels.library_path(cpu_kernels._compiler())
    assert path.parent == tmp_path / "kernels"
    load_paged_decode.cache_clear()
    try:
        assert load_paged_decode() is not None and path.is_file()
        stamp = path.stat().st_mtime_ns
        load_paged_decode.cache_clear()
        assert load_paged_decode() is not None and path.stat().st_mtime_ns == stamp
    finally:
        load_paged_decode.cache_clear()


@pytest.fixture(scope="module")
def linear_kernel() -> LinearKernel:
    built = load_linear()
    assert built is not None, "the test machine has a C compiler: the kernel must build"
    return built


@pytest.mark.parametrize(
    ("shape", "out_features", "with_bias"),
    [((1, 64), 48, True), ((3, 5, 100), 16, False), ((2, 300, 40), 33, True), ((0, 8), 24, True), ((6, 1), 7, False)],
)
def test_linear_kernel_matches_torch(linear_kernel, shape, out_features, with_bias):
    """Row counts across one tile, several tiles and several passes (> 256 rows); partial last panels."""
    generator = torch.Generator().manual_seed(out_features)
    x = torch.randn(*shape, generator=generator)
    weight = torch.randn(out_features, shape[-1], generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    got = linear_kernel.linear(x, linear_kernel.pack(weight), out_features, bias)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX-512 and AVX2 are x86 builds")
def test_linear_kernel_sums_the_same_at_either_vector_width(linear_kernel, tmp_path):
    """Built without AVX-512 (8-float vectors, 6-row tiles) the kernel returns the very same bits as the
    native build (16-float vectors and 8-row tiles where the CPU has AVX-512): each output is one chain of
    fused multiply-adds in input order at any width, so no model's output depends on the host's vectors."""
    narrow_path = tmp_path / "linear-avx2.so"
    done = subprocess.run(
        [cpu_kernels._compiler(), *cpu_kernels.FLAGS, "-mno-avx512f", "-o", str(narrow_path),
         str(cpu_kernels.LINEAR_SOURCE), "-lm"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    narrow = LinearKernel(narrow_path)
    assert narrow.panel == 16 and linear_kernel.panel in (16, 32)
    generator = torch.Generator().manual_seed(5)
    for rows, in_features, out_features in ((1, 64, 48), (7, 300, 70), (8, 33, 17), (17, 700, 40), (300, 96, 33)):
        x = torch.randn(rows, in_features, generator=generator)
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        wide = linear_kernel.linear(x, linear_kernel.pack(weight), out_features, bias)
        assert torch.equal(narrow.linear(x, narrow.pack(weight), out_features, bias), wide)


def test_linear_kernel_takes_strided_rows(linear_kernel):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 2, 300, generator=generator)[:, 1, 10:290]  # neither rows nor columns contiguous
    weight = torch.randn(20, 280, generator=generator)
    got = linear_kernel.linear(x, linear_kernel.pack(weight), 20, None)
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=1e-4)


def test_linear_kernel_refuses_what_it_would_misread(linear_kernel):
    weight = torch.randn(20, 8)
    packed = linear_kernel.pack(weight)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="layout"):
        linear_kernel.linear(x.double(), packed, 20, None)
    with pytest.raises(ValueError, match="layout"):
        linear_kernel.linear(torch.randn(3, 9), packed, 20, None)  # another input width
    with pytest.raises(ValueError, match="layout"):
        linear_kernel.linear(x, packed, 40, None)  # more outputs than packed
    with pytest.raises(ValueError, match="layout"):
        linear_kernel.linear(x, packed, 20, torch.randn(19))
    with pytest.raises(ValueError, match="2-D float32"):
        linear_kernel.pack(weight.double())


def test_linear_kernel_is_inference_only(linear_kernel):
    packed = linear_kernel.pack(torch.randn(4, 8))
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference only"):
        linear_kernel.linear(x, packed, 4, None)
    with torch.no_grad():
        assert linear_kernel.linear(x, packed, 4, None).shape == (2, 4)


@pytest.mark.parametrize(
    ("cls", "method", "load", "says"),
    [
        (LinearKernel, "pack", load_linear, "disagrees with PyTorch's linear"),
        (Elementwise, "silu_mul", load_elementwise, "SiLU-and-multiply kernel disagrees"),
        (Elementwise, "rms_norm", load_elementwise, "RMSNorm kernel disagrees"),
    ],
)
def test_a_kernel_that_disagrees_is_left_out(monkeypatch, caplog, cls, method, load, says):
    original = getattr(cls, method)
    monkeypatch.setattr(cls, method, lambda self, *args: original(self, *args) * 2)  # a broken op
    load.cache_clear()
    try:
        assert load() is None
        assert says in caplog.text
    finally:
        load.cache_clear()


@pytest.fixture(scope="module")
def elementwise() -> Elementwise:
    built = load_elementwise()
    assert built is not None, "the test machine has a C compiler: the kernel must build"
    return built


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("shape", [(1, 768), (32, 768), (3, 5, 37), (2100, 64), (0, 16), (4, 1)])
def test_rms_norm_kernel_matches_torch(elementwise, shape):
    """One row, decode and prefill sizes (the last spread over threads), a dim with a tail past the lanes, none."""
    generator = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=generator) * 3
    weight = torch.randn(shape[-1], generator=generator)
    got = elementwise.rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, _rms_norm_reference(x, weight, 1e-6), rtol=1e-5, atol=1e-6)


def test_rms_norm_kernel_reads_strided_rows(elementwise):
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3, 100, generator=generator)[:, 1, 4:84]  # rows strided, columns contiguous
    y = torch.randn(40, 12, generator=generator).T  # columns strided: copied first
    for view in (x, y):
        weight = torch.randn(view.shape[-1], generator=generator)
        torch.testing.assert_close(
            elementwise.rms_norm(view, weight, 1e-5), _rms_norm_reference(view, weight, 1e-5), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("shape", [(1, 3072), (32, 3072), (700, 300), (3, 13), (0, 8)])
def test_silu_mul_kernel_matches_torch(elementwise, shape):
    generator = torch.Generator().manual_seed(shape[0])
    gate = torch.randn(*shape, generator=generator) * 8  # far into both tails of the exponential
    up = torch.randn(*shape, generator=generator)
    got = elementwise.silu_mul(gate, up)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_silu_mul_kernel_keeps_extreme_values_finite_and_nan_as_nan(elementwise):
    gate = torch.tensor([[float("nan"), float("inf"), 100.0, -100.0, 88.5, -88.5, 1e-30, 0.0, 20.0, -20.0]])
    got = elementwise.silu_mul(gate, torch.ones_like(gate))
    assert torch.isnan(got[0, 0]) and got[0, 1] == float("inf")
    torch.testing.assert_close(got[:, 2:], torch.nn.functional.silu(gate[:, 2:]), rtol=1e-5, atol=1e-30)


def test_elementwise_kernels_refuse_what_they_would_misread(elementwise):
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="dtype, device or shape"):
        elementwise.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="dtype, device or shape"):
        elementwise.rms_norm(x, torch.ones(9), 1e-6)
    with pytest.raises(ValueError, match="dtype, device or shape"):
        elementwise.silu_mul(x, torch.randn(3, 9))
    with pytest.raises(ValueError, match="dtype, device or shape"):
        elementwise.silu_mul(x.requires_grad_(), torch.randn(3, 8))  # outside autograd only
    assert not Elementwise.takes(torch.randn(2, requires_grad=True))
    with torch.no_grad():
        assert Elementwise.takes(torch.randn(2, requires_grad=True))
