"""The hand-written backward passes against references that share none of their code: torch's
`gradcheck` (finite differences in float64), the plain expression's autograd, transformers' own modules,
and for the whole MoE model the directional derivative of the loss with its auxiliary losses added."""

import pytest
import torch
import torch.nn.functional as F



def _double(*shape, seed=0):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
def test_gated_units_backward_passes_gradcheck_in_float64(kind):
    from hybrid.model import mlp
    y = _double(3, 2, 8).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: getattr(mlp, kind)(t, None), (y,), eps=1e-6, atol=1e-9)
    bias = _double(8, seed=1).requires_grad_()  # the bias added before the gate
    assert torch.autograd.gradcheck(lambda t, b: getattr(mlp, kind)(t, b), (y, bias), eps=1e-6, atol=1e-9)


def test_rotary_backward_passes_gradcheck_in_float64_and_equals_the_plain_expression():
    from hybrid.model.rotary import RotaryEmbedding, apply_rotary, rotate_half
    cos, sin = RotaryEmbedding(8, 10000.0)(5, torch.device("cpu"))
    cos, sin = cos.double(), sin.double()
    x = _double(5, 2, 3, 8).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: apply_rotary(t, cos, sin), (x,), eps=1e-6, atol=1e-9)
    g = _double(5, 2, 3, 8, seed=2)
    ours = torch.autograd.grad((apply_rotary(x, cos, sin) * g).sum(), x)[0]
    plain = torch.autograd.grad(((x * cos + rotate_half(x) * sin) * g).sum(), x)[0]
    torch.testing.assert_close(ours, plain, rtol=0, atol=1e-15)


def test_qkv_split_gradient_is_the_per_head_index_gradient():
    """The attention's split of the fused QKV output (per KV group: its query heads, its key, its value)
    against picking each head's columns by index."""
    from hybrid.model.qkv import split_qkv
    groups, per_group, d = 2, 3, 4
    fused = _double(5, 2, groups * (per_group + 2) * d).requires_grad_()
    g = [_double(5, 2, n, d, seed=i) for i, n in enumerate((groups * per_group, groups, groups))]
    q, k, v = split_qkv(fused, per_group, d, dim=-1)
    ours = torch.autograd.grad(sum((t * w).sum() for t, w in zip((q, k, v), g)), fused)[0]
    view = fused.view(5, 2, groups, per_group + 2, d)
    ref = (view[..., :per_group, :].reshape(5, 2, groups * per_group, d), view[..., per_group, :],
           view[..., per_group + 1, :])
    want = torch.autograd.grad(sum((t * w).sum() for t, w in zip(ref, g)), fused)[0]
    torch.testing.assert_close(ours, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_plus_rmsnorm_forward_and_backward_equal_transformers_gemma_rmsnorm(dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from hybrid.model.norms import RMSNorm
    torch.manual_seed(0)
    ours, theirs = RMSNorm(16, eps=1e-6, one_plus=True), GemmaRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16) * 0.1)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(4, 3, 16).to(dtype)
    outs, grads = [], []
    for norm in (ours, theirs):
        t = x.clone().requires_grad_()
        out = norm(t)
        out.float().pow(2).sum().backward()
        outs.append(out)
        grads.append((t.grad, norm.weight.grad))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-5)


def _float(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _torch_cross_entropy(logits, target, upstream):
    """torch's own cross-entropy (no padding rows), its per-token loss and the logits' gradient."""
    from hybrid.parallel.cross_entropy import IGNORE_INDEX
    logits = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="none").view(target.shape)
    (loss * upstream).sum().backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("padded", [0, 5], ids=["whole_vocabulary", "padded_rows"])
def test_cross_entropy_forward_and_backward_equal_torchs_with_ignored_positions(padded):
    """The fused kernels (fp32, in the logits' memory, single-use backward: gradcheck cannot rerun them)
    against torch's F.cross_entropy and its autograd; padding rows take no probability and no gradient."""
    from hybrid.parallel.collectives import SINGLE_RANK
    from hybrid.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
    logits, upstream = _float(6, 2, 11), _float(6, 2, seed=1)
    target = torch.randint(0, 11, (6, 2), generator=torch.Generator().manual_seed(3))
    target[1, 0] = target[4, 1] = IGNORE_INDEX
    ours = torch.cat([logits, _float(6, 2, padded, seed=4)], dim=-1).requires_grad_()
    loss = vocab_parallel_cross_entropy(ours, target, SINGLE_RANK, vocab_size=11)
    (loss * upstream).sum().backward()
    want, grad = _torch_cross_entropy(logits, target, upstream)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.grad[..., :11], grad, rtol=1e-6, atol=1e-7)
    assert ours.grad[..., 11:].abs().sum() == 0


