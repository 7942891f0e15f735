"""Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) against transformers' own code: the chunked rule equals
transformers' chunked and recurrent PyTorch fallbacks (any chunk size, grouped heads, the final state); packed
documents restart the state and the conv window, so a packed row's logits are each document's run alone through
transformers; the imported families at EP 2 and TP 2 + SP x PP 2 evaluate to transformers' loss; a model built from
megatron-core's flags trains with packed documents at TP 2 + SP x PP 2 (ZeRO-1) as at one rank; the layouts the
state passing does not cover yet are one message each.

Logits, export, resharding and the flags' architecture of the three families are in tests/test_families.py, their
gradients at TP 2 + SP and PP 2 in tests/test_gradients.py (the families are in tests/hf_families.FAMILIES)."""

import pytest
import torch

from hybrid.errors import ConfigError
from hybrid.model.gated_delta_net import chunk_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from tests.hf_families import make_family
from checks.launch_helpers import MERGES, VOCAB, read_log, run


def _inputs(b=2, s=37, nk=2, nv=4, dk=8, dv=6, seed=0):
    """transformers' argument layout [b, s, heads, d]: q, k on the key heads, v, g, beta on the value heads."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, nk, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, s, nv, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(b, s, nv, generator=gen, dtype=torch.float64) * 2  # decays from 1 down to e^-2 per token
    beta = torch.rand(b, s, nv, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


def _ours(q, k, v, g, beta, chunk, documents=None):
    """Our rule on transformers' arguments: heads first, key heads repeated for their value heads, q and k
    L2-normalised and q scaled, as the layer does before calling it."""
    ratio = v.size(2) // q.size(2)
    q, k = (t.repeat_interleave(ratio, dim=2).transpose(1, 2) for t in (q, k))
    q, k = l2_normalize(q) * q.size(-1) ** -0.5, l2_normalize(k)
    out, state = chunk_gated_delta_rule(q, k, v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2), chunk,
                                        documents)
    return out.transpose(1, 2), state


@pytest.mark.parametrize("chunk", [3, 5, 16, 64])
def test_chunked_rule_equals_transformers_chunked_and_recurrent_fallbacks_at_any_chunk_size(chunk):
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)
    q, k, v, g, beta = _inputs()
    ours, state = _ours(q, k, v, g, beta, chunk)
    for reference in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        want, want_state = reference(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(ours, want.to(ours.dtype), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, want_state.to(state.dtype), rtol=1e-5, atol=1e-5)
    # and our own token-at-a-time form, on the same normalised inputs, in float64 to rounding
    ratio = v.size(2) // q.size(2)
    qh, kh = (t.repeat_interleave(ratio, dim=2).transpose(1, 2) for t in (q, k))
    recurrent, _ = recurrent_gated_delta_rule(l2_normalize(qh) * qh.size(-1) ** -0.5, l2_normalize(kh),
                                              v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2))
    assert (recurrent.transpose(1, 2) - ours).abs().max() < 1e-12


def test_packed_documents_restart_the_state_as_each_document_run_alone():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule
    q, k, v, g, beta = _inputs(s=29)
    documents = torch.tensor([[0] * 6 + [1] * 16 + [2] * 7, [0] * 1 + [1] * 28])  # boundaries inside chunks of 8
    ours, _ = _ours(q, k, v, g, beta, 8, documents)
    for row in range(2):
        for doc in documents[row].unique():
            at = (documents[row] == doc).nonzero().flatten()
            part = slice(at[0].item(), at[-1].item() + 1)
            alone = [t[row:row + 1, part] for t in (q, k, v, g, beta)]
            want, _ = torch_recurrent_gated_delta_rule(*alone[:3], g=alone[3], beta=alone[4],
                                                       use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(ours[row:row + 1, part], want, rtol=1e-5, atol=1e-6)  # (theirs runs in fp32)
    unpacked, _ = _ours(q, k, v, g, beta, 8)
    assert (unpacked - ours).abs().max() > 1e-2  # (the reset matters)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_packed_row_gives_each_documents_transformers_logits(family, tmp_path):
    """Three documents packed in one row (--reset-attention-mask --reset-position-ids): every Gated DeltaNet layer's
    state and conv window, and the full layers' attention and positions, restart at each document, so each
    document's logits are transformers' for that document alone."""
    from tests.test_families import our_model
    eod = 0
    hf = make_family(family, tmp_path / family, tokenizer=False)
    lengths = (7, 13, 11)  # each ends with the EOD token (which ends its document)
    gen = torch.Generator().manual_seed(5)
    docs = [torch.cat([torch.randint(1, 8192, (n - 1,), generator=gen), torch.tensor([eod])]) for n in lengths]
    packed = torch.cat(docs)[None]
    model, _ = our_model(tmp_path / family, reset_attention_mask=True, reset_position_ids=True, eod_token=eod)
    plain, _ = our_model(tmp_path / family)
    with torch.no_grad():
        ours = model(packed)
        leaked = plain(packed)  # the same row without the documents: the state runs on
        start = 0
        for doc in docs:
            want = hf(doc[None]).logits
            torch.testing.assert_close(ours[:, start:start + len(doc)], want, rtol=1e-5, atol=1e-5)
            start += len(doc)
    assert (leaked[:, lengths[0]:] - ours[:, lengths[0]:]).abs().max() > 1e-3


EOD = 0
LENGTHS = (9, 12, 11)  # each document ends with the EOD token; a row of 32 tokens


def _packed_batch():
    """Two rows of three documents each (the second row's in reverse order): ids [2, 32] and labels (Megatron's:
    the next token, the EOD's label the next document's first token), and each document."""
    gen = torch.Generator().manual_seed(8)
    docs = [torch.cat([torch.randint(1, 8192, (n - 1,), generator=gen), torch.tensor([EOD])]) for n in LENGTHS]
    tail = torch.randint(1, 8192, (2, 1), generator=gen)
    rows = torch.stack([torch.cat(docs), torch.cat(docs[::-1])])
    return rows, torch.cat([rows[:, 1:], tail], dim=1), docs


def _packed_cp2(path: str) -> dict:
    """On each rank of CP 2: the loss and gradient shards of one backward of the packed rows (the runtime over
    DP x CP, documents restarting every layer's state, conv window, attention and positions)."""
    import dataclasses
    from hybrid.conversion.hf import read_hf_dir
    from hybrid.conversion.layout import load_full_state
    from hybrid.model.build import build_model
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import build_groups
    from hybrid.pipeline_plan import PipelineSchedule
    from hybrid.training.deepspeed_fixes import register_moe_layers
    from tests.model_harness import _result, runtime_iteration
    state, config, _ = read_hf_dir(path)
    config = dataclasses.replace(config, reset_attention_mask=True, reset_position_ids=True, eod_token=EOD,
                                 linear_attention_chunk_size=4)
    groups = build_groups(experts=bool(config.num_experts), context_parallel=2)
    pipeline = PipelineSchedule(partition="uniform")
    model = build_model(config, groups, pipeline).train()
    load_full_state(model, state, config, groups)
    register_moe_layers(model, groups)
    params = canonical_parameters(model, config.num_layers)
    ids, labels, _ = _packed_batch()
    loss, recorded, _ = runtime_iteration(model, groups, pipeline, [(ids, labels)])
    return _result(groups, loss, None, params, {n: recorded[id(p)] for n, p in params.items()})


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_packed_documents_at_cp2_give_transformers_loss_and_gradients_per_document(family, tmp_path):
    """CP 2 (each rank two chunks of 8 of the 32 positions; the Gated DeltaNet layers mix whole sequences for half
    the key heads after an all-to-all, the full layers attend on the ring), three packed documents per row: the loss
    and every gradient equal transformers' with each document run alone (their losses summed over the batch's
    tokens)."""
    import torch.nn.functional as F
    from checks.rank_pool import run_on_ranks
    from tests.model_harness import assemble_grads, compare_grads
    from tests.test_gradients import _saved_gradients
    hf = make_family(family, tmp_path / family, tokenizer=False)
    ids, labels, _ = _packed_batch()
    hf.zero_grad()
    pieces = []
    for row, lengths in zip(ids, (LENGTHS, LENGTHS[::-1])):
        ends = torch.tensor(lengths).cumsum(0).tolist()
        pieces.append(torch.cat([hf(row[None, a:b]).logits[0] for a, b in zip([0] + ends[:-1], ends)]))
    logits = torch.stack(pieces)
    want_loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
    want_loss.backward()
    want = _saved_gradients(hf, tmp_path)
    results = run_on_ranks(_packed_cp2, 2, str(tmp_path / family))
    for r in results:
        assert abs(r["loss"] - want_loss.item()) <= 1e-5 * want_loss.item(), (r["loss"], want_loss.item())
    scale = max(g.abs().max().item() for g in want.values())
    compare_grads(assemble_grads(results), want, 8192, 2e-5 * scale)


EP2, CP2 = ("--expert-model-parallel-size", 2), ("--context-parallel-size", 2)


@pytest.mark.slow
@pytest.mark.parametrize("family,layouts", [("qwen3_5", [CP2]), ("qwen3_5_moe", [EP2]), ("qwen3_next", [EP2, CP2])])
def test_families_evaluate_to_transformers_loss_at_ep2_cp2_and_tp2_pp2(family, layouts, data, tmp_path):
    """launch/evaluate.py on the converted checkpoint, experts over 2 ranks (EP 2), the sequence over 2 (CP 2: the
    heads' all-to-all, the full layers' ring) and at TP 2 + SP x PP 2: transformers' loss on the same windows within
    1e-5 (Qwen3-Next's layer 1 dense, its top-k not renormalised)."""
    from tests.test_moe import assert_evaluation_is_transformers_loss
    hf = make_family(family, tmp_path / "hf")
    assert_evaluation_is_transformers_loss(tmp_path / "hf", hf, data, tmp_path, layouts, tp2_pp2=True)


FLAGS = ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4, "--num-query-groups", 2, "--kv-channels",
         8, "--ffn-hidden-size", 64, "--swiglu", "--normalization", "RMSNorm", "--apply-layernorm-1p", "--qk-layernorm",
         "--position-embedding-type", "rope", "--rotary-percent", 0.5, "--disable-bias-linear",
         "--attention-output-gate", "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", 2,
         "--linear-num-key-heads", 2, "--linear-num-value-heads", 4, "--linear-key-head-dim", 8,
         "--linear-value-head-dim", 6, "--linear-attention-chunk-size", 8, "--untie-embeddings-and-output-weights",
         "--hidden-dropout", 0, "--attention-dropout", 0, "--seq-length", 32, "--micro-batch-size", 2,
         "--global-batch-size", 8, "--train-iters", 4, "--lr", 1e-3, "--min-lr", 1e-4, "--lr-warmup-iters", 1,
         "--clip-grad", 1.0, "--eval-iters", 0, "--log-interval", 1, "--no-progress-bar", "--reset-attention-mask",
         "--reset-position-ids"]


