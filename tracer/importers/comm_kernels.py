"""Which GPU kernels of a Kineto trace are communication, and what they do: one table of the kernel
names NCCL and RCCL have used, old and new, each giving our op name and its kind (collective / p2p).

Names as the profiler records them (CUDA's demangled signature, sometimes with a leading `void `):

- NCCL >= 2.19: `ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)`,
  `ncclDevKernel_SendRecv(...)`; the op right after the prefix, then reduction, type, algorithm.
- NCCL 2.8 - 2.18 (and RCCL of that time): `ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, ...)`,
  `ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(...)`.
- NCCL <= 2.7: `ncclAllReduceRingLLKernel_sum_f32(ncclColl)`, `ncclSendRecvKernel_copy_i8(ncclWorkElem)`.
- RCCL >= 6: one generic kernel for every op, `ncclDevKernel_Generic(...)`, `ncclDevKernel_Generic_4(...)`,
  `ncclDevKernelDebug_Generic(...)`: communication, but the name does not say which op (kind `comm`).

Since NCCL 2.12 one launch can run several queued ops and the kernel is named after the first, so the
op is a hint; that the kernel is communication is certain. A name that starts like NCCL/RCCL but is in
no row of the table is still communication (op `unknown`): a future rename costs the op name, never
the recognition, unlike tools that match one prefix and silently find nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class KernelFamily:
    """A naming scheme: `pattern` matches the kernel name (after `void `) and captures the op token."""
    library: str
    pattern: re.Pattern[str]


FAMILIES: tuple[KernelFamily, ...] = (
    KernelFamily("RCCL generic", re.compile(r"^ncclDevKernel(?:Debug)?_(Generic)(?![A-Za-z])")),
    KernelFamily("NCCL >= 2.19", re.compile(r"^ncclDevKernel(?:Debug)?_([A-Za-z]+?)(?:_|\(|$)")),
    KernelFamily("NCCL 2.8-2.18 / RCCL", re.compile(r"^ncclKernel_([A-Za-z]+?)(?:_|\(|$)")),
    KernelFamily("NCCL <= 2.7", re.compile(
        r"^nccl([A-Za-z]+?)(?:Ring|Tree|CollNet)?(?:LL128|LL|Simple)?Kernel(?:_|\(|$)")),
)
"""Tried in order; the first match names the op."""

OPS: dict[str, tuple[str, str]] = {
    "allreduce": ("all_reduce", "collective"),
    "allgather": ("all_gather", "collective"),
    "reducescatter": ("reduce_scatter", "collective"),
    "broadcast": ("broadcast", "collective"),
    "reduce": ("reduce", "collective"),
    "alltoall": ("all_to_all", "collective"),
    "alltoallpivot": ("all_to_all", "collective"),
    "sendrecv": ("send_recv", "p2p"),
    "send": ("send", "p2p"),
    "recv": ("recv", "p2p"),
    "generic": ("unknown", "comm"),
}
"""Op token of the kernel name (lower case) -> (our op name, kind)."""

_LIBRARY_PREFIX = re.compile(r"^(?:nccl|rccl|msccl)", re.I)


@lru_cache(maxsize=4096)
def comm_kernel(name: str) -> tuple[str, str] | None:
    """(op, kind) of a communication kernel, None for every other kernel. kind is collective, p2p, or
    comm (a communication kernel whose name does not say which op)."""
    bare = name[5:] if name.startswith("void ") else name
    for family in FAMILIES:
        m = family.pattern.match(bare)
        if m:
            return OPS.get(m.group(1).lower(), ("unknown", "comm"))
    if _LIBRARY_PREFIX.match(bare):
        return ("unknown", "comm")
    return None
