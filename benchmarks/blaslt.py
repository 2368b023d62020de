"""cuBLASLt's matmul through its C API (ctypes), with the algorithm chosen by us rather than torch.

torch runs cuBLASLt's first heuristic. For a tree verify's 33-128 rows on Hopper that is an nvjet kernel,
which does not execute griddepcontrol.wait, so it cannot launch as a programmatic dependent in our graphs
(benchmarks/blas_pdl_probe.py). cuBLASLt offers other algorithms for the same product; this module lists
them (`Product.heuristics`, `Product.enumerated`) and runs any of them (`Product.run`), for
benchmarks/blas_lt_algos.py to look for one that waits.

y [M, N] = x [M, K] @ w [N, K]^T is, in cuBLAS's column-major terms, D [N, M] = op(A) B with A = w (K x N,
transposed) and B = x (K x M).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

import torch

COMPUTE_32F = 68  # cublasComputeType_t
SCALE_32F = 0  # cudaDataType_t CUDA_R_32F
DATA_TYPES = {torch.bfloat16: 14, torch.float16: 2}  # CUDA_R_16BF, CUDA_R_16F
DESC_TRANSA, DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
OP_N, OP_T = 0, 1
PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
CONFIG = {"id": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6}  # ..._ALGO_CONFIG_*
CAP_TILE_IDS, CAP_STAGES_IDS = 6, 13  # cublasLtMatmulAlgoCapAttributes_t: arrays of uint32
WORKSPACE_BYTES = 32 * 2**20


class Algo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: opaque, 64 bytes."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


_LIB: list[ctypes.CDLL] = []
_HANDLES: dict[int, ctypes.c_void_p] = {}
_WORKSPACES: dict[int, torch.Tensor] = {}


def library() -> ctypes.CDLL:
    """The libcublasLt torch itself loaded (same process, same version), found by its soname or in the maps."""
    if not _LIB:
        torch.cuda.init()
        lib = None
        for name in ("libcublasLt.so.13", "libcublasLt.so.12"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            with open("/proc/self/maps") as maps:
                paths = [line.split()[-1] for line in maps if "libcublasLt.so" in line]
            if not paths:
                raise RuntimeError("libcublasLt is not loaded in this process")
            lib = ctypes.CDLL(paths[0])
        _declare(lib)
        _LIB.append(lib)
    return _LIB[0]


def _declare(lib: ctypes.CDLL) -> None:
    """Argument types of the calls used here: ctypes would otherwise pass every Python int as a C int."""
    p, i, u64, i64, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [p],
        "cublasLtMatmulDescCreate": [p, i, i],
        "cublasLtMatmulDescSetAttribute": [p, i, p, size],
        "cublasLtMatrixLayoutCreate": [p, i, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [p],
        "cublasLtMatmulPreferenceSetAttribute": [p, i, p, size],
        "cublasLtMatmulPreferenceDestroy": [p],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i, p, p],
        "cublasLtMatmulAlgoGetIds": [p, i, i, i, i, i, i, i, p, p],
        "cublasLtMatmulAlgoInit": [p, i, i, i, i, i, i, i, p],
        "cublasLtMatmulAlgoCheck": [p, p, p, p, p, p, p, p],
        "cublasLtMatmulAlgoCapGetAttribute": [p, i, p, size, p],
        "cublasLtMatmulAlgoConfigSetAttribute": [p, i, p, size],
        "cublasLtMatmulAlgoConfigGetAttribute": [p, i, p, size, p],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, size, p],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int


def check(status: int, what: str) -> None:
    """A cuBLAS status as an exception."""
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed: status {status}")


def handle(device: torch.device) -> ctypes.c_void_p:
    """One cuBLASLt handle per device, and its workspace."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        h = ctypes.c_void_p()
        with torch.cuda.device(index):
            check(library().cublasLtCreate(ctypes.byref(h)), "create")
            _WORKSPACES[index] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
        _HANDLES[index] = h
    return _HANDLES[index]


def _int(value: int) -> ctypes.c_int32:
    return ctypes.c_int32(value)


@dataclass
class Described:
    """One algorithm for a product: cuBLASLt's config attributes, for reports."""

    algo: Algo
    workspace: int
    config: dict[str, int]


