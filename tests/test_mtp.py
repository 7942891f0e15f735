"""Multi-token prediction (--mtp-num-layers, DeepSeek-V3; hybrid.model.mtp): each depth's loss is the
cross-entropy of its logits against the labels that many places further ahead, added to the gradient but not to
the logged loss, and a DeepSeek-V3-style model (MLA, DeepSeek's MoE with a dense first layer, an untied head)
with two depths trains at TP 2 + SP x EP 2 and at PP 2 (its last stage reading a copy of the word embeddings)
exactly as at one rank."""

import pytest
import torch

from tests.model_harness import assemble_grads, compare_grads
from checks.rank_pool import run_on_ranks

VOCAB = 256


def deepseek_style(**overrides):
    from hybrid.model.config import ModelConfig
    fields = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, position_embedding_type="rope",
                  normalization="RMSNorm", swiglu=True, add_bias_linear=False, multi_latent_attention=True,
                  qk_layernorm=True,
                  q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                  hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True, num_experts=4,
                  moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1, 1, 1],
                  moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_shared_expert_intermediate_size=16, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
    return ModelConfig(**{**fields, **overrides})


def _batches():
    tokens = torch.randint(0, VOCAB, (4, 17), generator=torch.Generator().manual_seed(3))
    return [(tokens[i:i + 2, :-1].contiguous(), tokens[i:i + 2, 1:].contiguous()) for i in (0, 2)]


def _iteration(layout: dict, overrides: dict) -> dict:
    """One iteration of the runtime (lr 0) over two micro-batches: the loss and this rank's gradient shards."""
    from hybrid.memory import partition_layers
    from hybrid.model.build import build_model
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import build_groups
    from hybrid.pipeline_plan import PipelineSchedule
    from hybrid.training.deepspeed_fixes import register_moe_layers
    from tests.model_harness import _result, runtime_iteration
    config = deepseek_style(sequence_parallel=layout.get("tensor_parallel", 1) > 1, **overrides)
    groups = build_groups(experts=True, **layout)
    pipeline = PipelineSchedule(partition="uniform")
    if groups.pp.size > 1:
        pipeline = PipelineSchedule(partition="uniform",
                                    stage_layers=partition_layers(config, 1, groups.pp.size, "uniform"))
    model = build_model(config, groups, pipeline).train()
    register_moe_layers(model, groups)
    micro = [(ids[groups.dp.rank::groups.dp.size], labels[groups.dp.rank::groups.dp.size])
             for ids, labels in _batches()]
    loss, recorded, _ = runtime_iteration(model, groups, pipeline, micro)
    params = canonical_parameters(model, config.num_layers)
    return _result(groups, loss, None, params, {n: recorded[id(p)] for n, p in params.items()})


@pytest.fixture(scope="module")
def one_rank():
    return assemble_grads(run_on_ranks(_iteration, 1, {}, {})), run_on_ranks(_iteration, 1, {}, {})[0]["loss"]


@pytest.mark.slow
def test_the_depths_train_without_entering_the_logged_loss_and_each_is_its_shifted_cross_entropy(one_rank):
    import torch.nn.functional as F
    from hybrid.model.gpt import GPTModel
    from hybrid.model.objectives import LanguageModeling, mtp_loss_scale
    from hybrid.parallel.groups import ParallelGroups
    grads, loss = one_rank
    plain_grads = assemble_grads(run_on_ranks(_iteration, 1, {}, {"mtp_num_layers": None}))
    plain_loss = run_on_ranks(_iteration, 1, {}, {"mtp_num_layers": None})[0]["loss"]
    assert loss == plain_loss  # the logged loss is the decoder's
    assert {n for n in grads if n.startswith("mtp.")} and all(grads[n].abs().max() > 0 for n in grads
                                                                 if n.startswith("mtp.0.") and "experts" not in n)
    changed = [n for n in plain_grads if not torch.allclose(plain_grads[n], grads[n], atol=1e-7)]
    assert "embedding.word_embeddings.weight" in changed and "layers.0.attention.q_up.weight" in changed
    # the objective's depths against a direct computation on the model's own logits
    config = deepseek_style()
    model = GPTModel(config, ParallelGroups.single()).train()
    ids, labels = _batches()[0]
    logits = model(ids, stage=0)  # [3 s, b, V]: the decoder's, then depth 1's and 2's
    s = ids.size(1)
    depth_losses = [F.cross_entropy(logits[k * s:(k + 1) * s].transpose(0, 1)[:, :s - k].reshape(-1, VOCAB),
                                    labels[:, k:].reshape(-1)) for k in range(3)]
    objective = LanguageModeling(ParallelGroups.single(), VOCAB, mtp_loss_scale=mtp_loss_scale(config))
    total = objective.loss(logits, labels, None)
    torch.testing.assert_close(total, depth_losses[0])
    model.zero_grad()
    total.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logits = model(ids, stage=0)
    want = sum((0.3 / 2 if k else 1.0) * F.cross_entropy(
        logits[k * s:(k + 1) * s].transpose(0, 1)[:, :s - k].reshape(-1, VOCAB), labels[:, k:].reshape(-1))
        for k in range(3))
    want.backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7)


