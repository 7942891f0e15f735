"""--dpo-reference-logps FILE: the frozen reference model's log-probabilities computed once, not every batch.

As TRL's `precompute_ref_log_probs`: before the first iteration the reference model scores every packed
window of the training (and validation) data once; each window's per-document sums of log p over the answer
tokens (hybrid.model.preference.document_logps; documents 2k, 2k + 1 are pair k's chosen and rejected
answers) are written to FILE, and the reference model is freed, so training holds one model. A later run with
the same windows reads FILE and never builds the reference model. The windows come with their values in the
batch (the chat dataset's "reference_logps"; hybrid.data.chat.dataset.ChatDataset), so every layout and order uses
them as they are.

The file is keyed by everything the values depend on: the windows themselves (a hash of their tokens and loss
masks, so of the data, the tokenizer, its template, --seq-length, --split and --seed), the reference model's
weights (hybrid.conversion.hf.weights_hash of --load-hf: every byte of its files) and the precision it scored in.
A file of other windows, another reference model or another precision is one message naming which differs, never
wrong values.
Each DP rank scores every DP-th window (all ranks the same number of forwards, so expert-parallel all-to-alls
match), the ranks' rows are summed over DP, and rank 0 writes the file (a temporary name, renamed when whole).
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from hybrid.conversion.hf import weights_hash
from hybrid.data.batches import Collator, to_device
from hybrid.model import lora
from hybrid.model.forward_only import forward_only
from hybrid.model.objectives import DocumentScores
from hybrid.errors import ConfigError
from hybrid.conversion.source import HF
from hybrid.training import resume
from hybrid.training.engine import build_reference
from hybrid.training.logging import log
from hybrid.training.start import reference_plan

_VERSION = 1


def chat_parts(dataset) -> list:
    """The packed-window datasets (hybrid.data.chat.dataset.ChatDataset) a split is made of: a blend's parts, or
    itself."""
    return list(getattr(dataset, "datasets", None) or [dataset])


def windows_key(parts: list) -> str:
    """What the values belong to: every window's tokens and loss mask, in order."""
    h = hashlib.sha256(repr((_VERSION, [p.tokens.shape for p in parts])).encode())
    for p in parts:
        h.update(np.ascontiguousarray(p.tokens).tobytes())
        h.update(np.ascontiguousarray(p.mask).tobytes())
    return h.hexdigest()


def scorer(model, groups, device, separator: int):
    """Scores micro-batches forward only with `model` (the frozen reference at PP = 1, or the pipeline's own
    stages holding the --load-hf weights; dropout off): each one's (sums, counts) [b, s] on the rank holding the
    last stage, None on the others (hybrid.model.objectives.DocumentScores through hybrid.model.forward_only)."""
    objective = DocumentScores(groups, model.config.vocab_size, separator)
    holds_last = any(stage.last for stage in model.stages)

    def score(batches):
        was_training = model.training
        model.eval()
        targets = [objective.target(ids, labels) for ids, labels in batches]
        outputs = forward_only(model, groups, device, [ids for ids, _ in batches],
                               lambda mb, out: objective.loss(out, targets[mb], None))
        model.train(was_training)
        return [tuple(values) for values in outputs] if holds_last else None
    return score