class Product:
    """The descriptors of y [rows, n] = x [rows, k] @ w [n, k]^T in one dtype, on one device."""

    def __init__(self, rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> None:
        lib = library()
        self.rows, self.n, self.k, self.dtype, self.device = rows, n, k, dtype, device
        self.handle = handle(device)
        self.desc = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, SCALE_32F), "desc")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            value = _int(op)
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4), "desc attribute")
        kind = DATA_TYPES[dtype]
        self.a, self.b, self.c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        for layout, (r, c, ld) in ((self.a, (k, n, k)), (self.b, (k, rows, k)), (self.c, (n, rows, n))):
            check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), kind, r, c, ld), "layout")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def heuristics(self, count: int = 64) -> list[Described]:
        """cuBLASLt's heuristic list, best first (torch runs the first)."""
        lib = library()
        pref = ctypes.c_void_p()
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(size), 8), "pref")
        results = (Heuristic * count)()
        found = ctypes.c_int()
        check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.c, self.c, pref, count,
                                                 results, ctypes.byref(found)), "heuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        return [self.described(results[i].algo, results[i].workspace) for i in range(found.value)
                if results[i].state == 0]

    def enumerated(self, limit: int = 400) -> list[Described]:
        """Every algorithm id with each of its tiles and stage counts (other options at their defaults) that
        cuBLASLt accepts for this product: a wider list than the heuristics'."""
        lib = library()
        ids = (ctypes.c_int * 256)()
        found = ctypes.c_int()
        kind = DATA_TYPES[self.dtype]
        check(lib.cublasLtMatmulAlgoGetIds(self.handle, COMPUTE_32F, SCALE_32F, kind, kind, kind, kind, 256, ids,
                                           ctypes.byref(found)), "ids")
        out: list[Described] = []
        for algo_id in ids[:found.value]:
            algo = Algo()
            if lib.cublasLtMatmulAlgoInit(self.handle, COMPUTE_32F, SCALE_32F, kind, kind, kind, kind, algo_id,
                                          ctypes.byref(algo)) != 0:
                continue
            for tile in self._caps(algo, CAP_TILE_IDS) or [0]:
                for stages in self._caps(algo, CAP_STAGES_IDS) or [0]:
                    trial = Algo.from_buffer_copy(algo)
                    for attr, value in (("tile", tile), ("stages", stages)):
                        v = ctypes.c_uint32(value)
                        lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(trial), CONFIG[attr], ctypes.byref(v), 4)
                    result = Heuristic()
                    if lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.a, self.b, self.c, self.c,
                                                   ctypes.byref(trial), ctypes.byref(result)) == 0 \
                            and result.workspace <= WORKSPACE_BYTES:
                        out.append(self.described(trial, result.workspace))
                        if len(out) >= limit:
                            return out
        return out

    def _caps(self, algo: Algo, attr: int) -> list[int]:
        """An algorithm's capability array (tile or stage ids)."""
        lib = library()
        size = ctypes.c_size_t()
        lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(size))
        values = (ctypes.c_uint32 * max(1, size.value // 4))()
        if size.value == 0 or lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, values, size.value,
                                                                     ctypes.byref(size)) != 0:
            return []
        return list(values[:size.value // 4])

    @staticmethod
    def described(algo: Algo, workspace: int) -> Described:
        """An algorithm with its config attributes read out."""
        config = {}
        for name, attr in CONFIG.items():
            value, written = ctypes.c_uint32(), ctypes.c_size_t()
            if library().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4,
                                                              ctypes.byref(written)) == 0:
                config[name] = value.value
        return Described(Algo.from_buffer_copy(algo), workspace, config)

    def run(self, x: torch.Tensor, w: torch.Tensor, algo: Described, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w^T with `algo`, on the current stream (so it captures into a graph)."""
        assert x.shape == (self.rows, self.k) and w.shape == (self.n, self.k) and x.is_contiguous()
        y = torch.empty((self.rows, self.n), dtype=self.dtype, device=x.device) if out is None else out
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        workspace = _WORKSPACES[index]
        stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        check(library().cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(y.data_ptr()), self.c,
            ctypes.c_void_p(y.data_ptr()), self.c, ctypes.byref(algo.algo), ctypes.c_void_p(workspace.data_ptr()),
            ctypes.c_size_t(WORKSPACE_BYTES), stream), "matmul")
        return y