def test_full_recompute_recomputes_each_depth_and_gives_the_same_loss_and_gradients():
    """--recompute-granularity full (megatron-core checkpoints each MTP layer as it does the decoder's): every
    depth's forward runs again in backward, and the loss and every gradient are those without recompute."""
    from hybrid.model.gpt import GPTModel
    from hybrid.model.objectives import LanguageModeling, mtp_loss_scale
    from hybrid.parallel.groups import ParallelGroups
    ids, labels = _batches()[0]
    results = []
    for recompute in (None, "full"):
        config = deepseek_style(recompute_granularity=recompute, recompute_method="uniform", recompute_num_layers=1)
        model = GPTModel(config, ParallelGroups.single()).train()
        calls = []
        for layer in model.mtp:
            layer.register_forward_hook(lambda *_: calls.append(1))
        objective = LanguageModeling(ParallelGroups.single(), VOCAB, mtp_loss_scale=mtp_loss_scale(config))
        loss = objective.loss(model(ids, stage=0), labels, None)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                        len(calls)))
    (plain, plain_grads, plain_calls), (recomputed, grads, calls) = results
    assert (plain_calls, calls) == (2, 4)  # the two depths, then again in backward
    assert recomputed == plain and plain_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=0, atol=0)


@pytest.mark.slow  # (9 s at TP 2 x EP 2)
@pytest.mark.parametrize("world,layout", [(4, dict(tensor_parallel=2, expert_parallel=2)),
                                          (2, dict(pipeline_parallel=2))], ids=["tp2_sp_ep2", "pp2"])
def test_a_deepseek_v3_style_run_with_mtp_trains_as_at_one_rank(world, layout, one_rank):
    grads, loss = one_rank
    results = run_on_ranks(_iteration, world, layout, {})
    assert all(abs(r["loss"] - loss) <= 1e-6 * loss for r in results), [r["loss"] for r in results]
    compare_grads(assemble_grads(results), grads, VOCAB, 1e-6)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_layers_export_as_deepseek_and_glm_store_them_and_round_trip_bit_identically(family, tmp_path):
    """model.layers.{L + k}.*: the MTP layer's attention, MoE and norms as a decoder layer's, enorm, hnorm,
    eh_proj, shared_head.norm and copies of the embeddings and head; transformers loads the export (ignoring
    those, as it does DeepSeek-V3's layer 61 and GLM-4.5's 92) with the same logits, and the import reads them back
    exactly."""
    import dataclasses
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from hybrid.conversion.hf import read_hf_config, read_hf_dir, write_hf_dir
    from hybrid.model.gpt import GPTModel
    from hybrid.model.naming import canonical_parameters
    from tests.hf_families import make_family
    hf = make_family(family, tmp_path / "hf", tokenizer=False)
    state, config, _ = read_hf_dir(str(tmp_path / "hf"))
    assert config.mtp_num_layers is None  # transformers' save keeps none
    config = dataclasses.replace(config, mtp_num_layers=1)
    model = GPTModel(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    state.update({n: t.detach().clone() for n, t in canonical_parameters(model, 4).items() if n.startswith("mtp.")})
    state["mtp.0.layer.mlp.router.score_bias"] = 0.1 * torch.randn(8)
    write_hf_dir(state, config, str(tmp_path / "out"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(exported["model.layers.4.eh_proj.weight"], state["mtp.0.eh_proj.weight"])
    assert torch.equal(exported["model.layers.4.mlp.gate.e_score_correction_bias"],
                       state["mtp.0.layer.mlp.router.score_bias"])
    assert torch.equal(exported["model.layers.4.shared_head.head.weight"], state["output_layer.weight"])
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and {k.split(".")[2] for k in info["unexpected_keys"]} == {"4"}
    ids = torch.randint(0, 8192, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf.eval()(ids).logits)
    assert read_hf_config(str(tmp_path / "out")).mtp_num_layers == 1
    again, config_again, _ = read_hf_dir(str(tmp_path / "out"))
    assert set(again) == set(state) and all(torch.equal(again[k], state[k]) for k in state)
    write_hf_dir(again, config_again, str(tmp_path / "again"))
    twice = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(twice) == set(exported) and all(torch.equal(twice[k], exported[k]) for k in exported)


@pytest.mark.slow
def test_launched_deepseek_v3_with_mtp_trains_at_tp2_sp_ep2_and_pp2_as_at_one_rank_and_exports(data, tmp_path):
    """launch/train.py --load-hf a DeepSeek-V3 (its MTP layer new: --mtp-num-layers 1): the losses of 4 iterations
    at one rank, at TP 2 + SP x EP 2 and at PP 2 agree, and the run's --export-hf loads in transformers."""
    from transformers import AutoModelForCausalLM
    from tests.hf_families import make_family
    from checks.launch_helpers import read_log, run
    from tests.test_families import TRAIN
    make_family("deepseek_v3", tmp_path / "hf")
    flags = ["--load-hf", tmp_path / "hf", "--data-path", data, "--mtp-num-layers", 1, "--mtp-loss-scaling-factor",
             0.5] + TRAIN
    run("python", 1, flags + ["--log-json", tmp_path / "one.jsonl"])
    run("torchrun", 4, flags + ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                                "--expert-model-parallel-size", 2, "--log-json", tmp_path / "tp_ep.jsonl",
                                "--save", tmp_path / "ckpt", "--export-hf", tmp_path / "export"])
    run("torchrun", 2, flags + ["--pipeline-model-parallel-size", 2, "--log-json", tmp_path / "pp.jsonl"])
    one, tp_ep, pp = ([r["lm_loss"] for r in read_log(tmp_path / f"{n}.jsonl")] for n in ("one", "tp_ep", "pp"))
    assert len(one) == 4 and one[0] != one[-1]
    for other in (tp_ep, pp):
        assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, other)), (one, other)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM" and not info["missing_keys"]
    assert {k.split(".")[2] for k in info["unexpected_keys"]} == {"4"}  # the MTP layer, which transformers skips