@pytest.mark.slow
def test_flags_built_model_trains_packed_documents_at_tp2_sp_pp2_zero1_as_at_one_rank(data, tmp_path):
    """megatron-core's flags (layers 0 and 2 Gated DeltaNet, 1 and 3 gated full attention), packed documents of the
    embedded corpus: 4 iterations at TP 2 + SP x PP 2 under ZeRO-1 give one rank's losses (1e-5), and the run
    exports a Qwen3.5 that transformers loads."""
    from transformers import AutoModelForCausalLM
    flags = FLAGS + ["--data-path", data, "--vocab-file", VOCAB, "--merge-file", MERGES]
    run("python", 1, flags + ["--log-json", tmp_path / "one.jsonl"])
    run("torchrun", 4, flags + ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2,
                                "--sequence-parallel", "--zero-stage", 1, "--log-json", tmp_path / "four.jsonl",
                                "--save", tmp_path / "ckpt", "--export-hf", tmp_path / "export"])
    one, four = ([r["lm_loss"] for r in read_log(tmp_path / f"{n}.jsonl")] for n in ("one", "four"))
    assert len(one) == 4 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, four)), (one, four)
    assert one[0] != one[-1]
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert type(reloaded).__name__ == "Qwen3_5ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.parametrize("change,message", [
    (dict(linear_num_key_heads=3), "--linear-num-value-heads 4 must be a multiple of --linear-num-key-heads 3"),
    (dict(linear_conv_kernel_dim=0), "--linear-conv-kernel-dim must be positive"),
    (dict(linear_attention_freq=[1, 0]), "--linear-attention-freq as a list needs one 0 or 1 per layer (4"),
    (dict(multi_latent_attention=True), "not --multi-latent-attention"),
])
def test_bad_gated_delta_net_shapes_are_one_message_naming_the_flag(change, message):
    from hybrid.model.config import ModelConfig
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, position_embedding_type="rope",
                linear_attention_freq=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=8)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig(**{**base, **change})


