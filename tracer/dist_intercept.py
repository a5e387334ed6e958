"""Trace the torch.distributed collectives and p2p calls of code megascope did not write (FSDP2,
torchtitan, torch.distributed.pipelining, a user's own all_reduce), without wrappers at the call site.

`DistInterceptor.install()` replaces these functions in `torch.distributed` and in
`torch.distributed.distributed_c10d` (where torch's own helpers look them up) with traced versions;
`uninstall()` puts the originals back:

    all_reduce, broadcast, reduce_scatter_tensor, reduce_scatter_single, all_gather_into_tensor,
    all_gather_single, all_to_all_single, send, recv, isend, irecv, batch_isend_irecv

(FSDP2 in torch 2.13 calls all_gather_single and reduce_scatter_single.) Each call is recorded as
the comm layer records its own ops (tracer/comm_spans.py: issue, start, end, async completion, the
`.wait` span), with the group named by matching the process group's ranks to the layout's dp, tp,
pp, cp or world group (p2p: the group the two ranks share), a seq per group name, the peer's global
rank and the bytes (NCCL-tests convention, as comm.py). Async calls return a `torch.distributed.Work`
subclass, so code that checks `isinstance(work, dist.Work)` (FSDP2 does) still waits on it.

Not traced: calls issued while no tracer is active; calls made from megascope's own comm layer and
clock sync (traced there, or not training traffic); nested calls (torch's batch_isend_irecv calling
isend: the batch is recorded once); calls through references bound before install
(`from torch.distributed import all_reduce` at import time); and anything issued below Python
(DDP's reducer: see ddp_hook.py; functional collectives of DTensor/tensor parallel,
torch.ops._c10d_functional).
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed import ProcessGroup

from megascope.tracer import api, comm_spans
from megascope.tracer.attach_topology import AttachLayout

log = logging.getLogger("megascope.tracer")
_monotonic_ns = time.monotonic_ns

# name in torch -> (name recorded, the tensor whose bytes count)
COLLECTIVES = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_to_all_single": ("all_to_all", "input"),
}
P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
INTERCEPTED = (*COLLECTIVES, *P2P, "batch_isend_irecv")
_NAMESPACES = (dist, c10d)
_UNTRACED_CALLERS = frozenset({"megascope.tracer.comm", "megascope.tracer.clock_sync",
                               "megascope.tracer.ddp_hook"})
"""Modules whose calls pass straight through: megascope's comm wrappers trace their own ops, clock
sync is megascope's traffic, the DDP hook records its bucket all-reduce itself."""


class _State(threading.local):
    busy = False
    """This thread is inside a traced call: nested intercepted calls pass straight through."""


_state = _State()


