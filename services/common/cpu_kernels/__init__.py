"""C kernels for the CPU, built on first use with the machine's C compiler and loaded with ``ctypes``.

PyTorch has no paged attention for the CPU: attending each decode row on its
own took a dozen small ops per request and layer, about half of a decode
step at 32 streams (bench model). ``paged_decode.c`` attends every decode
row of a step in one call per layer, reading K/V in place through the block
tables, spread over the OpenMP threads PyTorch itself uses, and writes the
rows' new keys and values on the way.

``linear.c`` runs the linear layers over weights packed once for it: at the
row counts of decode steps the matmuls PyTorch offers (MKL, oneDNN) read the
weights at half the memory bandwidth or less (see its header).

``elementwise.c`` runs a decoder layer's row-wise ops, RMSNorm and an MLP's
SiLU-and-multiply, each in one pass where PyTorch makes seven ops and two.

Each source builds the same way. The build needs a C compiler with OpenMP
(``$CC``, else ``cc``); it runs once per machine and source version, into
``$EPD_CACHE_DIR/kernels`` (a private temporary file, renamed into place, so
concurrent builders never see half a library), with ``-march=native``: the
cache key includes the CPU's feature flags. A missing compiler, a failed
build or a failed self-check leaves the kernel out (``load_paged_decode`` /
``load_linear`` return None, with one warning saying why) and the runner
falls back to its PyTorch path.

Imports nothing from the engine or the service shell.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast

import torch

from services.common.models.cache import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
LINEAR_SOURCE = Path(__file__).with_name("linear.c")
PAGED_DECODE_ABI = 2  # epd_paged_decode_abi(): bumped with its C signature
LINEAR_ABI = 1  # epd_linear_abi(): bumped with its C signature
MAX_GROUP = 64  # query heads per KV head the kernel takes (EPD_MAX_GROUP in the source)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 120.0

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why in one line."""


def _compiler() -> str:
    found = shutil.which(os.environ.get("CC") or "cc")
    if found is None:
        raise KernelUnavailable("no C compiler found (set CC, or install gcc)")
    return found


def _cpu_flags() -> str:
    """The CPU's feature flags (what ``-march=native`` compiles for), or the machine name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def library_path(compiler: str, source: Path | None = None) -> Path:
    """Where the library for ``source`` (default: the paged decode kernel), compiler and CPU lives in the cache."""
    source = source or SOURCE
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [source.read_text(), version, " ".join(FLAGS), _cpu_flags()]  # the source carries its ABI version
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"{source.stem}-{key}.so"


def build(compiler: str, target: Path, source: Path | None = None) -> Path:
    """Compiles ``source`` (default: the paged decode kernel) into ``target`` (atomically);
    KernelUnavailable with the compiler's first line."""
    source = source or SOURCE
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, "-o", staging, str(source), "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise KernelUnavailable(f"{Path(compiler).name} failed to build {source.name}: {first[:200]}")
        os.replace(staging, target)
    except subprocess.TimeoutExpired:
        raise KernelUnavailable(f"building {source.name} took over {BUILD_TIMEOUT_S:.0f} s") from None
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def _library(path: Path, abi_function: str, abi: int) -> ctypes.CDLL:
    """The library at ``path`` (CDLL: the GIL is released for its calls), refused if its ABI is another."""
    library = ctypes.CDLL(str(path))
    if getattr(library, abi_function)() != abi:
        raise KernelUnavailable(f"{path.name} has another ABI version")
    return library


def _bind(library: ctypes.CDLL, name: str, argtypes: list) -> Callable[..., None]:
    """``library``'s function ``name``, returning nothing, with ``argtypes``."""
    function = getattr(library, name)
    function.restype = None
    function.argtypes = argtypes
    return cast(Callable[..., None], function)