@torch.no_grad()
def score_windows(score, part, groups, device: torch.device, micro: int, per_call: int = 1) -> np.ndarray:
    """[windows, D] float32: each window's per-document log-probability sums (D: up to the last document any
    window has with loss tokens), the same on every rank. `score`: a list of `per_call` micro-batches of `micro`
    windows -> their (sums, counts), or None on a rank that does not compute them (a pipeline's other stages)."""
    collate, dp, pp = Collator(), groups.dp, groups.pp
    n = part.windows
    per_rank = -(-n // dp.size)
    mine = [dp.rank + dp.size * i for i in range(per_rank)]
    rows, width = {}, 1
    step = micro * per_call
    for start in range(0, per_rank, step):
        chunk = mine[start:start + step]
        chunk += [chunk[-1]] * (step - len(chunk))  # the same forwards on every rank; the copies are not kept
        windows = [min(w, n - 1) for w in chunk]
        batches = [to_device(collate([{"text": torch.from_numpy(part.tokens[w].astype(np.int64)),
                                       "loss_mask": torch.from_numpy(part.mask[w])} for w in windows[k:k + micro]]),
                             device) for k in range(0, step, micro)]
        scored = score(batches)
        if scored is None:
            continue
        sums = torch.cat([s for s, _ in scored])
        counts = torch.cat([c for _, c in scored])
        # each row up to its last document with loss tokens (the rest of a window is separators)
        last = torch.where(counts > 0, torch.arange(counts.size(1), device=device), -1).max(1).values.tolist()
        for row, w in enumerate(chunk):
            if w < n and w not in rows:
                rows[w] = sums[row, :last[row] + 1].clone()
                width = max(width, last[row] + 1)
    size = torch.tensor([width], device=device)
    for axis in (dp, pp):
        if axis.size > 1:
            dist.all_reduce(size, op=dist.ReduceOp.MAX, group=axis.group)
    width = int(size)
    table = torch.zeros(n, width, device=device, dtype=torch.float32)
    for w, values in rows.items():
        table[w, :len(values)] = values
    if dp.size > 1:
        dist.all_reduce(table, group=dp.group)  # each window is one DP rank's
    if pp.size > 1:  # the last stage's values, to every stage (the others' are zeros)
        dist.all_reduce(table, group=pp.group)
    return table.cpu().numpy()


# what the values depend on (the file's key), each with what it names in a refusal
KEY_PARTS = {"key": "other windows (another data file, tokenizer or template, --seq-length, --split or --seed)",
             "model": "another reference model (other --load-hf weights)",
             "precision": "another precision (--bf16 / --fp16 / fp32)"}


def file_key(run, parts: list) -> dict:
    """The key of this run's reference values: its windows, the --load-hf weights (every byte hashed once, on rank
    0, the cost logged; every rank gets the digest), the precision. Called by every rank."""
    digest = [None]
    if dist.get_rank() == 0:
        began = time.perf_counter()
        digest[0], size = weights_hash(run.checkpoint.load_hf)
        seconds = time.perf_counter() - began
        log(f"--dpo-reference-logps: hashed the reference's {size / 1e9:.3f} GB of weights for the file's key in "
            f"{seconds:.2f} s ({size / 1e9 / max(seconds, 1e-9):.2f} GB/s)")
    dist.broadcast_object_list(digest, src=0)
    return {"key": windows_key(parts), "model": digest[0], "precision": run.training.precision}


def _read(path: str, key: dict, count: int) -> list[np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            stored = {name: str(f[name]) if name in f else None for name in KEY_PARTS}
            tables = [f[f"windows_{k}"] for k in range(int(f["parts"]))]
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"--dpo-reference-logps {path}: not a file of reference log-probabilities this tool "
                          f"wrote ({e}); delete it or name another file to compute them again.") from None
    differ = [what for name, what in KEY_PARTS.items() if stored[name] != key[name]]
    if differ or len(tables) != count:
        raise ConfigError(f"--dpo-reference-logps {path}: holds the reference log-probabilities of "
                          f"{' and of '.join(differ or [KEY_PARTS['key']])}; delete it or name another file to "
                          f"compute them for this run.")
    return tables


def _write(path: str, key: dict, tables: list[np.ndarray]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp.npz")
    np.savez(tmp, parts=np.array(len(tables)), **{name: np.array(value) for name, value in key.items()},
             **{f"windows_{k}": table for k, table in enumerate(tables)})
    os.replace(tmp, path)


def _score(run, groups, engine, parts, score, per_call: int, scorer: str) -> list[np.ndarray]:
    """Every part's table, written to --dpo-reference-logps (rank 0; a temporary name, renamed when whole)."""
    path, begun, device = run.training.dpo.reference_logps, time.perf_counter(), torch.device(engine.device)
    tables = [score_windows(score, p, groups, device, run.training.micro_batch_size, per_call) for p in parts]
    key = file_key(run, parts)
    if dist.get_rank() == 0:
        _write(path, key, tables)
    dist.barrier()
    log(f"--dpo-reference-logps {path}: scored {sum(map(len, tables))} windows with {scorer} (the --load-hf weights) "
        f"in {time.perf_counter() - begun:.1f}s, written")
    return tables


def prepare(run, groups, engine, datasets) -> tuple[Optional[torch.nn.Module], tuple]:
    """--dpo: the reference model for the steps, or None when its log-probabilities ride with the windows
    (--dpo-reference-logps: read from FILE, or computed here and written); and where the run starts (the start
    plan's loader, hybrid.training.resume.start), run here because a pipeline scores with its own weights once they
    are --load-hf's: after the start loaded them, or before the start loads a checkpoint over them."""

    def start():
        return resume.start(engine, run, groups)
    options = run.training.dpo
    pipeline = run.pipelined
    device = torch.device(engine.device)
    path = options.reference_logps
    parts = [p for ds in datasets[:2] if ds is not None for p in chat_parts(ds)]
    if path and os.path.exists(path):
        tables = _read(path, file_key(run, parts), len(parts))
        log(f"--dpo-reference-logps {path}: the reference log-probabilities of {sum(map(len, tables))} windows, "
            f"read; no reference model is built")
        begun = start()
    elif not path:  # a frozen copy of the --load-hf model (before start(), which restores RNG), or with LoRA the
        # model itself with its adapters off
        return build_reference(run, groups, engine), start()
    elif not pipeline and not run.model.lora_rank:
        reference = build_reference(run, groups, engine)
        tables = _score(run, groups, engine, parts, scorer(reference, groups, device, options.separator), 1,
                        "the reference model")
        del reference  # freed: training holds one model
        if torch.device(engine.device).type == "cuda":
            torch.cuda.empty_cache()
        begun = start()
    else:  # the pipeline (or with LoRA the model with its adapters off) itself, holding the --load-hf weights
        from_hf = run.start.kind == HF  # (else --load's checkpoint goes over the --load-hf weights after scoring)
        begun = start() if from_hf else resume.start(engine, run, groups, reference_plan(run.checkpoint.load_hf))
        score = scorer(engine.module, groups, device, options.separator)
        with lora.adapters_off(engine.module):
            tables = _score(run, groups, engine, parts, score, run.training.grad_acc_steps if pipeline else 1,
                            "the pipeline" if pipeline else "the model with its adapters off")
        if not from_hf:
            begun = start()  # the checkpoint over the --load-hf weights
    for part, table in zip(parts, tables):
        part.reference_logps = table
    return None, begun
