"""How conversations become training tokens (the --sft-* and --dpo-* options), and what reading and packing
counted for the log."""

from __future__ import annotations

from dataclasses import dataclass, field


TRUNCATION = ("truncate", "drop")


DPO_TRUNCATION = ("keep_start", "keep_end")


@dataclass(frozen=True)
class ChatOptions:
    """How conversations become training tokens (the --sft-* flags)."""

    train_on_prompt: bool = False  # --sft-train-on-prompt: every token of the conversation takes loss
    truncation: str = "truncate"  # --sft-truncation: a conversation longer than a window is cut ("truncate") or dropped
    skip_bad: bool = False  # --sft-skip-bad: malformed rows are counted and skipped instead of stopping the run
    pairs: bool = False  # --dpo: rows are preference pairs (prompt, chosen, rejected), packed side by side
    # a pair's truncation (TRL's DPOConfig, applied when windows are packed: the tokenized pairs do not depend on it)
    # --dpo-max-length: TRL's max_length, each side's tokens; 0: half a window (seq_length // 2)
    dpo_max_length: int = 0
    dpo_max_prompt_length: int = 0  # --dpo-max-prompt-length: the prompt's last tokens kept first (TRL 0.x); 0: all
    dpo_truncation_mode: str = "keep_start"  # --dpo-truncation-mode: TRL's truncation_mode (keep_start, keep_end)
    stream_buffer: int = 0  # --sft-streaming's shuffle buffer (hybrid.data.chat.stream); 0: the whole file up front


@dataclass
class Counts:
    """What reading and packing did, for the log."""

    conversations: int = 0
    skipped_bad: int = 0
    truncated: int = 0
    dropped: int = 0
    loss_tokens: int = 0
    first_bad: list = field(default_factory=list)

    def merge(self, other: "Counts") -> None:
        for name in ("conversations", "skipped_bad", "truncated", "dropped", "loss_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.first_bad = (self.first_bad + other.first_bad)[:3]
