"""Packed documents (--reset-attention-mask, --reset-position-ids): the document and position layout
equals megatron-core's masks and position ids; a packed sequence's loss and gradients equal those of
its documents run one by one as separate sequences (a reference that shares no masking code), for
GPT (learned positions) and Llama (RoPE, GQA), in one query block or many, with full recompute; TP 2
+ SP, PP 2 on DeepSpeed's engine (the ids travel with the hidden states; x CP 2 too) and on the torch
schedules (every stage gets the ids as a keyword argument) equal one rank; the flags reach training."""

import pytest
import torch

from hybrid.model.config import ModelConfig
from hybrid.model.gpt import GPTModel
from hybrid.model.sequence import documents_of, positions_of
from hybrid.parallel.cross_entropy import IGNORE_INDEX
from tests.model_harness import CONFIGS, assemble_grads, compare_grads, reference, scheduled_run, sharded_run
from checks.rank_pool import assert_close, run_on_ranks

EOD = 99  # the last id of the tiny models' vocabulary (100)
DOCUMENTS = dict(reset_attention_mask=True, reset_position_ids=True, eod_token=EOD)


def packed_batch(rows=3, seq=32, seed=0):
    """(ids, labels) of packed documents: lengths from 1 up, an EOD at the start, two EODs in a row,
    a row that is one document, documents crossing the end of a row; some labels ignored."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOD, (rows, seq + 1), generator=g)
    tokens[0, [0, 5, 6, 13, 20]] = EOD
    if rows > 1:
        tokens[1, [1, 2, seq - 1]] = EOD
    for r in range(3, rows):
        tokens[r, torch.randint(0, seq, (4,), generator=g)] = EOD
    labels = tokens[:, 1:].clone()
    labels[0, 7:9] = IGNORE_INDEX
    return tokens[:, :-1].contiguous(), labels


def document_spans(ids_row):
    """(start, end) of each document of one row: a document ends with its EOD token (inclusive)."""
    ends = [i + 1 for i, t in enumerate(ids_row.tolist()) if t == EOD]
    starts = [0] + ends
    return [(a, b) for a, b in zip(starts, ends + [len(ids_row)]) if b > a]


def per_document_loss(model, data):
    """Sum over documents, each run alone as its own sequence, of its token losses / the valid tokens."""
    ids, labels = data
    total, count = 0.0, 0
    for row in range(ids.size(0)):
        for a, b in document_spans(ids[row]):
            doc_labels = labels[row:row + 1, a:b]
            valid = int((doc_labels != IGNORE_INDEX).sum())
            if valid:
                total = total + model(ids[row:row + 1, a:b], doc_labels) * valid
                count += valid
    return total / count


def test_layout_equals_megatron_core_masks_and_position_ids():
    gpt_dataset = pytest.importorskip("megatron.core.datasets.gpt_dataset", reason="megatron-core is not installed")
    ids, _ = packed_batch(rows=6, seq=40, seed=3)
    documents, positions = documents_of(ids, EOD), positions_of(ids, EOD)
    for row in range(ids.size(0)):
        masked, _, core_positions = gpt_dataset._get_ltor_masks_and_position_ids(
            ids[row], EOD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False,
            create_attention_mask=True)
        assert positions[row].tolist() == core_positions.tolist()
        s = ids.size(1)
        causal = torch.arange(s)[None, :] <= torch.arange(s)[:, None]
        ours = causal & (documents[row][:, None] == documents[row][None, :])
        assert torch.equal(ours, ~masked[0]), f"row {row}: attention mask differs from megatron-core's"


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("block", [None, 8])
def test_packed_loss_and_grads_equal_each_document_alone(style, block, monkeypatch):
    from hybrid.model import attention
    if block:  # several query blocks per sequence (documents crossing block boundaries)
        monkeypatch.setattr(attention, "DOCUMENT_BLOCK", block)
    cfg, data = CONFIGS[style], packed_batch()
    packed = GPTModel(ModelConfig(**dict(cfg, **DOCUMENTS)))
    alone = GPTModel(ModelConfig(**cfg))
    alone.load_state_dict(packed.state_dict())
    loss = packed(*data)
    want = per_document_loss(alone, data)
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    loss.backward()
    want.backward()
    got = dict(packed.named_parameters())
    for name, p in alone.named_parameters():
        assert_close(got[name].grad, p.grad, 1e-5, f"grad {name}")
    plain = alone(*data).item()  # without the flags the documents see each other: the test can fail
    assert abs(plain - want.item()) > 1e-4  # 10x the tolerance above


def test_rope_attention_reset_alone_equals_each_document_alone():
    """With RoPE, attention depends on relative positions only, so --reset-attention-mask without
    --reset-position-ids gives each document's own loss too."""
    cfg, data = CONFIGS["llama"], packed_batch()
    packed = GPTModel(ModelConfig(**dict(cfg, reset_attention_mask=True, eod_token=EOD)))
    alone = GPTModel(ModelConfig(**cfg))
    alone.load_state_dict(packed.state_dict())
    want = per_document_loss(alone, data).item()
    assert abs(packed(*data).item() - want) <= 1e-5 * abs(want)