def _tp2_cross_entropy():
    from hybrid.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
    from hybrid.parallel.groups import build_groups
    groups = build_groups(tensor_parallel=2)
    target = torch.randint(0, 13, (5, 2), generator=torch.Generator().manual_seed(5))
    target[2, 1] = IGNORE_INDEX
    local = _float(5, 2, 16).chunk(2, dim=-1)[groups.tp.rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, groups.tp.group, vocab_size=13)  # 3 padded rows
    (loss * _float(5, 2, seed=6)).sum().backward()
    return loss.detach(), local.grad


def test_vocab_parallel_cross_entropy_at_tp2_equals_torchs_cross_entropy_and_its_gradient():
    from hybrid.parallel.cross_entropy import IGNORE_INDEX
    from checks.rank_pool import run_on_ranks
    results = run_on_ranks(_tp2_cross_entropy, 2)
    target = torch.randint(0, 13, (5, 2), generator=torch.Generator().manual_seed(5))
    target[2, 1] = IGNORE_INDEX
    want, want_grad = _torch_cross_entropy(_float(5, 2, 16)[..., :13], target, _float(5, 2, seed=6))
    grad = torch.cat([results[0][1], results[1][1]], dim=-1)
    for loss, _ in results:
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad[..., :13], want_grad, rtol=1e-6, atol=1e-7)
    assert grad[..., 13:].abs().max() == 0  # the padding rows


def test_aux_loss_backward_gives_the_aux_loss_its_scale_as_gradient():
    from hybrid.model.moe.router import AuxLossBackward
    w = _double(4).requires_grad_()
    out, aux = w * 2.0, (w ** 2).sum()
    grad = torch.autograd.grad((AuxLossBackward.apply(out, aux, 0.375) * 3.0).sum(), w)[0]
    torch.testing.assert_close(grad, 6.0 + 0.375 * 2 * w.detach(), rtol=0, atol=1e-15)


def test_grouped_linear_passes_gradcheck_against_per_expert_matmuls():
    """The grouped GEMM's input and weight gradients equal those of one matmul per expert (fp32: the grouped
    kernel takes no float64), an expert with no rows included."""
    from hybrid.model.moe.experts import GroupedLinear
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(10, 8, generator=g).requires_grad_()
    weights = [torch.randn(4, 8, generator=g).requires_grad_() for _ in range(3)]
    counts, grad = [3, 0, 7], torch.randn(10, 4, generator=g)
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    ours = torch.autograd.grad((GroupedLinear.apply(rows, offsets, *weights) * grad).sum(), [rows, *weights])
    loop = torch.cat([part @ w.t() for part, w in zip(rows.split(counts), weights)])
    want = torch.autograd.grad((loop * grad).sum(), [rows, *weights])
    for got, ref in zip(ours, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def _moe_model_and_batches(**coefficients):
    from hybrid.model.config import ModelConfig
    from hybrid.model.gpt import GPTModel
    config = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32,
                         max_position_embeddings=8, position_embedding_type="rope", normalization="RMSNorm",
                         swiglu=True, add_bias_linear=False, num_experts=4, moe_router_topk=2,
                         moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=8, hidden_dropout=0.0,
                         attention_dropout=0.0, **coefficients)
    g = torch.Generator().manual_seed(11)
    micro = [(torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)) for _ in range(3)]
    return GPTModel(config).train(), micro


