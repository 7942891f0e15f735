"""What hybrid adds to DeepSpeed's checkpoint files, as typed records: the client state (`ClientState`)
and the layout the weights were written at (`SavedLayout`), declared once and read only through
`ClientState.from_meta`.

Files hold plain dicts (they load with `weights_only=True`); the records are rebuilt from them, with
unknown keys ignored and checkpoints of earlier hybrid versions (one `hybrid_config` dict) read too.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from hybrid.checkpoint.files import first_model_file, load_file
from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """The parallel layout and pipeline placement a checkpoint's files were written at; a plain
    (non-universal) load compares it field by field with the run's (hybrid.training.resume)."""

    tensor_parallel: int = 1  # --tensor-model-parallel-size
    pipeline_parallel: int = 1  # --pipeline-model-parallel-size
    data_parallel: int = 1  # the ranks reading different samples (ZeRO partitions over DP x CP)
    context_parallel: int = 1  # --context-parallel-size
    ulysses: int = 1  # --ds-sequence-parallel-size
    expert_parallel: int = 1  # --expert-model-parallel-size
    pipeline_schedule: str = "1f1b"  # --pipeline-schedule
    virtual_stages: int = 1  # virtual pipeline stages per rank
    zero_stage: int = 0  # the ZeRO stage the optimizer state is partitioned by
    # "stages": one file per TP x PP rank under canonical names (every schedule since the one runtime); "" in
    # older checkpoints, whose 1f1b files are DeepSpeed's pipeline engine's (one file per layer)
    stage_files: str = ""
    stage_layers: tuple = ()  # 1f1b: transformer layers per stage (empty: not recorded)
    # ZeRO-3: the rows of each row block an untied vocabulary table was held in (ModelConfig.vocab_block_rows);
    # 0: the tables whole (every checkpoint written before the blocks)
    vocab_block_rows: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Optional[dict]) -> "SavedLayout":
        """From a file's dict (unknown keys, such as a newer version's, are ignored)."""
        values = values or {}
        return cls(**{f.name: type(f.default)(values[f.name]) for f in dataclasses.fields(cls)
                      if values.get(f.name) is not None})

    @property
    def storage(self) -> str:
        """How weights with optimizer state are stored: "module" (one mp_rank file per TP rank), "zero3"
        (ZeRO-3 partitions, any TP x PP), "layer_files" (DeepSpeed's pipeline engine, in older checkpoints: one
        file per layer and TP rank) or "virtual_stages" (one file per TP x PP rank, canonical names)."""
        if self.zero_stage == 3:
            return "zero3"
        if self.pipeline_parallel > 1:
            legacy = self.pipeline_schedule == "1f1b" and not self.stage_files
            return "layer_files" if legacy else "virtual_stages"
        return "module"


@dataclasses.dataclass
class ClientState:
    """What hybrid adds to DeepSpeed's checkpoint files (DeepSpeed's `client_state`, stored beside its
    own keys in every model-states file): training writes it at each save, conversion when it writes
    weights, and every reader goes through `ClientState.from_meta`."""

    iteration: int = 0  # iterations done
    consumed_samples: int = 0  # the sampler's position (hybrid.data.batches)
    model: dict = dataclasses.field(default_factory=dict)  # the ModelConfig's fields (the architecture)
    layout: SavedLayout = SavedLayout()  # where the files' shards came from
    run: dict = dataclasses.field(default_factory=dict)  # the run's other settings, for people to read
    args: dict = dataclasses.field(default_factory=dict)  # the parsed flags (--use-checkpoint-args)
    rng_states: Optional[dict] = None  # every RNG stream (hybrid.parallel.random.get_rng_states)
    universal_checkpoint_info: Optional[dict] = None  # DeepSpeed's patterns for ds_to_universal
    optimizer_param_names: Optional[list] = None  # canonical names in optimizer order (no ZeRO only)
    weights_only: bool = False  # written by conversion: weights, no optimizer state

    def to_dict(self) -> dict:
        """The client state handed to DeepSpeed's save_checkpoint (plain values only)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layout"] = self.layout.to_dict()
        return out

    @classmethod
    def from_meta(cls, meta: Optional[dict]) -> "ClientState":
        """From a model-states file's contents (or DeepSpeed's returned client state); DeepSpeed's own
        keys are left out. Checkpoints of earlier versions kept the model and the layout in one
        `hybrid_config` dict, and some no ZeRO stage: it then comes from DeepSpeed's recorded config."""
        meta = dict(meta or {})
        legacy = meta.get("hybrid_config")
        if legacy is not None and "layout" not in meta:
            meta.setdefault("model", legacy.get("model", {}))
            meta["layout"] = legacy
            meta.setdefault("run", {k: v for k, v in legacy.items() if k == "train"})
        layout = dict(meta.get("layout") or {})
        if "zero_stage" not in layout:
            layout["zero_stage"] = int(((meta.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0))
        fields = {f.name: meta[f.name] for f in dataclasses.fields(cls) if meta.get(f.name) is not None}
        fields["layout"] = SavedLayout.from_dict(layout)
        return cls(**fields)

    @property
    def storage(self) -> str:
        """How the weights are stored (SavedLayout.storage); conversion's weights-only checkpoints use
        DeepSpeed's engine layouts: layer files at PP > 1, mp_rank files otherwise."""
        if self.weights_only:
            return "layer_files" if self.layout.pipeline_parallel > 1 else "module"
        return self.layout.storage

    def model_config(self) -> ModelConfig:
        if not self.model:
            raise ConfigError("the checkpoint records no model; it was not written by hybrid.")
        return model_config_from_summary(self.model)


def read_meta(load_dir: str, tag: str) -> dict:
    """Client state and DeepSpeed metadata of a checkpoint (rank 0's model-states file, weights dropped)."""
    meta = load_file(first_model_file(os.path.join(load_dir, tag)))
    meta.pop("module", None)
    return meta


def read_client_state(load_dir: str, tag: str) -> ClientState:
    """The client state of checkpoint `load_dir/tag` (from rank 0's model-states file)."""
    return ClientState.from_meta(read_meta(load_dir, tag))


def model_summary(config: ModelConfig) -> dict:
    return dataclasses.asdict(config)


def model_config_from_summary(summary: dict) -> ModelConfig:
    """A ModelConfig from its saved fields (`summary` the fields, or an older checkpoint's
    `hybrid_config` holding them under "model")."""
    fields = dict(summary.get("model", summary) if isinstance(summary.get("model"), dict) else summary)
    fields.pop("params_dtype", None)  # written by checkpoints before the setting was removed
    return ModelConfig(**fields)