def test_full_and_selective_recompute_keep_the_document_masks():
    cfg, data = CONFIGS["llama"], packed_batch()
    want_loss, _, want_grads = reference(dict(cfg, **DOCUMENTS), data)
    for granularity in ("full", "selective"):
        loss, _, grads = reference(dict(cfg, **DOCUMENTS), data, recompute_granularity=granularity)
        assert abs(loss - want_loss) <= 1e-6
        for name in want_grads:
            assert_close(grads[name], want_grads[name], 1e-6, f"{granularity}: grad {name}")


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_tp2_with_sp_equals_one_rank_on_packed_documents(style):
    cfg, data = dict(CONFIGS[style], **DOCUMENTS), packed_batch(rows=4)
    ref_loss, _, ref_grads = reference(cfg, data)
    results = run_on_ranks(sharded_run, 2, cfg, 2, 1, data, True)
    assert abs(results[0]["loss"] - ref_loss) <= 1e-5
    compare_grads(assemble_grads(results), ref_grads, cfg["vocab_size"], 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("style,cp", [("gpt2", 1), ("llama", 1), ("gpt2", 2)])
def test_1f1b_pipeline_carries_the_documents_to_every_stage(style, cp):
    """PP 2 with 1F1B (and x CP 2): every stage is handed the whole-sequence ids beside the hidden states, so
    every stage masks by document; equal to one rank (labels without ignored positions, so the two
    micro-batches' token means average to the batch's)."""
    cfg = dict(CONFIGS[style], max_position_embeddings=64, **DOCUMENTS)
    ids, labels = packed_batch(rows=4, seq=64, seed=4)
    data = (ids, torch.roll(ids, -1, dims=1))
    ref_loss, _, ref_grads = reference(cfg, data)
    results = run_on_ranks(sharded_run, 2 * cp, cfg, 1, 2, data, cp=cp)
    assert all(abs(r["loss"] - ref_loss) <= 1e-5 * abs(ref_loss) for r in results)
    compare_grads(assemble_grads(results), ref_grads, cfg["vocab_size"], 1e-5)


# ("llama", "interleaved-1f1b") and ("gpt2", "zbv") passed too, cut for the suite's time
@pytest.mark.parametrize("style,schedule", [("llama", "zbv")])
def test_torch_schedules_give_every_stage_the_documents(style, schedule):
    """PP 2 x 2 virtual stages on torch.distributed.pipelining's schedules (loop and V placement): each
    stage derives the documents from the ids the schedule hands every stage; equal to one rank."""
    cfg = dict(CONFIGS[style], max_position_embeddings=64, **DOCUMENTS)
    ids, _ = packed_batch(rows=4, seq=64, seed=5)
    data = (ids, torch.roll(ids, -1, dims=1))
    ref_loss, _, ref_grads = reference(cfg, data)
    results = run_on_ranks(scheduled_run, 2, cfg, 1, 2, data, schedule, 2, micro_batches=4, timeout=240)
    assert all(abs(r["loss"] - ref_loss) <= 1e-5 * abs(ref_loss) for r in results)
    assert all(abs(r["eval_loss"] - ref_loss) <= 1e-5 * abs(ref_loss) for r in results)  # evaluation too
    compare_grads(assemble_grads(results), ref_grads, cfg["vocab_size"], 1e-5)


@pytest.mark.slow
def test_reset_flags_reach_training(tmp_path):
    from checks.launch_helpers import read_log, run
    flags = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 64,
             "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 2, "--log-interval", 1,
             "--no-progress-bar", "--eval-iters", 0, "--hidden-dropout", 0, "--attention-dropout", 0, "--no-demo"]
    losses = {}
    for name, extra in (("plain", []), ("documents", ["--reset-attention-mask", "--reset-position-ids",
                                                      "--eod-mask-loss"])):
        log = tmp_path / f"{name}.jsonl"
        run("python", 1, flags + extra + ["--log-json", log])
        losses[name] = [r["lm_loss"] for r in read_log(log) if "lm_loss" in r and "consumed_samples" in r]
    assert len(losses["documents"]) == 2 and losses["documents"] != losses["plain"]


def test_a_flag_whose_backend_does_not_run_is_said_in_the_log_once():
    from hybrid.model.attention import backend_notes
    from hybrid.model.config import ModelConfig
    assert backend_notes(ModelConfig(), 1) == []
    [kernel] = backend_notes(ModelConfig(attention_dropout=0.0), 2)  # CP: which kernel the ring's blocks run
    assert "--context-parallel-size 2: the ring's blocks run aten's fused CPU" in kernel
    assert backend_notes(ModelConfig(use_flash_attn=True), 1) == []
    [_, ring] = backend_notes(ModelConfig(use_flash_attn=True), 2, "cuda", torch.bfloat16)
    assert "--context-parallel-size 2" in ring and "not flash-attn" in ring
    [documents] = backend_notes(ModelConfig(use_flash_attn=True, reset_attention_mask=True, eod_token=0), 1)
    assert "--reset-attention-mask" in documents and "SDPA" in documents
