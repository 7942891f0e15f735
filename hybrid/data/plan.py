"""The data plan a checkpoint was trained on, and what a resumed run changes of it.

Samples are served by their position, `consumed_samples` (hybrid.data.batches): which sample a position holds
is decided by the data files, the blend and split, the sequence length, the seed and the chat options; the
batch sizes decide only how many positions an iteration takes. A resumed run continues at the checkpoint's
position of its own plan, as Megatron-LM does; where the plan differs from the checkpoint's, the samples from
there are not the ones the saved run would have served next, and the log names each difference and how to
continue the saved run's samples exactly.
"""

from __future__ import annotations

import json
import os

# (the section of the saved run summary, its field, the flags that set it): what decides the samples' order
PLAN = (("training", "seq_length", "--seq-length"), ("training", "seed", "--seed"),
        ("data", "data_path", "--data-path"), ("data", "split", "--split"),
        ("data", "split_data_paths", "--train-data-path / --valid-data-path / --test-data-path"),
        ("data", "mock_data", "--mock-data"), ("data", "legacy_data_rules", "--legacy-data-rules"),
        ("data", "chat", "--sft / --dpo and the --sft-* / --dpo-* options"),
        ("data_files", None, "the data files' sizes"))  # named one by one
BATCH = ("training", "global_batch_size", "--global-batch-size")


def data_files(data) -> dict:
    """Every data file of the plan (`data`: the run's DataConfig) -> its size in bytes: a Megatron prefix's .bin
    and .idx, a JSONL / Parquet file, a `datasets` directory's files; names that are not files are left out."""
    paths = [p for entry in [data.data_path, *data.split_data_paths] if entry for p in entry]
    sizes = {}
    for path in paths:
        for name in (path, path + ".bin", path + ".idx"):
            if os.path.isfile(name):
                sizes[name] = os.path.getsize(name)
            elif os.path.isdir(name):
                for root, _, names in os.walk(name):
                    for file in names:
                        sizes[os.path.join(root, file)] = os.path.getsize(os.path.join(root, file))
    return sizes


def _plain(value):
    return json.loads(json.dumps(value, default=str))  # tuples as lists, as a reloaded summary has them


def plan_changes(saved: dict, now: dict) -> tuple[list[str], str]:
    """The saved run summary and this run's (hybrid.config.checkpoint_summary) -> (the differences of the data plan,
    each the flags and both values; the global batch size's change, or ''). A field the checkpoint did not record is not
    compared (checkpoints written before it was)."""
    changes = []
    for section, field, flags in PLAN:
        if section not in saved or (field is not None and field not in saved[section]):
            continue
        if field is None:  # the files: each whose size differs, or that one of the two plans lacks
            before, after = saved[section], now[section]
            changes += [f"{name}: {before.get(name, 'absent')} bytes (this run: {after.get(name, 'absent')})"
                        for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]
            continue
        before, after = _plain(saved[section][field]), _plain(now[section][field])
        if before != after:
            changes.append(f"{flags} {before} (this run: {after})")
    section, field, flag = BATCH
    before = (saved.get(section) or {}).get(field)
    batch = f"{flag} {before} (this run: {now[section][field]})" if before not in (None, now[section][field]) else ""
    return changes, batch
