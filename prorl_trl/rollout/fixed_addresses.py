"""Device memory that goes back to the driver between generations and comes back at the same virtual addresses.

Why (issue 14): the generation arena's buffers must be freed while training (training is the memory peak, and a
freed block kept in the caching allocator's default pool was split by training's tensors, so the step ran out of
memory under `compiled_generation`'s reserved memory), yet a CUDA graph replays at the addresses it captured. Freed to
the driver (`cudaFree`) and allocated again, the buffers came back elsewhere at every generation (benchmarks/results/
rollout_engine.md, commit 115e9bb:
a recapture per generation, 2.7 % of the rollout throughput at the GSM8K recipe's Initial shape). CUDA's virtual
memory management separates the two: an address range is reserved once (`cuMemAddressReserve`), physical memory is
created and mapped there at each allocation (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`) and unmapped and released
at each free (`cuMemUnmap`, `cuMemRelease`): the memory goes back, the addresses stay (vLLM's sleep mode does the same
from a C extension). Here the driver is called through ctypes, and the two functions are PyTorch's pluggable
allocator of the arena's `torch.cuda.MemPool` (`torch._C._cuda_customAllocator`), so the caching allocator keeps its
accounting: the memory counts in `memory_allocated` / `memory_reserved` and under `set_per_process_memory_fraction`.

Which address for which request (`AddressBook`): the arena asks for the same sizes in the same order at every
acquire, so a request takes the first reserved range of its size that is not mapped: the same ranges, every time.
Ranges stay reserved for the process (address space only, no memory).

The callbacks run inside the caching allocator, under its lock: they call the driver only (never torch), and never
raise (a failed allocation returns NULL, which the allocator reports as out of memory).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("prorl_trl")

_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_RECOMMENDED = 1  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
_ATTRIBUTE_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requested_handle_types", ctypes.c_int),
        ("location_type", ctypes.c_int),
        ("location_id", ctypes.c_int),
        ("win32_handle_meta_data", ctypes.c_void_p),
        ("compression_type", ctypes.c_ubyte),
        ("gpu_direct_rdma_capable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location_type", ctypes.c_int), ("location_id", ctypes.c_int), ("flags", ctypes.c_int)]


@dataclass
class AddressRange:
    """A reserved virtual address range; `handle` is the physical allocation mapped there (None: unmapped)."""

    address: int
    size: int
    handle: int | None = None


class AddressBook:
    """The reserved ranges of one device, in reservation order."""

    def __init__(self) -> None:
        self.ranges: list[AddressRange] = []

    def take(self, size: int) -> AddressRange | None:
        """The first unmapped range of exactly `size` bytes (None: reserve a new one)."""
        return next((r for r in self.ranges if r.size == size and r.handle is None), None)

    def add(self, address: int, size: int) -> AddressRange:
        self.ranges.append(AddressRange(address, size))
        return self.ranges[-1]

    def mapped_at(self, address: int) -> AddressRange | None:
        return next((r for r in self.ranges if r.address == address and r.handle is not None), None)


class _Driver:
    """The CUDA driver functions used here, through ctypes; each returns a CUresult (0: success)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        size, pointer, handle = ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64
        signatures = {
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
            "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
            "cuMemGetAllocationGranularity": [ctypes.POINTER(size), ctypes.POINTER(_AllocationProp), ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(pointer), size, size, pointer, ctypes.c_ulonglong],
            "cuMemCreate": [ctypes.POINTER(handle), size, ctypes.POINTER(_AllocationProp), ctypes.c_ulonglong],
            "cuMemMap": [pointer, size, size, handle, ctypes.c_ulonglong],
            "cuMemSetAccess": [pointer, size, ctypes.POINTER(_AccessDesc), size],
            "cuMemUnmap": [pointer, size],
            "cuMemRelease": [handle],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
            setattr(self, name, function)

    def device(self, ordinal: int) -> int:
        device = ctypes.c_int()
        self.check(self.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        return device.value

    def supports_vmm(self, ordinal: int) -> bool:
        value = ctypes.c_int()
        attribute = self.cuDeviceGetAttribute(ctypes.byref(value), _ATTRIBUTE_VMM_SUPPORTED, self.device(ordinal))
        return attribute == 0 and value.value == 1

    def ensure_context(self, ordinal: int) -> None:
        """The device's primary context current on this thread (the runtime's, which torch uses)."""
        current = ctypes.c_void_p()
        if self.cuCtxGetCurrent(ctypes.byref(current)) == 0 and current.value:
            return
        primary = ctypes.c_void_p()
        retained = self.cuDevicePrimaryCtxRetain(ctypes.byref(primary), self.device(ordinal))
        self.check(retained, "cuDevicePrimaryCtxRetain")
        self.check(self.cuCtxSetCurrent(primary), "cuCtxSetCurrent")

    @staticmethod
    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed: CUDA driver error {result}")


def _prop(device: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type, prop.location_type, prop.location_id = _PINNED, _LOCATION_DEVICE, device
    return prop


class FixedAddressAllocator:
    """The pluggable allocator: `malloc(size, device, stream)` maps fresh memory at a range of the device's
    `AddressBook`, `free(pointer, size, device, stream)` unmaps and releases it. One per process (`allocator`)."""

    def __init__(self) -> None:
        self.driver = _Driver()
        self.books: dict[int, AddressBook] = {}
        self._granularity: dict[int, int] = {}
        self._supported: dict[int, bool] = {}  # `supports`, asked of the driver once per device
        self._lock = threading.Lock()
        malloc_type = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
        free_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
        self._malloc = malloc_type(self.malloc)  # kept alive with the allocator: torch holds the raw pointers
        self._free = free_type(self.free)
        address = ctypes.cast(self._malloc, ctypes.c_void_p).value, ctypes.cast(self._free, ctypes.c_void_p).value
        self.torch_allocator = torch._C._cuda_customAllocator(*address)

    def supports(self, device: int) -> bool:
        if device not in self._supported:
            self._supported[device] = self.driver.supports_vmm(device)
        return self._supported[device]

    def granularity(self, device: int) -> int:
        if device not in self._granularity:
            value, prop = ctypes.c_size_t(), _prop(self.driver.device(device))
            found = self.driver.cuMemGetAllocationGranularity(ctypes.byref(value), ctypes.byref(prop),
                                                              _GRANULARITY_RECOMMENDED)  # fmt: skip
            self.driver.check(found, "cuMemGetAllocationGranularity")
            self._granularity[device] = value.value
        return self._granularity[device]

    def malloc(self, size: int, device: int, stream: Any) -> int | None:
        try:
            with self._lock:
                return self._map(size, device)
        except Exception:  # inside the allocator: report, then out of memory
            logger.exception("fixed-address allocation of %d bytes on device %d failed", size, device)
            return None

    def free(self, pointer: int | None, size: int, device: int, stream: Any) -> None:
        try:
            with self._lock:
                self._unmap(pointer or 0, device)
        except Exception:  # inside the allocator: report; the memory stays mapped
            logger.exception("fixed-address free at %#x on device %d failed", pointer or 0, device)

    def _map(self, size: int, device: int) -> int | None:
        driver = self.driver
        driver.ensure_context(device)
        step = self.granularity(device)
        size = -(-size // step) * step
        book = self.books.setdefault(device, AddressBook())
        target = book.take(size)
        if target is None:
            address = ctypes.c_uint64()
            driver.check(driver.cuMemAddressReserve(ctypes.byref(address), size, step, 0, 0), "cuMemAddressReserve")
            target = book.add(address.value, size)
        handle, prop = ctypes.c_uint64(), _prop(driver.device(device))
        if driver.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0) != 0:
            return None  # out of device memory: the caching allocator frees its cache or raises
        try:
            driver.check(driver.cuMemMap(target.address, size, 0, handle.value, 0), "cuMemMap")
            access = _AccessDesc(_LOCATION_DEVICE, prop.location_id, _READ_WRITE)
            result = driver.cuMemSetAccess(target.address, size, ctypes.byref(access), 1)
            if result != 0:
                driver.cuMemUnmap(target.address, size)
                driver.check(result, "cuMemSetAccess")
        except Exception:
            driver.cuMemRelease(handle.value)
            raise
        target.handle = handle.value
        return target.address

    def _unmap(self, pointer: int, device: int) -> None:
        target = self.books.get(device, AddressBook()).mapped_at(pointer)
        if target is None:
            raise RuntimeError(f"{pointer:#x} is no mapped range of this allocator")
        self.driver.ensure_context(device)
        self.driver.check(self.driver.cuMemUnmap(target.address, target.size), "cuMemUnmap")
        self.driver.check(self.driver.cuMemRelease(target.handle), "cuMemRelease")
        target.handle = None


_ALLOCATOR: list[FixedAddressAllocator | None] = []  # made once per process (torch keeps its function pointers)


def allocator(device: torch.device) -> FixedAddressAllocator | None:
    """The process's fixed-address allocator, if `device` (CUDA) supports virtual memory management and this torch
    takes pluggable allocators; None otherwise (the arena then uses a plain private pool: addresses may move)."""
    if not _ALLOCATOR:
        made = None
        if hasattr(torch._C, "_cuda_customAllocator"):
            try:
                made = FixedAddressAllocator()
            except (OSError, AttributeError, RuntimeError) as error:
                logger.info("Fixed-address generation buffers unavailable (%s).", error)
        _ALLOCATOR.append(made)
    made = _ALLOCATOR[0]
    if made is None or device.type != "cuda":
        return None
    try:
        return made if made.supports(device.index or 0) else None
    except RuntimeError:
        return None
