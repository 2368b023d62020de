"""CUDA C++ kernels compiled at run time (NVRTC) and launched through the driver API, by ctypes.

For the few kernels Triton cannot express well (ddtree/kernels/wgmma.py: wgmma tiles whose row count is not a
power of two). No build step and no new dependency: torch's CUDA wheels already ship libnvrtc, and the driver
(libcuda) is there wherever a GPU is. A kernel launches on torch's current stream, so CUDA graph capture
records it like any other, optionally as a programmatic dependent of the kernel before it (PDL).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import torch

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute
TENSOR_MAP_TYPES = {torch.bfloat16: 9, torch.float16: 6}  # CUtensorMapDataType
SWIZZLE_128B, L2_PROMOTION_256B = 3, 3


class TensorMap(ctypes.Structure):
    """CUtensorMap: the TMA descriptor of a global tensor, 128 opaque bytes passed to a kernel by value."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


class _LaunchAttributeValue(ctypes.Union):
    _fields_ = [("flag", ctypes.c_int), ("pad", ctypes.c_char * 64)]


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttributeValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


class CudaError(RuntimeError):
    """A driver or NVRTC call failed; the message names the call and the library's own error."""


_LIBS: dict[str, ctypes.CDLL] = {}


def _driver() -> ctypes.CDLL:
    """libcuda (the driver API, present wherever a GPU is), with the argument types of the calls used here."""
    if "cuda" not in _LIBS:
        lib = ctypes.CDLL("libcuda.so.1")
        p, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        for name, args in {
            "cuModuleLoadData": [p, p], "cuModuleGetFunction": [p, p, ctypes.c_char_p], "cuFuncSetAttribute": [p, i, i],
            "cuLaunchKernelEx": [ctypes.POINTER(_LaunchConfig), p, p, p], "cuGetErrorString": [i, p],
            "cuTensorMapEncodeTiled": [ctypes.POINTER(TensorMap), i, u, p, u64p, u64p, u32p, u32p, i, i, i, i],
        }.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
        _LIBS["cuda"] = lib
    return _LIBS["cuda"]


def _nvrtc() -> ctypes.CDLL:
    """libnvrtc: the one on the loader's path, else the one torch's CUDA wheels installed (nvidia/*/lib), else
    the toolkit's."""
    if "nvrtc" not in _LIBS:
        candidates = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
        for root in sys.path:
            candidates += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so.*")))
        candidates += sorted(glob.glob("/usr/local/cuda*/lib64/libnvrtc.so*"))
        for name in candidates:
            if "builtins" in name or ".alt." in name:
                continue
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            # NVRTC opens its builtins library by name at compile time: load the one beside it first
            for builtins in glob.glob(os.path.join(os.path.dirname(name), "libnvrtc-builtins.so.*")):
                if ".alt." not in builtins:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            break
        else:
            raise CudaError("libnvrtc not found (it comes with torch's CUDA wheels or the CUDA toolkit)")
        p, i = ctypes.c_void_p, ctypes.c_int
        for name, args in {
            "nvrtcCreateProgram": [p, ctypes.c_char_p, ctypes.c_char_p, i, p, p],
            "nvrtcCompileProgram": [p, i, ctypes.POINTER(ctypes.c_char_p)], "nvrtcDestroyProgram": [p],
            "nvrtcGetProgramLogSize": [p, p], "nvrtcGetProgramLog": [p, p], "nvrtcGetCUBINSize": [p, p],
            "nvrtcGetCUBIN": [p, p], "nvrtcGetErrorString": [i],
        }.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _LIBS["nvrtc"] = lib
    return _LIBS["nvrtc"]


def _check(result: int, call: str) -> None:
    if result != 0:
        message = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(message))
        raise CudaError(f"{call} failed: {(message.value or b'error %d' % result).decode()}")


def compile_cubin(source: str, name: str, options: list[str]) -> bytes:
    """The cubin NVRTC builds from `source` (needs no GPU); a compile error raises with the compiler's log."""
    lib = _nvrtc()
    program = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None):
        raise CudaError("nvrtcCreateProgram failed")
    try:
        encoded = [o.encode() for o in options]
        result = lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise CudaError(f"NVRTC could not compile {name} ({lib.nvrtcGetErrorString(result).decode()}):\n"
                            f"{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(program, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


class Kernel:
    """One `extern "C"` kernel of a cubin, loaded into the current device's context."""

    def __init__(self, cubin: bytes, name: str, shared_bytes: int) -> None:
        torch.cuda.init()
        self._image = ctypes.create_string_buffer(cubin, len(cubin))  # the driver reads it at load time only
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(_driver().cuModuleLoadData(ctypes.byref(module), self._image), "cuModuleLoadData")
        _check(_driver().cuModuleGetFunction(ctypes.byref(function), module, name.encode()), "cuModuleGetFunction")
        _check(_driver().cuFuncSetAttribute(function, MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
               "cuFuncSetAttribute")
        self.module, self.function, self.shared_bytes = module, function, shared_bytes

    def launch(self, grid: tuple[int, int, int], block: int, args: list[ctypes._SimpleCData | ctypes.Structure],
               dependent: bool) -> None:
        """Queue the kernel on torch's current stream; `dependent`: as a programmatic dependent of the kernel
        before it (the kernel itself must then execute griddepcontrol.wait before it touches shared data)."""
        attr = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=_LaunchAttributeValue(flag=1))
        config = _LaunchConfig(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(block, 1, 1),
                               shared=self.shared_bytes, stream=torch.cuda.current_stream().cuda_stream,
                               attrs=ctypes.pointer(attr), num_attrs=1 if dependent else 0)
        pointers = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        _check(_driver().cuLaunchKernelEx(ctypes.byref(config), self.function, pointers, None), "cuLaunchKernelEx")


def tma_compatible(matrix: torch.Tensor) -> bool:
    """Whether a TMA descriptor can describe this matrix: row-major, with a 16-byte aligned start and rows."""
    return (matrix.stride(1) == 1 and matrix.data_ptr() % 16 == 0
            and (matrix.stride(0) * matrix.element_size()) % 16 == 0)


def tensor_map(matrix: torch.Tensor, box_rows: int, box_cols: int) -> TensorMap:
    """The TMA descriptor of a row-major half-precision matrix, read in [box_rows, box_cols] tiles with the
    128-byte swizzle (box_cols * 2 = 128 bytes); reads past its rows or columns arrive as zeros."""
    rows, cols = matrix.shape
    if not tma_compatible(matrix):
        raise ValueError("a TMA descriptor needs a row-major matrix with 16-byte aligned rows")
    out = TensorMap()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(matrix.stride(0) * matrix.element_size())
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    _check(_driver().cuTensorMapEncodeTiled(ctypes.byref(out), TENSOR_MAP_TYPES[matrix.dtype], 2,
                                            ctypes.c_void_p(matrix.data_ptr()), dims, strides, box, unit, 0,
                                            SWIZZLE_128B, L2_PROMOTION_256B, 0), "cuTensorMapEncodeTiled")
    return out