def test_key_heads_tp_does_not_split_is_one_message():
    from hybrid.model.config import ModelConfig
    config = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, position_embedding_type="rope",
                         linear_attention_freq=2, linear_num_key_heads=2, linear_num_value_heads=4)
    with pytest.raises(ConfigError, match="--linear-num-key-heads 2 is not divisible by "
                                          "--tensor-model-parallel-size 4"):
        config.validate(4)


@pytest.mark.parametrize("flags,message", [
    (["--linear-attention-freq", 2], "add --experimental-attention-variant gated_delta_net"),
    (["--experimental-attention-variant", "gated_delta_net"], "needs --linear-attention-freq"),
])
def test_linear_attention_flags_without_their_partner_are_one_message(flags, message):
    from hybrid.architecture import architecture_from_flags
    from hybrid.flags import build_parser
    args = build_parser().parse_args([str(f) for f in ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads",
                                                       4, "--seq-length", 16] + flags])
    with pytest.raises(ConfigError, match=message):
        architecture_from_flags(args, 64)


def test_a_gated_delta_net_model_is_refused_as_a_megatron_checkpoint_before_anything_is_written(tmp_path):
    """megatron-core's Gated DeltaNet names (in_proj, conv1d, the zero-centred out_norm) are not mapped yet: writing
    such a model as a Megatron-LM checkpoint is one message naming the options and the HF route, nothing written;
    reading one is refused by its arguments (tests/test_megatron_checkpoints.py's REFUSED)."""
    from hybrid.checkpoint.client_state import ClientState
    from hybrid.conversion.megatron.write import write_megatron
    from hybrid.model.config import ModelConfig
    config = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64,
                         position_embedding_type="rope", normalization="RMSNorm", attention_output_gate=True,
                         linear_attention_freq=4, linear_num_key_heads=2, linear_num_value_heads=4)
    with pytest.raises(ConfigError, match="--experimental-attention-variant gated_delta_net, --attention-output-gate "
                                          r"\(.*--saver hf"):
        write_megatron({}, config, 1, 1, str(tmp_path / "out"), ClientState(iteration=1, consumed_samples=8))
    assert not (tmp_path / "out").exists()


