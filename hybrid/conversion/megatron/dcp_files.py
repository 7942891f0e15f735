"""torch.distributed.checkpoint directories (megatron-core's `torch_dist` format) read a region at a time,
in one process without a process group.

Reading follows the file format torch 2.13's FileSystemReader.read_data reads: `.metadata` (read with
hybrid.safe_loading's allow-list, not the plain pickle.load torch uses) maps each tensor to its chunks
(offsets and sizes in the global tensor) and each chunk to a byte range of a `__R_S.distcp` file, which
holds that chunk as one `torch.save` record (read with `weights_only=True`). torch's own loader only fills
whole tensors of a state dict; here one layer's slice of a stacked tensor is read without the rest
(megatron-core stacks every layer's weight of one kind into one tensor). Chunks written with a storage
transform (torch's compression extensions) are refused by name.
"""

from __future__ import annotations

import io
import os

import torch

from hybrid.errors import ConfigError
from hybrid.safe_loading import UnsafeCheckpointError, load_dcp_metadata, safe_load


class DCPCheckpoint:
    """One torch.distributed.checkpoint directory: its tensors' global shapes, and regions of them."""

    def __init__(self, directory: str):
        self.directory = directory
        path = os.path.join(directory, ".metadata")
        if not os.path.isfile(path):
            raise ConfigError(f"{directory}: no .metadata file; not a torch_dist checkpoint (or an incomplete one).")
        try:
            self.metadata = load_dcp_metadata(path)
        except UnsafeCheckpointError:
            raise
        except (EOFError, ValueError, AttributeError, TypeError) as error:
            raise ConfigError(f"{path}: unreadable ({type(error).__name__}: {error}); the checkpoint is "
                              f"truncated or damaged.") from None
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # torch's DCP: only with a file
        self.tensors = {key: md for key, md in self.metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}

    def shape(self, key: str) -> tuple:
        return tuple(self.tensors[key].size)

    def holds(self, key: str, index=()) -> bool:
        """Whether some chunk of `key` covers the slice [index] (leading indices; a layer of a stacked
        tensor whose other layers hold other modules has none)."""
        index = (index,) if isinstance(index, int) else tuple(index)
        return any(_overlaps(chunk, index) for chunk in self.tensors[key].chunks)

    def read(self, key: str, index=None) -> torch.Tensor:
        """The global tensor `key`, or with `index` (an int or a tuple of leading indices) its slice
        [index], assembled from the chunks that overlap it (each chunk file read for its byte range only)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex  # (see __init__)
        md = self.tensors[key]
        index = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        out = torch.empty(tuple(md.size)[len(index):], dtype=md.properties.dtype)
        filled = 0
        for chunk in md.chunks:
            if not _overlaps(chunk, index):
                continue
            offsets, sizes = list(chunk.offsets), list(chunk.sizes)
            value = self._chunk(MetadataIndex(key, chunk.offsets), key)
            for i in index:  # the slice's leading indices, relative to the chunk
                value, offsets, sizes = value[i - offsets[0]], offsets[1:], sizes[1:]
            region = out
            for dim, (start, size) in enumerate(zip(offsets, sizes)):
                region = region.narrow(dim, start, size)
            region.copy_(value)
            filled += value.numel()
        if filled != out.numel():
            raise ConfigError(f"{self.directory}: the chunks of {key} cover {filled} of its {out.numel()} values; "
                              f"the checkpoint is incomplete.")
        return out

    def _chunk(self, storage_index, key: str) -> torch.Tensor:
        info = self.metadata.storage_data.get(storage_index)
        if info is None:
            raise ConfigError(f"{self.directory}: .metadata lists a chunk of {key} that no file holds.")
        if getattr(info, "transform_descriptors", None):
            raise ConfigError(f"{self.directory}: {key} was written with storage transforms "
                              f"{list(info.transform_descriptors)}, which hybrid does not read.")
        path = os.path.join(self.directory, info.relative_path)
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except FileNotFoundError:
            raise ConfigError(f"checkpoint file {path} is missing; the checkpoint is incomplete.") from None
        if len(data) != info.length:
            raise ConfigError(f"checkpoint file {path} is truncated (it ends before {key}'s bytes).")
        return safe_load(io.BytesIO(data))


def _overlaps(chunk, index: tuple) -> bool:
    return all(start <= i < start + size for i, start, size in zip(index, chunk.offsets, chunk.sizes))
