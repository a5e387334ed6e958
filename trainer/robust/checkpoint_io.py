"""The mechanics under trainer/robust/checkpoint.py: host snapshots of a state tree, atomic shard files, and
broadcasting a state tree from one rank to its group.

A state tree is nested dicts/lists of tensors and plain values (ints, floats, bools, strings).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megascope.tracer import comm


def host_snapshot(tree: Any, buffers: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """Copy every tensor of `tree` into reusable host buffers (keyed by position in the tree; pinned
    when the tensor is on a GPU). Returns the copied tree and a CUDA event the copies complete at
    (None on CPU). The copies are enqueued on the current stream: later kernels that overwrite the
    device tensors are ordered after them, so the training thread never waits for the device."""
    event = None
    on_gpu = False

    def copy(node: Any, path: str) -> Any:
        nonlocal on_gpu
        if isinstance(node, torch.Tensor):
            buf = buffers.get(path)
            if buf is None or buf.shape != node.shape or buf.dtype != node.dtype:
                pin = node.is_cuda
                buf = torch.empty(node.shape, dtype=node.dtype, device="cpu", pin_memory=pin)
                buffers[path] = buf
            on_gpu = on_gpu or node.is_cuda
            buf.copy_(node.detach(), non_blocking=node.is_cuda)
            return buf
        if isinstance(node, dict):
            return {k: copy(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(copy(v, f"{path}/{i}") for i, v in enumerate(node))
        return node

    out = copy(tree, "")
    if on_gpu:
        event = torch.cuda.Event()
        event.record()
    return out, event


def save_file(tree: Any, path: Path) -> int:
    """torch.save under a temporary name, fsync, rename: a reader never sees half a shard, and a
    crash mid-write leaves only the hidden temp file. Returns the file size."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(tree, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


class _TensorRef:
    """Placeholder for the i-th tensor of a flattened tree (shape and dtype for the receivers)."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def _flatten(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors.append(tree)
        return _TensorRef(len(tensors) - 1, tuple(tree.shape), tree.dtype)
    if isinstance(tree, dict):
        return {k: _flatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_flatten(v, tensors) for v in tree)
    return tree


def _unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(skeleton, _TensorRef):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_unflatten(v, tensors) for v in skeleton)
    return skeleton


def broadcast_tree(tree: Any | None, src: int, group: dist.ProcessGroup | None, device: torch.device,
                   group_name: str = "dp") -> Any:
    """Send `tree` (given on global rank `src`, None elsewhere) to every member of `group`: the
    structure as pickled bytes, then each tensor on `device` (NCCL needs GPU tensors). The result's
    tensors live on the CPU. The structure comes from a peer of the same job, not from outside."""
    is_src = torch.distributed.get_rank() == src
    tensors: list[torch.Tensor] = []
    header = pickle.dumps(_flatten(tree, tensors)) if is_src else b""
    length = torch.tensor([len(header)], dtype=torch.int64, device=device)
    comm.broadcast(length, src, group, group_name, name="checkpoint_header_size")
    n = int(length.item())  # note: this is a CPU-GPU sync point (restore only)
    raw = (torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device) if is_src
           else torch.empty(n, dtype=torch.uint8, device=device))
    comm.broadcast(raw, src, group, group_name, name="checkpoint_header")
    skeleton = pickle.loads(raw.cpu().numpy().tobytes()) if not is_src else None
    refs: list[_TensorRef] = []
    _collect_refs(skeleton if skeleton is not None else _flatten(tree, []), refs)
    received = []
    for ref in sorted(refs, key=lambda r: r.index):
        t = tensors[ref.index].to(device) if is_src else torch.empty(ref.shape, dtype=ref.dtype, device=device)
        comm.broadcast(t, src, group, group_name, name="checkpoint_broadcast")
        received.append(t.cpu())
    return tree if is_src else _unflatten(skeleton, received)


def _collect_refs(skeleton: Any, out: list[_TensorRef]) -> None:
    if isinstance(skeleton, _TensorRef):
        out.append(skeleton)
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _collect_refs(v, out)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            _collect_refs(v, out)


# ---------------------------------------------------------------------- checkpoint locations
# A checkpoint root is a local directory or an fsspec URL (s3://bucket/ckpt, gs://..., file:///...).
# Local paths go through os/pathlib (atomic renames); URLs through fsspec, where a PUT is atomic.


def is_url(root: str | os.PathLike) -> bool:
    text = os.fspath(root)
    return "://" in text and not text.startswith("file://")


def _fs(root: str):
    import fsspec

    return fsspec.core.url_to_fs(root)[0]


def join(root: str | os.PathLike, name: str) -> str:
    text = os.fspath(root)
    return f"{text.rstrip('/')}/{name}" if "://" in text else str(Path(text) / name)


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def makedirs(path: str) -> None:
    if is_url(path):
        _fs(path).makedirs(path, exist_ok=True)
    else:
        Path(path.removeprefix("file://")).mkdir(parents=True, exist_ok=True)


def list_dir(path: str) -> dict[str, int]:
    """Names directly under `path` -> size in bytes (directories: -1); empty if it does not exist."""
    if is_url(path):
        fs = _fs(path)
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: (int(e.get("size") or 0) if e["type"] == "file" else -1)
                for e in entries}
    folder = Path(path.removeprefix("file://"))
    if not folder.is_dir():
        return {}
    return {e.name: (e.stat().st_size if e.is_file() else -1) for e in folder.iterdir()}


def read_text(path: str) -> str:
    if is_url(path):
        with _fs(path).open(path, "r") as f:
            return f.read()
    return Path(path.removeprefix("file://")).read_text()


def write_text_atomic(path: str, text: str) -> None:
    """A temporary name renamed into place locally; one whole PUT on an object store."""
    if is_url(path):
        with _fs(path).open(path, "w") as f:
            f.write(text)
        return
    target = Path(path.removeprefix("file://"))
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)


def remove_tree(path: str) -> None:
    if is_url(path):
        try:
            _fs(path).rm(path, recursive=True)
        except FileNotFoundError:
            pass
        return
    import shutil

    shutil.rmtree(path.removeprefix("file://"), ignore_errors=True)


def dcp_writer(path: str):
    """DCP's writer for `path`: FileSystemWriter locally, FsspecWriter for a URL."""
    if is_url(path) or path.startswith("file://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path, single_file_per_rank=True, sync_files=False)
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path, single_file_per_rank=True, sync_files=True)


def dcp_reader(path: str):
    if is_url(path) or path.startswith("file://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(path)
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path)