class PagedDecode:
    """``paged_decode.c`` loaded: one call attends every decode row of a step for one layer."""

    def __init__(self, path: Path) -> None:
        library = _library(path, "epd_paged_decode_abi", PAGED_DECODE_ABI)
        self._fn = _bind(library, "epd_paged_decode_f32", [
            _PTR, _I64, _I64,  # q, row stride, head stride
            _PTR, _I64, _I64,  # new keys (or NULL), row stride, head stride
            _PTR, _I64, _I64,  # new values (or NULL), row stride, head stride
            _PTR, _PTR, _I64,  # k, v caches of one layer, kv head stride
            _PTR, _I64, _PTR,  # block tables, table stride, context lengths
            _PTR, _I64, _I64,  # out, row stride, head stride
            _I64, _I64, _I64, _I64, _I64,  # rows, heads, kv heads, head dim, block size
            _I64, ctypes.c_float, ctypes.c_int,  # max context, scale, threads
        ])  # fmt: skip

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context: int,
        scale: float,
        out: torch.Tensor,
        new_keys: torch.Tensor | None = None,
        new_values: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query [rows, H, D]`` over one layer's ``[KVH, blocks, block_size, D]`` caches into
        ``out [rows, H, D]``; ``block_tables [rows, W]`` and ``context_lens [rows]`` int32.

        With ``new_keys`` and ``new_values`` (``[rows, KVH, D]`` each), each row's are first
        written into the caches at its last position (``context_lens - 1``), which the row
        then attends.

        float32 CPU tensors whose last dim is contiguous; checked here, since a
        wrong stride or dtype would read (or write) out of bounds in C."""
        rows, num_heads, head_dim = query.shape
        num_kv_heads, _, block_size, _ = key_cache.shape
        writes = new_keys is not None or new_values is not None
        if not (
            query.dtype == key_cache.dtype == value_cache.dtype == out.dtype == torch.float32
            and block_tables.dtype == context_lens.dtype == torch.int32
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and block_tables.stride(1) == 1
            and context_lens.is_contiguous()
            and query.stride(2) == 1
            and out.stride(2) == 1
            and out.shape == query.shape
            and value_cache.shape == key_cache.shape
            and key_cache.shape[3] == head_dim
            and block_tables.shape[0] == context_lens.shape[0] == rows
            and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP
        ) or (writes and not _fits_new_rows(new_keys, new_values, (rows, num_kv_heads, head_dim))):
            raise ValueError("paged decode kernel: tensors of another dtype, shape or layout")
        new: tuple[int | None, int, int, int | None, int, int] = (None, 0, 0, None, 0, 0)
        if new_keys is not None and new_values is not None:  # both or neither: _fits_new_rows checked
            new = (
                new_keys.data_ptr(), new_keys.stride(0), new_keys.stride(1),
                new_values.data_ptr(), new_values.stride(0), new_values.stride(1),
            )  # fmt: skip
        self._fn(
            query.data_ptr(), query.stride(0), query.stride(1),
            *new,
            key_cache.data_ptr(), value_cache.data_ptr(), key_cache.stride(0),
            block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
            out.data_ptr(), out.stride(0), out.stride(1),
            rows, num_heads, num_kv_heads, head_dim, block_size,
            max_context, scale, torch.get_num_threads(),
        )  # fmt: skip
        return out


def _fits_new_rows(keys: torch.Tensor | None, values: torch.Tensor | None, shape: tuple[int, int, int]) -> bool:
    """Both given, float32 CPU tensors of ``shape`` with contiguous last dims."""
    return (
        keys is not None
        and values is not None
        and keys.dtype == values.dtype == torch.float32
        and keys.device.type == values.device.type == "cpu"
        and tuple(keys.shape) == tuple(values.shape) == shape
        and keys.stride(2) == values.stride(2) == 1
    )


def self_check(kernel: PagedDecode) -> None:
    """Compares the kernel with PyTorch's attention on a small random batch (GQA, scattered blocks)."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, heads, head_dim, block_size, blocks = 2, 4, 16, 4, 12
    keys = torch.randn(kv_heads, blocks, block_size, head_dim, generator=generator)
    values = torch.randn(kv_heads, blocks, block_size, head_dim, generator=generator)
    tables = torch.tensor([[7, 2, 9], [0, 11, 3]], dtype=torch.int32)
    lens = torch.tensor([10, 5], dtype=torch.int32)
    query = torch.randn(2, heads, head_dim, generator=generator)
    got = kernel(query, keys, values, tables, lens, 10, head_dim**-0.5, torch.empty_like(query))
    for row in range(2):
        n = int(lens[row])
        k = keys[:, tables[row].long()].reshape(kv_heads, -1, head_dim)[:, :n]
        v = values[:, tables[row].long()].reshape(kv_heads, -1, head_dim)[:, :n]
        want = torch.nn.functional.scaled_dot_product_attention(
            query[row][:, None], k, v, enable_gqa=True
        )[:, 0]  # fmt: skip
        if not torch.allclose(got[row], want, rtol=1e-4, atol=1e-5):
            raise KernelUnavailable("the built kernel disagrees with PyTorch's attention")