def _gradients(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def test_moe_model_gradient_is_that_of_the_loss_with_the_auxiliary_losses_added(monkeypatch):
    """A whole MoE model's gradient over 3 micro-batches as the training step makes it (AuxLossBackward with
    the LM loss's factor, 1 / micro-batches) equals the plain autograd gradient of the mean over micro-batches
    of the LM loss plus every layer's balancing and z losses, the auxiliary losses taken out of the router
    as tensors and added to the loss; at these coefficients they change the gradient."""
    from hybrid.model.moe import router as router_module
    from hybrid.training.moe_hooks import set_aux_loss_scale
    model, micro = _moe_model_and_batches(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.2)
    set_aux_loss_scale(model, 1.0 / len(micro))
    for ids, labels in micro:  # the training step's backward: each micro-batch's loss / micro-batches
        (model(ids, labels) / len(micro)).backward()
    ours = _gradients(model)
    captured = []

    class AddedToTheLoss:  # the reference: the auxiliary losses as tensors, added to the objective below
        @staticmethod
        def apply(output, aux_loss, scale):
            captured.append(aux_loss)
            return output
    monkeypatch.setattr(router_module, "AuxLossBackward", AddedToTheLoss)
    objective = sum(model(ids, labels) for ids, labels in micro) / len(micro)
    assert len(captured) == 2 * len(micro)  # one per MoE layer and micro-batch
    (objective + sum(captured) / len(micro)).backward()
    want = _gradients(model)
    for name in ours:
        torch.testing.assert_close(ours[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    objective = sum(model(ids, labels) for ids, labels in micro) / len(micro)
    objective.backward()  # the LM loss alone
    lm_only = _gradients(model)
    router = "layers.0.mlp.router.weight"
    assert (lm_only[router] - want[router]).abs().max() > 0.1 * want[router].abs().max()


# --- every family's training gradients against transformers' own backward ----------------------------

FAMILY_LAYOUTS = {"tp2_sp": dict(tensor_parallel=2), "pp2": dict(pipeline_parallel=2), "cp2": dict(context_parallel=2),
                  "ulysses2": dict(ulysses=2)}


def _hf_batch(seq=16, batch=2):
    tokens = torch.randint(0, 8192, (batch, seq + 1), generator=torch.Generator().manual_seed(21))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _family_gradients(path: str, layout: str) -> dict:
    """On each rank: the loss and this rank's canonical gradient shards of one backward of the imported
    family (GPTModel at TP 2 + SP, or the runtime's 1F1B over 2 stages or at CP 2), dropout off."""
    import dataclasses

    from hybrid.conversion.hf import read_hf_dir
    from hybrid.conversion.layout import load_full_state
    from hybrid.memory import partition_layers
    from hybrid.model.build import build_model
    from hybrid.model.naming import canonical_parameters
    from hybrid.parallel.groups import build_groups
    from hybrid.pipeline_plan import PipelineSchedule
    from hybrid.training.deepspeed_fixes import register_moe_layers
    from tests.model_harness import _result, runtime_iteration
    state, config, _ = read_hf_dir(path)
    config = dataclasses.replace(config, hidden_dropout=0.0, attention_dropout=0.0,
                                 sequence_parallel=layout == "tp2_sp")
    groups = build_groups(experts=bool(config.num_experts), **FAMILY_LAYOUTS[layout])
    ids, labels = _hf_batch()
    pipeline = PipelineSchedule(partition="uniform")
    if groups.pp.size > 1:
        pipeline = PipelineSchedule(partition="uniform", stage_layers=partition_layers(config, 1, groups.pp.size,
                                                                                     "uniform"))
    model = build_model(config, groups, pipeline).train()
    load_full_state(model, state, config, groups)
    params = canonical_parameters(model, config.num_layers)
    # a frozen parameter (DSA's indexer, which transformers runs without gradient) has a gradient of zeros on both sides
    assert all(p.requires_grad == (".indexer." not in n) for n, p in params.items())
    if layout == "tp2_sp":
        loss = model(ids, labels)
        loss.backward()
        grads, loss = {n: p.grad if p.requires_grad else torch.zeros_like(p) for n, p in params.items()}, loss.item()
    else:
        register_moe_layers(model, groups)
        loss, recorded, _ = runtime_iteration(model, groups, pipeline, [(ids, labels)])
        grads = {n: recorded[id(p)] if p.requires_grad else torch.zeros_like(p) for n, p in params.items()}
    return _result(groups, loss, None, params, grads)


def _transformers_gradients(hf, tmp_path) -> tuple:
    """transformers' loss and gradients on the same batch, under canonical names: the gradients are
    saved in place of the weights by transformers' own save_pretrained and read back by the importer."""
    ids, labels = _hf_batch()
    hf.zero_grad()
    logits = hf(ids).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1))
    loss.backward()
    return loss.item(), _saved_gradients(hf, tmp_path)


def _saved_gradients(hf, tmp_path) -> dict:
    """The gradients of transformers' model `hf` (after a backward) under canonical names: saved in place of the
    weights by transformers' own save_pretrained and read back by the importer."""
    from hybrid.conversion.hf import read_hf_dir
    from hybrid.model.naming import buffer_names
    with torch.no_grad():
        originals = {n: p.detach().clone() for n, p in hf.named_parameters()}
        for p in hf.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))  # (DSA's indexer: run under no_grad)
        hf.save_pretrained(tmp_path / "grads")
        for n, p in hf.named_parameters():
            p.copy_(originals[n])
    grads, config, _ = read_hf_dir(str(tmp_path / "grads"))
    return {n: g for n, g in grads.items() if n not in buffer_names(config)}  # (the score biases)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    from tests.hf_families import FAMILIES, FAMILY_CONFIGS, make_family
    root = tmp_path_factory.mktemp("families")
    # Gemma with 2 KV heads (its MQA's one head does not split over TP 2); Mistral 4's query temperature (and YaRN)
    # from position 8, within the 16 positions
    mistral4_rope = dict(FAMILY_CONFIGS["mistral4"][2]["rope_parameters"], original_max_position_embeddings=8)
    overrides = {"gemma": dict(num_key_value_heads=2), "mistral4": dict(rope_parameters=mistral4_rope)}
    return {family: (root / family, make_family(family, root / family, tokenizer=False, **overrides.get(family, {})))
            for family in FAMILIES}


