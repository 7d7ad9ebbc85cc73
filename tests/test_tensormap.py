"""The tensor maps of the bulk-copy tiles, on CPU: what reaches cuTensorMapEncodeTiled (faked here: libcuda needs a
GPU driver), the cache, and how k/v views become map dims. The maps themselves are exercised on the GPU
(tests/gpu/test_kernel_gpu.py: bulk-copy kernels bit-identical to their 16-byte-copy twins)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from fusednorm import codegen
from fusednorm.codegen import tensormap


@pytest.fixture
def fake_encoder(monkeypatch):
    """Records each call's arguments as plain values and fills the map with a byte that counts the calls."""
    calls = []
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)

    def encode(out, dtype, rank, address, dims, strides, box, elem_strides, interleave, swizzle, l2, oob):
        calls.append(dict(out=out, dtype=dtype, rank=rank, address=address, dims=[dims[i] for i in range(rank)],
                          strides=[strides[i] for i in range(rank - 1)], box=[box[i] for i in range(rank)],
                          elem_strides=[elem_strides[i] for i in range(rank)], swizzle=swizzle, oob=oob))
        ctypes.memset(out, len(calls), tensormap.MAP_BYTES)
        return 0

    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p,
                             u64p, u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)
    callback = proto(encode)
    monkeypatch.setattr(tensormap, "_encode_fn", callback)
    monkeypatch.setattr(tensormap, "_maps", {})
    return calls


def test_map_arguments_are_byte_strides_with_size_one_dims_made_contiguous(fake_encoder):
    B, H, Lk, d = 3, 4, 77, 64
    data = tensormap.tile_map(1 << 20, (d, Lk, 1, B), (1, H * d, 0, Lk * H * d), (64, 80, 1, 1))
    (call,) = fake_encoder
    assert call["out"] % 64 == 0, "a CUtensorMap must start on a 64-byte boundary"
    assert (call["rank"], call["address"], call["dims"], call["box"]) == (4, 1 << 20, [d, Lk, 1, B], [64, 80, 1, 1])
    # bytes; the broadcast head dim (size 1) gets the stride a contiguous tensor would have: never 0
    assert call["strides"] == [2 * H * d, 2 * H * d * Lk, 2 * Lk * H * d]
    assert call["elem_strides"] == [1, 1, 1, 1]
    assert (call["dtype"], call["swizzle"], call["oob"]) == (1, 3, 0)  # 16-bit words, 128-byte swizzle, zero fill
    assert data == bytes([1]) * tensormap.MAP_BYTES


def test_maps_are_cached_per_pointer_and_layout(fake_encoder):
    first = tensormap.tile_map(1 << 20, (64, 77, 4, 3), (1, 256, 64, 77 * 256), (64, 80, 1, 1))
    assert tensormap.tile_map(1 << 20, (64, 77, 4, 3), (1, 256, 64, 77 * 256), (64, 80, 1, 1)) is first
    tensormap.tile_map(2 << 20, (64, 77, 4, 3), (1, 256, 64, 77 * 256), (64, 80, 1, 1))  # moved
    tensormap.tile_map(1 << 20, (64, 77, 4, 3), (1, 256, 64, 77 * 256), (64, 128, 1, 1))  # another tile's box
    assert len(fake_encoder) == 3


def test_a_refused_map_raises_with_what_was_asked(monkeypatch):
    proto = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 12))
    monkeypatch.setattr(tensormap, "_encode_fn", proto(lambda *args: 1))
    monkeypatch.setattr(tensormap, "_maps", {})
    with pytest.raises(tensormap.TensorMapError, match=r"CUresult 1.*sizes \(64, 77\)"):
        tensormap.tile_map(1 << 20, (64, 77), (1, 64), (64, 80))


def test_kv_views_become_map_dims_innermost_first_with_broadcast_dims_of_size_one():
    k = torch.empty(2, 77, 4, 64).transpose(1, 2)  # [B, Lk, H, d] viewed as [B, H, Lk, d]
    assert codegen._kv_map_dims(k) == ((64, 77, 4, 2), (1, 256, 64, 77 * 256))
    one_head = torch.empty(2, 1, 77, 64).expand(2, 4, 77, 64)  # one key head for four query heads
    assert codegen._kv_map_dims(one_head) == ((64, 77, 1, 2), (1, 64, 0, 77 * 64))
    one_batch = torch.empty(1, 4, 77, 64).expand(3, 4, 77, 64)
    assert codegen._kv_map_dims(one_batch)[0] == (64, 77, 4, 1)
    for t in (k, one_head, one_batch):
        sizes, strides = codegen._kv_map_dims(t)
        assert tensormap.describable(1 << 20, sizes, strides)
    repeated_key = torch.empty(2, 4, 1, 64).expand(2, 4, 77, 64)  # key stride 0: no map describes it
    assert not tensormap.describable(1 << 20, *codegen._kv_map_dims(repeated_key))


