"""Tensor maps for the kernels whose stages are filled by bulk tensor copies (``TileConfig.tma``, sm_90).

A tensor map (CUtensorMap, 128 opaque bytes) tells the copy engine where a strided tensor lies and which box one
copy moves: here boxes of 64 columns (128 bytes, the widest the 128-byte swizzle takes) by the tile's rows, landing
in shared memory in the swizzled layout the warpgroup mma reads, or (``swizzle=False``, the mma.sync tiles of
d = 40) boxes of a whole head row landing unpadded, row after row. Maps are encoded on the host by libcuda's
``cuTensorMapEncodeTiled`` (called through ctypes: the cuda-python binding costs tens of µs a call) and kept per
(pointer, sizes, strides, box), so a call whose tensors sit where the last one's did encodes nothing.
"""
from __future__ import annotations

import ctypes

MAP_BYTES = 128
_SWIZZLE_NONE, _SWIZZLE_128B = 0, 3
_L2_PROMOTION_128B = 2
_UINT16 = 1  # bf16 and fp16 move as 16-bit words; rows past the tensor arrive as zero bits (+0.0 in both)


class TensorMapError(RuntimeError):
    """libcuda refused a tensor map. Callers copy what ``describable`` rejects beforehand, so this names the map
    asked for rather than falling back."""


_encode_fn = None
_maps: dict[tuple, bytes] = {}
_MAPS_MAX = 4096  # a model meets a few tensors per block; the bound only stops unbounded growth


def _encoder():
    global _encode_fn
    if _encode_fn is None:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _encode_fn = fn
    return _encode_fn


def describable(pointer: int, sizes: tuple, strides: tuple) -> bool:
    """Whether a tensor of 16-bit elements with these sizes and element strides (innermost first, innermost
    stride 1) can have a tensor map: a 16-byte-aligned base and every outer stride a positive multiple of 16 bytes
    below 2^40 (dims of size 1 excepted: their stride is never used, see ``tile_map``)."""
    if pointer % 16 != 0 or strides[0] != 1:
        return False
    return all(n == 1 or (s > 0 and (2 * s) % 16 == 0 and 2 * s < 1 << 40) for n, s in zip(sizes[1:], strides[1:]))


def tile_map(pointer: int, sizes: tuple, strides: tuple, box: tuple, swizzle: bool = True) -> bytes:
    """The 128 bytes of a tensor map over 16-bit elements: ``sizes`` and ``strides`` (in elements) innermost
    first, ``box`` the elements one copy moves along each dim, landing in the 128-byte swizzle (``swizzle``) or
    unpadded. Raises TensorMapError where libcuda refuses."""
    key = (pointer, sizes, strides, box, swizzle)
    hit = _maps.get(key)
    if hit is not None:
        return hit
    rank = len(sizes)
    # a dim of size 1 is never stepped along: give it the stride a contiguous tensor would have (always valid)
    outer = []
    extent = 2 * sizes[0]
    for n, s in zip(sizes[1:], strides[1:]):
        outer.append(extent if n == 1 else 2 * s)
        extent = outer[-1] * n
    buf = ctypes.create_string_buffer(MAP_BYTES + 64)  # the map must start on a 64-byte boundary
    at = (ctypes.addressof(buf) + 63) // 64 * 64
    err = _encoder()(
        ctypes.c_void_p(at), _UINT16, rank, ctypes.c_void_p(pointer),
        (ctypes.c_uint64 * rank)(*sizes), (ctypes.c_uint64 * max(rank - 1, 1))(*outer),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        0, _SWIZZLE_128B if swizzle else _SWIZZLE_NONE, _L2_PROMOTION_128B, 0)
    if err != 0:
        raise TensorMapError(f"fusednorm: cuTensorMapEncodeTiled failed (CUresult {err}) for sizes {sizes}, "
                             f"strides {strides}, box {box}, swizzle {swizzle}")
    data = ctypes.string_at(at, MAP_BYTES)
    if len(_maps) >= _MAPS_MAX:
        _maps.clear()
    _maps[key] = data
    return data