@pytest.mark.parametrize("family,layout", [
    (family, layout) for family in ["gpt2", "llama3", "qwen2", "qwen3", "mistral", "gemma", "gemma3", "mixtral",
                                    "qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "mistral4",
                                    "minimax_m2", "deepseek_v32", "glm_moe_dsa", "gemma4", "gemma4_moe"]
     for layout in ("tp2_sp", "pp2")]
    + [("qwen3_5", "tp2_sp")]  # (the other Gated DeltaNet cases in the slow tier, below: the whole suite runs them)
    + [pytest.param(family, layout, marks=pytest.mark.slow)
       for family, layout in [("qwen3_5", "pp2"), ("qwen3_5_moe", "tp2_sp"), ("qwen3_5_moe", "pp2"),
                              ("qwen3_next", "tp2_sp"), ("qwen3_next", "pp2"), ("qwen3_5", "cp2"),
                              ("qwen3_next", "cp2"), ("qwen3_5", "ulysses2")]]
    + [("llama3", "cp2"), ("glm4_moe", "cp2"), ("deepseek_v3", "cp2"), ("gemma3", "cp2"), ("gpt_oss", "cp2"),
       ("gemma4", "cp2"), ("gemma4_e", "tp2_sp"), ("gemma4_e", "cp2")])
def test_family_gradients_at_tp2_sp_and_pp2_equal_transformers_backward(family, layout, family_models, tmp_path):
    """One backward of each imported family, TP 2 + SP or PP 2 (DeepSpeed's engine), against transformers'
    own backward on the same batch: the loss and every parameter's gradient (the TP shards joined); CP 2 (the
    ring, the engine reducing over DP x CP) for rope scaled by llama3, rope on part of the head (GLM-4.5), MLA's
    value heads smaller than its query/key heads (DeepSeek-V3), and sliding windows (Gemma 3; GPT-OSS with its sinks:
    windows of 8 over 16 positions in chunks of 4). Mistral 4's query temperature and MiniMax-M2's Q/K norms across
    heads (their statistics summed over TP) included, and DeepSeek-V3.2's sparse attention (top 8 of 16 keys; its
    indexer frozen, as transformers runs it without gradient), GLM-5's index sharing (each stage of PP 2 holding a
    sharing layer and its source), and Gemma 4's full layers with their own head size and KV heads, keys as values,
    proportional rope, layer scalars and soft-capped logits (also at CP 2: windows of 6 over 16 positions), and its
    E2B/E4B form's per-layer inputs and KV-sharing layers (PP refused for them: capability rules) and its 26B-A4B form's
    MoE block; Qwen3.5, Qwen3.5-MoE and Qwen3-Next's Gated DeltaNet layers (their key heads with their value heads
    split over TP, the gated norm's weight summed over TP; at CP 2 and Ulysses 2 each rank mixing the whole sequence
    for half of the heads after an all-to-all) and gated full attention."""
    from tests.model_harness import assemble_grads, compare_grads
    from checks.rank_pool import run_on_ranks
    if family == "gpt2":
        import transformers
        torch.manual_seed(0)
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=8192, n_positions=32, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.05 * torch.randn_like(p))
        path = tmp_path / "gpt2"
        hf.save_pretrained(path)
    else:
        path, hf = family_models[family]
    want_loss, want = _transformers_gradients(hf.eval(), tmp_path)
    results = run_on_ranks(_family_gradients, 2, str(path), layout)
    for r in results:
        assert abs(r["loss"] - want_loss) <= 1e-5 * want_loss, (r["loss"], want_loss)
    scale = max(g.abs().max().item() for g in want.values())
    compare_grads(assemble_grads(results), want, 8192, 2e-5 * scale)
