"""Checks `megascope train` makes in the driver before it writes anything or starts a rank.

Each returns None when fine, else one line saying what is wrong and what to do. They are cheap (a few
stat calls, torch's CUDA device count): a bad run directory, device or data path must not cost a
30-line elastic traceback from every worker and leave heartbeats and incidents behind.
"""

from __future__ import annotations

import os
from pathlib import Path

from megascope.tracer.run_dir import MANIFEST, run_entries


def check_run_dir(run_dir: str, resume: bool, joining: bool = False) -> str | None:
    """A new run needs a new or empty directory; --resume needs the run to continue. A node other than
    node 0 of a multi-node job (`joining`) finds the job's data there when it starts late or replaces a
    lost node: node 0 has checked the directory for the job, and the roll call (roll_call.py) lets the
    node in only with the job's rendezvous id."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        return f"--run-dir {run_dir} is a file, not a directory; pass a new directory path (it is created)"
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        return f"--run-dir {run_dir}: {parent} is a file, so the directory cannot be created; pass another path"
    entries = [] if joining else run_entries(path)
    if not resume and entries:
        return (f"{run_dir} already holds a run ({', '.join(entries)}); a new run there would mix both runs' "
                "data: pass a new --run-dir, or --resume to continue this run from its latest checkpoint")
    if resume and entries and not (path / MANIFEST).is_file():
        return (f"--resume: {run_dir} holds run data ({', '.join(entries)}) but no {MANIFEST}; it is not a "
                "megascope run to continue: pass a new --run-dir")
    return None


def check_device(device: str, ranks_per_node: int, share_gpus: bool = False) -> str | None:
    """One CUDA device per local rank when the ranks will use CUDA (--device cuda, or auto on a GPU node),
    unless the ranks share GPUs (train.backend=gloo; NCCL refuses two ranks on one GPU)."""
    if device == "cpu":
        return None
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        return "--device cuda: torch sees no CUDA device on this machine; use --device cpu (or auto)"
    if gpus and gpus < ranks_per_node and not share_gpus:
        which = "--device cuda" if device == "cuda" else "--device auto picks CUDA here, and it"
        return (f"{which} needs one GPU per rank, but this node runs {ranks_per_node} ranks on {gpus} GPU(s); "
                "use fewer ranks per node (--dp/--tp/--pp, --nnodes), --device cpu, or --set train.backend=gloo "
                "to share GPUs (data parallelism only)")
    return None


def check_data(path: str, seq_len: int) -> str | None:
    """The --data path exists, is readable and holds at least one sample (seq_len + 1 tokens), judged
    from file sizes without reading the corpus (trainer/data.py reads it on the ranks)."""
    if not path:
        return None  # the built-in corpus
    p = Path(path)
    if not p.exists():
        return (f"--data {path}: no such file or folder; pass a text file, a folder of text files or a "
                "uint16 token file (.bin), or leave it out for the built-in corpus")
    files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")) if p.is_dir() else [p]
    if not files:
        return f"--data {path}: the folder has no files; put text files in it"
    unreadable = [str(f) for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        return f"--data {path}: cannot read {unreadable[0]} (permissions); make it readable or pass another path"
    size = sum(f.stat().st_size for f in files)
    if p.is_file() and p.suffix == ".bin":
        if size % 2:
            return f"--data {path}: a .bin token file holds uint16 ids (an even byte size); it has {size} bytes"
        tokens = size // 2
    else:
        tokens = size + len(files) - 1  # text: one token per byte, files joined by newlines
    if tokens < seq_len + 1:
        return (f"--data {path}: {tokens} tokens, but one sample needs seq_len + 1 = {seq_len + 1}; "
                "use more data or a shorter --seq-len")
    return None