def test_the_fla_call_passes_what_fla_expects_and_gives_the_pytorch_forms_logits_and_gradients(tmp_path, monkeypatch):
    """The CUDA path through flash-linear-attention's chunk_gated_delta_rule, its call checked on the CPU: a stand-in
    with fla's signature and conventions ([B, T, H, K] queries and keys on the key heads, values, decays and betas on
    the value heads, L2 norms and the 1/sqrt(dk) scale in the kernel, betas after their sigmoid) computed by
    transformers' fallback (whose API is fla's) gives the PyTorch form's logits and gradients; packed rows and
    decoding never take it (checks/gpu_paths.py runs the real kernel against the PyTorch form on a GPU)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    from hybrid.model import gated_delta_net as gdn
    from tests.test_families import our_model
    calls = []

    def fla_stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, **kwargs):
        assert scale is None and initial_state is None and not kwargs and use_qk_l2norm_in_kernel
        assert q.shape == k.shape and q.shape[:2] == v.shape[:2] == g.shape[:2] == beta.shape[:2]
        assert v.size(2) == g.size(2) == beta.size(2) == q.size(2) and g.dtype == torch.float32  # (q, k repeated)
        assert 0 <= beta.min() and beta.max() <= 1  # (after the sigmoid)
        calls.append(tuple(v.shape))
        return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True,
                                            output_final_state=output_final_state)

    make_family("qwen3_5", tmp_path / "hf", tokenizer=False)
    ids = torch.randint(1, 8192, (2, 21), generator=torch.Generator().manual_seed(4))
    model, _ = our_model(tmp_path / "hf")

    def logits_and_grads():
        model.zero_grad()
        logits = model(ids)
        logits.float().square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want, want_grads = logits_and_grads()
    assert "not installed" in gdn.backend_note(model.config, "cuda")  # (the run's log line on a GPU without fla)
    assert gdn.backend_note(model.config, "cpu") is None
    monkeypatch.setattr(gdn, "FLA_CHUNK", fla_stand_in)
    monkeypatch.setattr(gdn, "fla_applies", lambda tensor, documents, cache: documents is None and cache is None)
    # (in fp32 here: on CUDA the kernel runs in bf16 / fp16 only, and checks/gpu_paths.py compares it there)
    got, got_grads = logits_and_grads()
    assert calls == [(2, 21, 4, 6)] * 3  # layers 0-2, every value head: [B, T, HV, V]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert gdn.backend_note(model.config, "cuda").endswith("flash-linear-attention's chunked kernel")