def test_the_four_maps_of_a_call(fake_encoder):
    from fusednorm.codegen.spec import tile_for

    tile = tile_for("few_keys", 64, 90)
    x = torch.empty(2, 130, 256, dtype=torch.bfloat16)
    k = torch.empty(2, 77, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.empty(2, 77, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    y = torch.empty(2, 130, 264, dtype=torch.bfloat16)  # the plan's o: a ones column past the heads
    maps = codegen._tma_maps(tile, x, k, v, y)
    assert len(maps) == 4 * tensormap.MAP_BYTES == codegen._launch.MAPS_BYTES and len(fake_encoder) == 4
    x_call, k_call, _, y_call = fake_encoder
    assert (x_call["dims"], x_call["box"]) == ([256, 130, 2], [64, tile.block_m, 1])
    assert (k_call["dims"], k_call["box"]) == ([64, 77, 4, 2], [64, tile.kv_rows, 1, 1])
    assert (y_call["dims"], y_call["box"]) == ([264, 130, 2], [64, tile.rows_per_warp, 1])
    assert y_call["strides"] == [2 * 264, 2 * 264 * 130]
    k2 = k.clone()  # the same layout elsewhere: k's map is encoded again, the others come from tensormap's cache
    assert codegen._tma_maps(tile, x, k2, v, y) != maps and len(fake_encoder) == 5


def test_d40_maps_move_whole_unswizzled_head_rows(fake_encoder):
    """The d = 40 few-key tile (mma.sync, unpadded rows): boxes of the head's 40 columns, no swizzle."""
    from fusednorm.codegen.spec import tile_for

    tile = tile_for("few_keys", 40, 90)
    x = torch.empty(2, 130, 320, dtype=torch.bfloat16)
    k = torch.empty(2, 77, 8, 40, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.empty(2, 77, 8, 40, dtype=torch.bfloat16).transpose(1, 2)
    y = torch.empty_like(x)
    codegen._tma_maps(tile, x, k, v, y)
    x_call, k_call, v_call, y_call = fake_encoder
    assert (x_call["box"], k_call["box"], y_call["box"]) == ([40, 128, 1], [40, 80, 1, 1], [40, 16, 1])
    assert k_call["strides"] == [2 * 320, 2 * 40, 2 * 77 * 320]  # keys 640 bytes apart, heads 80
    assert {c["swizzle"] for c in fake_encoder} == {0}


def test_a_cached_call_finds_its_maps_by_pointers_and_encodes_only_what_moved(fake_encoder, monkeypatch):
    """launch_call keeps the maps on the call (its key fixes shapes, strides and tile): the same tensors again
    encode nothing, a k elsewhere encodes k's map alone, and every launch gets the maps of its own pointers."""
    from types import SimpleNamespace

    from fusednorm.codegen.spec import tile_for

    tile = tile_for("few_keys", 64, 90)
    assert tile.tma
    kernel = SimpleNamespace(spec=SimpleNamespace(tile=tile, key="fake_tma"), device_index=0)
    launched = []
    monkeypatch.setattr(codegen._launch, "launch", lambda kernel, grid, stream, pointers, tail, maps=b"":
                        launched.append((pointers, maps)))
    monkeypatch.setattr(codegen, "_raw_stream", lambda device_index: 1000)
    call = codegen.CallPlan(kernel, 4, False, (), 256)
    x = torch.empty(2, 130, 256, dtype=torch.bfloat16)
    k = torch.empty(2, 77, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    v = torch.empty(2, 77, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    y = torch.empty_like(x)  # every call's output lands here, as the caching allocator hands back a freed block
    monkeypatch.setattr(torch, "empty_like", lambda t, memory_format=None: y)
    codegen.launch_call(call, x, k, v, None, None, None)
    codegen.launch_call(call, x, k, v, None, None, None)
    assert len(fake_encoder) == 4 and launched[1][1] is launched[0][1]
    k2 = k.clone()
    codegen.launch_call(call, x, k2, v, None, None, None)
    assert len(fake_encoder) == 5 and launched[2][1] != launched[0][1] and len(call.maps) == 2
    for (pointers, maps), kk in zip(launched, (k, k, k2)):
        assert pointers[:4] == (x.data_ptr(), y.data_ptr(), kk.data_ptr(), v.data_ptr())
        assert maps == call.maps[(x.data_ptr(), kk.data_ptr(), v.data_ptr(), y.data_ptr())]
    assert codegen.CallPlan(kernel, 4, False, (), 256).maps == {}  # each cached call has its own