def _built(source: Path, what: str) -> Path:
    """The library of ``source`` in the cache, built first where it is not there yet."""
    compiler = _compiler()
    path = library_path(compiler, source)
    if not path.is_file():
        log.info("building the CPU %s kernel with %s (once per machine)", what, Path(compiler).name)
        build(compiler, path, source)
    return path


K = TypeVar("K")


def _load(source: Path, what: str, make: Callable[[Path], K], check: Callable[[K], None], fallback: str) -> K | None:
    """``source``'s kernel, built if needed, loaded by ``make`` and passed through ``check``; None
    (with one warning: why, and ``fallback``, what runs instead) where any of that fails."""
    try:
        kernel = make(_built(source, what))
        check(kernel)
        return kernel
    except (KernelUnavailable, OSError, subprocess.SubprocessError) as error:
        log.warning("CPU %s kernel unavailable, %s: %s", what, fallback, error)
        return None


@functools.cache
def load_paged_decode() -> PagedDecode | None:
    """The paged decode kernel, built if needed and self-checked; None (logged once) where it is unavailable."""
    return _load(SOURCE, "paged decode", PagedDecode, self_check, "decode attention stays in PyTorch")


class LinearKernel:
    """``linear.c`` loaded: ``pack`` a weight once, then ``linear`` any number of rows through it."""

    def __init__(self, path: Path) -> None:
        library = _library(path, "epd_linear_abi", LINEAR_ABI)
        self.panel = int(library.epd_linear_panel())
        self._fn = _bind(library, "epd_linear_f32", [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, ctypes.c_int])

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight [N, K]`` float32 as the kernel reads it: ``[ceil(N / panel), K, panel]``, columns past N zero."""
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError("linear kernel: the weight must be a 2-D float32 CPU tensor")
        out_features, in_features = weight.shape
        padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -out_features % self.panel))
        return padded.view(-1, self.panel, in_features).transpose(1, 2).contiguous()

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x [..., K] @ W.T + bias`` for the ``W [out_features, K]`` that ``pack`` turned into ``packed``.

        Inference only: the call is outside autograd, so with gradients
        enabled an input that needs one is refused. Shapes and dtypes are
        checked here, since a wrong one would read out of bounds in C."""
        in_features = x.shape[-1]
        panels = -(-out_features // self.panel)
        if (
            x.dtype != torch.float32
            or x.device.type != "cpu"
            or packed.dtype != torch.float32
            or packed.shape != (panels, in_features, self.panel)
            or not packed.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (out_features,)))
        ):
            raise ValueError("linear kernel: tensors of another dtype, shape or layout")
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            raise RuntimeError("linear kernel: inference only (run it under torch.no_grad or inference_mode)")
        flat = x.reshape(-1, in_features).contiguous()
        bias = bias.contiguous() if bias is not None else None
        out = torch.empty(flat.shape[0], out_features, dtype=torch.float32)
        if flat.shape[0]:
            self._fn(
                flat.data_ptr(), flat.shape[0], in_features, packed.data_ptr(), out_features,
                bias.data_ptr() if bias is not None else None, out.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
        return out.reshape(*x.shape[:-1], out_features)


def self_check_linear(kernel: LinearKernel) -> None:
    """Compares the kernel with ``F.linear``: odd sizes, a partial last panel, more rows than one pass, a bias."""
    generator = torch.Generator().manual_seed(0)
    for rows, in_features, out_features, with_bias in ((1, 70, 40, True), (7, 300, 16, False), (300, 33, 17, True)):
        x = torch.randn(rows, in_features, generator=generator)
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator) if with_bias else None
        got = kernel.linear(x, kernel.pack(weight), out_features, bias)
        if not torch.allclose(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-4, atol=1e-4):
            raise KernelUnavailable("the built linear kernel disagrees with PyTorch's linear")


@functools.cache
def load_linear() -> LinearKernel | None:
    """The linear kernel, built if needed and self-checked; None (logged once) where it is unavailable."""
    return _load(LINEAR_SOURCE, "linear", LinearKernel, self_check_linear, "linear layers stay with oneDNN or torch")


# At the end: elementwise.py builds on the loading helpers above.
from services.common.cpu_kernels.elementwise import Elementwise, load_elementwise  # noqa: E402

__all__ = [
    "Elementwise",
    "KernelUnavailable",
    "LinearKernel",
    "PagedDecode",
    "load_elementwise",
    "load_linear",
    "load_paged_decode",
]