class TracedFunction:
    """Stands in for a torch.distributed function. Compares and hashes equal to the original, so
    torch's checks (`op in [isend, irecv]`, `{p.op for p in ops} == {dist.isend}`) accept either."""

    def __init__(self, original: Callable, handler: Callable) -> None:
        self.__wrapped__ = original
        self._handler = handler
        self.__name__ = original.__name__
        self.__qualname__ = getattr(original, "__qualname__", original.__name__)
        self.__doc__ = original.__doc__
        self.__module__ = original.__module__
        self.__signature__ = inspect.signature(original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if api._active is None or _state.busy:
            return self.__wrapped__(*args, **kwargs)
        _state.busy = True  # also for untraced callers: comm.batch_isend_irecv's inner isend calls pass
        try:
            if sys._getframe(1).f_globals.get("__name__") in _UNTRACED_CALLERS:
                return self.__wrapped__(*args, **kwargs)
            return self._handler(self.__wrapped__, args, kwargs)
        finally:
            _state.busy = False

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__wrapped__ or (
            isinstance(other, TracedFunction) and other.__wrapped__ is self.__wrapped__)

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __repr__(self) -> str:
        return f"<megascope-traced {self.__name__}>"


class TracedDistWork(dist.Work):
    """A comm_spans.TracedWork that is also a torch.distributed.Work."""

    def __init__(self, traced: Any) -> None:
        super().__init__()
        self._traced = traced

    def wait(self, timeout: Any = None) -> bool:
        return self._traced.wait() if timeout is None else self._traced.wait(timeout)

    def is_completed(self) -> bool:
        return self._traced.is_completed()

    def is_success(self) -> bool:
        return self._traced.is_success()

    def exception(self) -> Any:
        return self._traced.exception()

    def source_rank(self) -> int:
        return self._traced.source_rank()

    def result(self) -> Any:
        return self._traced.result()

    def synchronize(self) -> None:
        self._traced.synchronize()

    def get_future(self) -> Any:
        return self._traced.get_future()


def _as_work(result: Any) -> Any:
    return TracedDistWork(result) if isinstance(result, comm_spans.TracedWork) else result


def _binder(original: Callable) -> Callable[[tuple, dict, str, Any], Any]:
    """get(args, kwargs, name, default): an argument by name, positional or keyword."""
    index = {name: i for i, name in enumerate(inspect.signature(original).parameters)}

    def get(args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
        i = index[name]
        if i < len(args):
            return args[i]
        return kwargs.get(name, default)

    return get


class DistInterceptor:
    """Traces the INTERCEPTED functions while installed; group names from `layout`."""

    def __init__(self, layout: AttachLayout, rank: int) -> None:
        self.layout, self.rank = layout, rank
        self._groups: dict[int, tuple[ProcessGroup | None, str, list[int]]] = {}
        self._saved: list[tuple[Any, str, Any]] = []
        self.installed = False

    # -- install / uninstall -------------------------------------------------------------------
    def install(self) -> None:
        if self.installed:
            return
        for fname in INTERCEPTED:
            found = getattr(c10d, fname, None)
            if found is None:  # an older torch without this function
                continue
            original: Callable = found.__wrapped__ if isinstance(found, TracedFunction) else found
            traced = TracedFunction(original, self._handler_for(fname, original))
            for module in _NAMESPACES:
                current = getattr(module, fname, None)
                if current is original:
                    self._saved.append((module, fname, current))
                    setattr(module, fname, traced)
        self.installed = True

    def uninstall(self) -> None:
        """Put the originals back, unless someone replaced our function meanwhile (left as it is)."""
        for module, fname, original in reversed(self._saved):
            current = getattr(module, fname, None)
            if isinstance(current, TracedFunction) and current.__wrapped__ is original:
                setattr(module, fname, original)
            else:
                log.warning("tracer: torch.distributed.%s was replaced while traced; left as it is", fname)
        self._saved.clear()
        self.installed = False

    def _handler_for(self, fname: str, original: Callable) -> Callable:
        get = _binder(original)
        if fname in COLLECTIVES:
            name, tensor_arg = COLLECTIVES[fname]
            return lambda orig, args, kwargs: self._collective(orig, args, kwargs, get, name, tensor_arg)
        if fname in P2P:
            direction, is_async = P2P[fname], fname.startswith("i")
            return lambda orig, args, kwargs: self._p2p(orig, args, kwargs, get, direction, is_async)
        return self._batch

    # -- groups --------------------------------------------------------------------------------
    def group_info(self, group: ProcessGroup | None) -> tuple[ProcessGroup | None, str, list[int]]:
        """(process group, layout name or "", member global ranks), cached per group object."""
        group = group if group is not None else dist.group.WORLD
        hit = self._groups.get(id(group))
        if hit is not None and hit[0] is group:
            return hit
        members = [int(r) for r in dist.get_process_group_ranks(group)]
        info = (group, self.layout.group_name(members), members)
        self._groups[id(group)] = info  # holds the group: its id cannot be reused while cached
        return info

    # -- handlers ------------------------------------------------------------------------------
    def _collective(self, original: Callable, args: tuple, kwargs: dict, get: Callable, name: str,
                    tensor_arg: str) -> Any:
        tracer = api._active
        if tracer is None:  # deactivated while installed: nothing to report to
            return original(*args, **kwargs)
        issue_ns = _monotonic_ns() + tracer.clock.shift_ns  # first thing: when the op was asked for
        async_op = bool(get(args, kwargs, "async_op", False))
        op = tensor = None
        try:
            group, gname, members = self.group_info(get(args, kwargs, "group"))
            if len(members) > 1:
                tensor = get(args, kwargs, tensor_arg)
                op = tracer.begin_comm(name, "collective", gname, group, gname or ("pg", id(group)), -1,
                                       comm_spans.tensor_bytes(tensor), members, tensor.is_cuda, issue_ns)
        except Exception as exc:
            tracer._failed(f"intercepting {name}", exc)
        return _run_traced(op, original, args, kwargs, async_op, tensor)

    def _peer(self, args: tuple, kwargs: dict, get: Callable, direction: str, group: ProcessGroup | None) -> int:
        """The partner's global rank (dst/src, or group_dst/group_src translated); -1 for any source."""
        key = "dst" if direction == "send" else "src"
        peer = get(args, kwargs, key)
        if peer is None:
            group_peer = get(args, kwargs, "group_" + key)
            if group_peer is None:
                return -1
            # no group: the world group, whose group ranks are global ranks
            peer = group_peer if group is None else dist.get_global_rank(group, group_peer)
        return int(peer)

    def _begin_p2p(self, tracer: Any, direction: str, tensor: torch.Tensor, peer: int, group: ProcessGroup | None,
                   issue_ns: int) -> Any:
        gname = self.layout.p2p_group(self.rank, peer)
        seq_key = (gname or ("pg", id(group)), direction, peer)
        return tracer.begin_comm(direction, "p2p", gname, group, seq_key, peer, comm_spans.tensor_bytes(tensor),
                                 None, tensor.is_cuda, issue_ns)

    def _p2p(self, original: Callable, args: tuple, kwargs: dict, get: Callable, direction: str,
             is_async: bool) -> Any:
        tracer = api._active
        if tracer is None:  # deactivated while installed: nothing to report to
            return original(*args, **kwargs)
        issue_ns = _monotonic_ns() + tracer.clock.shift_ns
        op = tensor = None
        try:
            tensor, group = get(args, kwargs, "tensor"), get(args, kwargs, "group")
            op = self._begin_p2p(tracer, direction, tensor, self._peer(args, kwargs, get, direction, group),
                                 group, issue_ns)
        except Exception as exc:
            tracer._failed(f"intercepting {direction}", exc)
        # gloo p2p works report no completion before wait(): wait() ends them (as comm.py)
        return _run_traced(op, original, args, kwargs, is_async, tensor, has_completion=False)

    def _batch(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        ops: list[Any] = args[0] if args else kwargs.get("p2p_op_list", [])
        tracer = api._active
        if tracer is None:  # deactivated while installed: nothing to report to
            return original(*args, **kwargs)
        issue_ns = _monotonic_ns() + tracer.clock.shift_ns
        traced: list[Any] = []
        try:
            for p2p in ops:
                # torch's batch picks the peer keyword with `p2p.op is isend`: give it the function
                # it will compare against (ours while installed), whichever the op was built with
                fname = "isend" if p2p.op == c10d.isend else "irecv"
                p2p.op = getattr(c10d, fname)
                direction = P2P[fname]
                traced.append(self._begin_p2p(tracer, direction, p2p.tensor, int(p2p.peer), p2p.group, issue_ns))
        except Exception as exc:
            tracer._failed("intercepting batch_isend_irecv", exc)
            comm_spans.abort(traced)
            return original(*args, **kwargs)
        try:
            works = original(*args, **kwargs)
        except BaseException:
            comm_spans.abort(traced)
            raise
        if not ops:
            return works
        on_gpu = ops[0].tensor.is_cuda
        if len(works) == len(ops):  # gloo: one work per op
            return [_as_work(comm_spans.finish([op], work, on_gpu, has_completion=False))
                    for op, work in zip(traced, works)]
        # coalesced (NCCL): every op completes with the batch, so each returned work ends all of them
        return [_as_work(comm_spans.finish(traced, work, on_gpu, has_completion=False)) for work in works]


def _run_traced(op: Any, original: Callable, args: tuple, kwargs: dict, is_async: bool,
                tensor: torch.Tensor | None, has_completion: bool = True) -> Any:
    """Call the original function under the comm op begun for it (none: call it untraced); a blocking
    call ends the op on return, an async one hands back a Work that ends it on completion."""
    if op is None:
        return original(*args, **kwargs)
    try:
        result = original(*args, **kwargs)
    except BaseException:
        comm_spans.abort([op])
        raise
    on_gpu = tensor is not None and tensor.is_cuda  # an op is begun only once its tensor is known
    if not is_async:
        comm_spans.finish([op], None, on_gpu)
        return result
    return _as_work(comm_spans.finish([op], result, on_gpu, has_completion=has_completion))
