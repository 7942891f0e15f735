"""The mixture-of-experts block (hybrid.model.moe) against references that share none of its code: a
per-token loop over the chosen experts (forward and every gradient), the balancing losses' closed forms
and transformers' Mixtral load-balancing loss, token dropping against a loop that drops the same tokens."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from hybrid.errors import ConfigError
from hybrid.model.config import ModelConfig
from hybrid.model.mlp import build_moe
from hybrid.model.moe.moe_layer import MoELayer
from hybrid.model.moe.router import capacity_keep, route
from hybrid.training.moe_hooks import set_aux_loss_scale, update_score_bias
from hybrid.parallel.groups import ParallelGroups


def moe_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, swiglu=True,
                  add_bias_linear=False, position_embedding_type="rope", normalization="RMSNorm", num_experts=4,
                  moe_router_topk=2, moe_ffn_hidden_size=12, hidden_dropout=0.0, attention_dropout=0.0, seed=7)
    fields.update(overrides)
    return ModelConfig(**fields)


def expert_out(expert, x, swiglu=True):
    y = x @ expert.fc1.weight.t()
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    else:
        y = F.gelu(y, approximate="tanh")
    return y @ expert.fc2.weight.t()


def reference(layer: MoELayer, x: torch.Tensor, keep=None) -> torch.Tensor:
    """Token by token: scores, the top-k experts, their weighted outputs, plus the shared experts."""
    c = layer.config
    s, b, h = x.shape
    flat = x.reshape(s * b, h)
    outs = []
    for t in range(flat.size(0)):
        logits = (flat[t] @ layer.router.weight.t()).float()
        if c.moe_router_score_function == "softmax":
            p = torch.softmax(logits, dim=-1)
            chosen = sorted(range(c.num_experts), key=lambda e: -float(p[e].detach()))[: c.moe_router_topk]
            w = p[chosen] if c.moe_router_pre_softmax else p[chosen] / p[chosen].sum()
        else:
            p = torch.sigmoid(logits)
            bias = layer.router.score_bias if layer.router.score_bias is not None else torch.zeros_like(p)
            chosen = sorted(range(c.num_experts), key=lambda e: -float((p[e] + bias[e]).detach()))[: c.moe_router_topk]
            w = p[chosen] / p[chosen].sum() if len(chosen) > 1 else p[chosen]
        if c.moe_router_topk_scaling_factor:
            w = w * c.moe_router_topk_scaling_factor
        out = torch.zeros(h)
        for j, e in enumerate(chosen):
            if keep is not None and (t, e) not in keep:
                continue
            out = out + w[j] * expert_out(layer.local_experts[e], flat[t])
        outs.append(out)
    out = torch.stack(outs).view(s, b, h)
    if layer.shared_mlp is not None:
        shared = layer.shared_mlp.fc2.weight
        y = x @ layer.shared_mlp.fc1.weight.t()
        gate, up = y.chunk(2, dim=-1)
        z = (F.silu(gate) * up) @ shared.t()
        if layer.shared_gate is not None:
            z = torch.sigmoid(x @ layer.shared_gate.t()) * z
        out = out + z
    return out


def grads(layer, x, fn, g):
    layer.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    (out * g).sum().backward()
    return out.detach(), x.grad, {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                  for n, p in layer.named_parameters()}


CASES = {
    "softmax-top2": {},
    "softmax-top1": dict(moe_router_topk=1),
    "softmax-pre-top3": dict(moe_router_topk=3, moe_router_pre_softmax=True),
    "sigmoid-top2-bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                              moe_router_topk_scaling_factor=2.5),
    "sigmoid-top1": dict(moe_router_score_function="sigmoid", moe_router_topk=1),
    "shared-gated": dict(moe_shared_expert_intermediate_size=20, moe_shared_expert_gate=True),
    "grouped-gemm": dict(moe_grouped_gemm=True, moe_shared_expert_intermediate_size=8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_layer_equals_a_per_token_loop_over_the_chosen_experts_forward_and_gradients(case, monkeypatch):
    torch.manual_seed(0)
    layer = build_moe(moe_config(**CASES[case]), ParallelGroups.single(), "layers.0.mlp")
    if layer.router.score_bias is not None:  # a bias that changes the choice of some tokens
        layer.router.score_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.25]))
    x, g = torch.randn(5, 3, 16), torch.randn(5, 3, 16)
    calls, grouped_mm = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    out, dx, dw = grads(layer, x, layer, g)
    if CASES[case].get("moe_grouped_gemm"):  # the grouped kernel ran, forward and backward, no silent fallback
        assert layer.grouped_gemm and len(calls) == 2 + 4, calls
    else:
        assert calls == []
    ref, rdx, rdw = grads(layer, x, lambda t: reference(layer, t), g)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-6)
    assert set(dw) == set(rdw)
    for name in dw:
        torch.testing.assert_close(dw[name], rdw[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(n.startswith("deepspeed_moe.experts.deepspeed_experts.3.") for n in dw)


def test_expert_weights_are_drawn_by_global_name_so_an_ep_rank_holds_the_same_experts_as_one_rank():
    config = moe_config()
    whole = build_moe(config, ParallelGroups.single(), "layers.1.mlp")
    from hybrid.parallel.groups import Axis
    from hybrid.parallel import collectives as C
    half = build_moe(config, ParallelGroups(ep=Axis(2, 1, C.SHAPES_ONLY)), "layers.1.mlp")
    assert half.num_local_experts == 2 and half.expert_offset == 2
    for j in range(2):
        torch.testing.assert_close(half.local_experts[j].fc1.weight, whole.local_experts[2 + j].fc1.weight)
    assert all(p.allreduce is False and p.group_name == "ep_size_2" for p in half.deepspeed_moe.parameters())


@pytest.mark.parametrize("padded", [False, True], ids=["dropped", "padded-to-capacity"])
@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_token_dropping_equals_a_loop_dropping_the_lowest_probability_tokens_over_capacity(padded, grouped):
    torch.manual_seed(1)
    config = moe_config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=padded,
                        moe_grouped_gemm=grouped)
    layer = build_moe(config, ParallelGroups.single(), "layers.0.mlp")
    x, g = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    logits = (x.reshape(16, 16) @ layer.router.weight.t()).float()
    probs, indices = route(logits, config)
    capacity = math.ceil(16 * 2 / 4 * 1.0)
    keep = set()
    for e in range(4):  # per expert: the routed tokens by probability, the first `capacity` kept
        routed = [(float(probs[t][list(indices[t]).index(e)]), t) for t in range(16) if e in indices[t]]
        keep |= {(t, e) for _, t in sorted(routed, reverse=True)[:capacity]}
    counts = torch.bincount(indices.flatten(), minlength=4)
    assert counts.max() > capacity > counts.min(), counts  # pairs dropped, and padding where padded
    out, dx, dw = grads(layer, x, layer, g)
    ref, rdx, rdw = grads(layer, x, lambda t: reference(layer, t, keep), g)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-6)
    for name in dw:
        torch.testing.assert_close(dw[name], rdw[name], rtol=1e-5, atol=1e-6, msg=name)
    # the position policy keeps the earliest tokens instead
    kept = capacity_keep(probs, indices, 4, 1.0, "position")
    for e in range(4):
        routed = [t for t in range(16) if e in indices[t]]
        assert {t for t in routed if kept[t][list(indices[t]).index(e)]} == set(routed[:capacity])


def _padded_ep2(padded: bool):
    """Each of 2 EP ranks routes its own 24 tokens through the experts of both: output, input gradient
    and its local experts' gradients (summed over both ranks' tokens before any reduction)."""
    import torch.distributed as dist
    from hybrid.parallel.groups import build_groups
    groups = build_groups(expert_parallel=2, experts=True)
    config = moe_config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=padded,
                        moe_grouped_gemm=True)
    layer = build_moe(config, groups, "layers.0.mlp")
    torch.manual_seed(3 + dist.get_rank())
    x, g = torch.randn(6, 4, 16), torch.randn(6, 4, 16)
    from checks.host_reads import HostReads
    with HostReads() as recorder:
        out, dx, dw = grads(layer, x, layer, g)
    return dict(ep_rank=groups.ep.rank, x=x, g=g, out=out, dx=dx, dw=dw, host_reads=recorder.reads)


def test_padded_all_to_all_at_ep2_equals_one_rank_with_the_same_drops():
    from checks.rank_pool import run_on_ranks
    config = moe_config(moe_expert_capacity_factor=1.0, moe_grouped_gemm=True)
    whole = build_moe(config, ParallelGroups.single(), "layers.0.mlp")
    expert_grads = {}
    ranks = {padded: run_on_ranks(_padded_ep2, 2, padded) for padded in (False, True)}
    for r in ranks[True]:  # capacity 12 of 48 pairs: some experts drop pairs, others are padded
        _, indices = route((r["x"].reshape(24, 16) @ whole.router.weight.t()).float(), config)
        counts = torch.bincount(indices.flatten(), minlength=4)
        assert counts.max() > 12 > counts.min(), counts
        out, dx, dw = grads(whole, r["x"], whole, r["g"])
        torch.testing.assert_close(r["out"], out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["dx"], dx, rtol=1e-5, atol=1e-6)
        for name, grad in dw.items():
            expert_grads[name] = expert_grads.get(name, 0) + grad
    for r in ranks[True]:
        for name, grad in r["dw"].items():
            if ".deepspeed_experts." in name:  # local expert j of EP rank r is global expert 2 r + j
                j = int(name.split(".deepspeed_experts.")[1].split(".")[0])
                name = name.replace(f".deepspeed_experts.{j}.", f".deepspeed_experts.{2 * r['ep_rank'] + j}.")
                torch.testing.assert_close(grad, expert_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    for plain, padded in zip(ranks[False], ranks[True]):  # and the unpadded EP 2 dispatch agrees
        torch.testing.assert_close(padded["out"], plain["out"], rtol=1e-5, atol=1e-6)
        # padded: every all-to-all size is known on the host; unpadded: its sizes are read (one per layer)
        assert padded["host_reads"] == [] and plain["host_reads"].count("tolist") == 1, plain["host_reads"]


def test_dropless_and_padded_dispatch_at_ep1_read_nothing_on_the_host():
    from checks.host_reads import HostReads
    x = torch.randn(6, 4, 16)
    for fields, expected in (({}, []), (dict(moe_expert_capacity_factor=1.0), ["__int__"]),
                             (dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True), [])):
        layer = build_moe(moe_config(moe_grouped_gemm=True, moe_aux_loss_coeff=0.01, **fields),
                          ParallelGroups.single(), "layers.0.mlp")
        with HostReads() as recorder:
            layer(x).square().sum().backward()
        assert layer.grouped_gemm and recorder.reads == expected, (fields, recorder.reads)


def test_padding_to_capacity_needs_a_capacity():
    with pytest.raises(ConfigError, match="--moe-expert-capacity-factor"):
        moe_config(moe_pad_expert_input_to_capacity=True)


def _aux_gradient_check(overrides, closed_form):
    """The router's gradient with the loss attached = without it, plus d(closed form)/d(weights)."""
    torch.manual_seed(2)
    with_loss = build_moe(moe_config(**overrides), ParallelGroups.single(), "layers.0.mlp").train()
    x, g = torch.randn(6, 3, 16), torch.randn(6, 3, 16)
    set_aux_loss_scale(with_loss, 0.25)
    _, _, dw = grads(with_loss, x, with_loss, g)
    plain = {k: v for k, v in overrides.items() if k not in ("moe_aux_loss_coeff", "moe_z_loss_coeff")}
    without = build_moe(moe_config(**plain), ParallelGroups.single(), "layers.0.mlp").train()

    def fn(t):
        out = without(t)
        logits = (t.reshape(18, 16) @ without.router.weight.t()).float()
        return out, closed_form(logits, t.shape)

    without.zero_grad()
    t = x.detach().clone().requires_grad_()
    out, aux = fn(t)
    ((out * g).sum() + 0.25 * aux).backward()
    torch.testing.assert_close(dw["router.weight"], without.router.weight.grad, rtol=1e-5, atol=1e-7)
    logged = with_loss.router.logged
    return aux.detach(), logged


def test_aux_loss_equals_transformers_mixtral_load_balancing_loss_and_reaches_the_router_gradient():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    coeff = 0.01

    def closed(logits, shape):  # Megatron's = coeff x transformers' / k for one layer
        return coeff * load_balancing_loss_func((logits,), 4, 2) / 2

    aux, logged = _aux_gradient_check(dict(moe_aux_loss_coeff=coeff), closed)
    torch.testing.assert_close(logged["load_balancing_loss"], aux)


def test_sequence_aux_loss_is_the_mean_over_sequences_of_the_per_sequence_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    coeff = 0.02

    def closed(logits, shape):
        s, b, _ = shape
        per_sequence = logits.view(s, b, 4).transpose(0, 1)  # [b, s, E]
        return sum(coeff * load_balancing_loss_func((row,), 4, 2) / 2 for row in per_sequence) / b

    aux, logged = _aux_gradient_check(dict(moe_aux_loss_coeff=coeff, moe_router_load_balancing_type="seq_aux_loss"),
                                      closed)
    torch.testing.assert_close(logged["load_balancing_loss"], aux)


def test_z_loss_is_the_mean_squared_logsumexp_of_the_router_logits():
    def closed(logits, shape):
        return 1e-2 * torch.stack([torch.log(torch.exp(row).sum()) ** 2 for row in logits]).mean()

    aux, logged = _aux_gradient_check(dict(moe_z_loss_coeff=1e-2), closed)
    torch.testing.assert_close(logged["z_loss"], aux)


def test_sigmoid_aux_loss_uses_the_normalised_sigmoid_scores():
    coeff, k, E = 0.05, 2, 4

    def closed(logits, shape):
        scores = torch.sigmoid(logits)
        scores = scores / scores.sum(-1, keepdim=True)
        counts = torch.zeros(E)
        for row in scores:
            for e in row.topk(k).indices:
                counts[e] += 1
        T = logits.size(0)
        return E * coeff / (k * T * T) * (scores.sum(0) * counts).sum()

    _aux_gradient_check(dict(moe_aux_loss_coeff=coeff, moe_router_score_function="sigmoid"), closed)


def test_score_bias_moves_towards_balance_by_the_update_rate_after_a_step():
    layer = build_moe(moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                moe_router_bias_update_rate=0.1), ParallelGroups.single(), "layers.0.mlp").train()
    x = torch.randn(6, 2, 16)
    layer(x).sum().backward()
    counts = layer.router.tokens_per_expert.clone()
    assert counts.sum() == 12 * 2
    update_score_bias(layer)
    torch.testing.assert_close(layer.router.score_bias, 0.1 * torch.sign(counts.mean() - counts))
    assert layer.router.tokens_per_expert.sum() == 0
    with torch.no_grad():  # evaluation does not count
        layer(x)
    assert layer.router.tokens_per_expert.sum() == 0


# --- launched: expert parallelism inside DP, with TP + SP and PP, under DeepSpeed's ZeRO --------------

MOE_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
             "--num-experts", 4, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 24,
             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-router-bias-update-rate", 0.01, "--moe-aux-loss-coeff", 0.01, "--moe-z-loss-coeff", 0.001,
             "--moe-shared-expert-intermediate-size", 16, "--moe-grouped-gemm"]
EP2 = ["--expert-model-parallel-size", 2]
MOE_LAYOUTS = {  # name: (ranks, flags); every one must give the one-rank losses of MOE_FLAGS
    "dp2_zero3_ep1": (2, ["--deepspeed", "ds_configs/zero3.json"]),  # experts partitioned over DP like any parameter
    "ep2_tp2_sp_zero1": (4, EP2 + ["--tensor-model-parallel-size", 2, "--sequence-parallel",
                                   "--deepspeed", "ds_configs/zero1.json"]),
    "ep2_pp2_interleaved_zero1": (4, EP2 + ["--pipeline-model-parallel-size", 2,
                                            "--num-virtual-stages-per-pipeline-rank", 2,
                                            "--deepspeed", "ds_configs/zero1.json"]),
    # the sequence split: each CP / Ulysses rank routes its own tokens; expert groups over the DP x CP axis
    "cp2_ep1": (2, ["--context-parallel-size", 2]),
    "ep2_cp2_zero1": (4, EP2 + ["--context-parallel-size", 2, "--deepspeed", "ds_configs/zero1.json"]),
    "ep2_ulysses2_zero2": (4, EP2 + ["--ds-sequence-parallel-size", 2, "--deepspeed", "ds_configs/zero2.json"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_launched_expert_parallel_runs_give_the_one_rank_losses(data, tmp_path, name):
    """8 iterations (sigmoid routing with the score bias updated every step, balancing and z losses,
    shared experts, grouped GEMM): the losses of one rank, within 1e-5; the balancing loss is logged."""
    from checks.launch_helpers import one_rank, read_log, run
    from tests.test_training import TINY, assert_same_losses
    ranks, extra = MOE_LAYOUTS[name]
    baseline = one_rank(TINY + ["--data-path", data] + MOE_FLAGS)
    log = tmp_path / "log.jsonl"
    run("torchrun", ranks, TINY + ["--data-path", data, "--log-json", log] + MOE_FLAGS + extra)
    records = read_log(log)
    assert_same_losses([r["lm_loss"] for r in records], [r["lm_loss"] for r in baseline])
    assert all(r["load_balancing_loss"] > 0 and r["expert_imbalance"] >= 1 for r in records)


@pytest.mark.slow
def test_ep2_without_zero_clips_and_logs_with_the_one_rank_gradient_norm(data, tmp_path):
    """ZeRO-0 at EP 2 with a clip that acts (0.05 against norms near 0.8): each EP rank holds other experts,
    so the norm sums their squares over the EP group; the logged norms and the losses are one rank's."""
    from checks.launch_helpers import one_rank, read_log, run
    from tests.test_training import TINY, assert_same_losses
    clip = ["--clip-grad", 0.05]
    baseline = one_rank(TINY + ["--data-path", data] + MOE_FLAGS + clip)
    log = tmp_path / "log.jsonl"
    run("torchrun", 2, TINY + ["--data-path", data, "--log-json", log] + MOE_FLAGS + clip + EP2)
    records = read_log(log)
    assert_same_losses([r["lm_loss"] for r in records], [r["lm_loss"] for r in baseline])
    for got, want in zip(records, baseline):
        assert want["grad_norm"] > 0.5 and abs(got["grad_norm"] - want["grad_norm"]) <= 1e-6 * want["grad_norm"], (
            got["grad_norm"], want["grad_norm"])


@pytest.mark.slow
def test_ep2_zero2_gives_the_one_rank_losses_and_its_universal_checkpoint_resumes_at_ep1_zero1(data, tmp_path):
    """EP 2 x DP 2 with ZeRO-2 equals one rank for 8 iterations; its checkpoint at 4, made universal (each
    rank's fp32 partitions and Adam moments of DeepSpeed's dense and expert groups, experts by global
    index), resumes at EP 1 with ZeRO-1 with the uninterrupted losses; the score biases come along."""
    from hybrid.conversion.checkpoint_util import main as convert
    from checks.launch_helpers import one_rank, read_log, run
    from tests.test_training import TINY, assert_same_losses
    baseline = [r["lm_loss"] for r in one_rank(TINY + ["--data-path", data] + MOE_FLAGS)]
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    run("torchrun", 2, TINY + ["--data-path", data, "--log-json", log, "--save", ckpt, "--save-interval", 4]
        + MOE_FLAGS + EP2 + ["--deepspeed", "ds_configs/zero2.json"])
    records = read_log(log)
    assert_same_losses([r["lm_loss"] for r in records], baseline)
    assert all(r["load_balancing_loss"] > 0 and r["expert_imbalance"] >= 1 for r in records)
    (ckpt / "latest").write_text("iter_0000004")
    assert convert(["--saver", "universal", "--load-dir", str(ckpt), "--no-progress-bar"]) == 0
    zero = ckpt / "iter_0000004_universal" / "zero"
    assert (zero / "layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3.fc1.weight" / "exp_avg.pt").exists()
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(line for line in open(log).readlines()[:4]))
    run("torchrun", 2, TINY + ["--data-path", data, "--log-json", resumed, "--load", ckpt, "--universal-checkpoint"]
        + MOE_FLAGS + ["--deepspeed", "ds_configs/zero1.json"])
    assert_same_losses([r["lm_loss"] for r in read_log(resumed)], baseline)


@pytest.mark.slow
def test_resume_at_ep2_with_dropout_is_bitwise_equal_to_straight(data, tmp_path):
    """DeepSpeed writes each expert to its own file (by global index) and reads them back on their EP
    ranks; with dropout on and the score bias saved, the resumed losses are the uninterrupted ones."""
    from checks.launch_helpers import read_log, run
    from tests.test_training import TINY
    base = TINY + MOE_FLAGS + EP2 + ["--hidden-dropout", 0.1, "--data-path", data, "--deepspeed",
                                     "ds_configs/zero1.json"]
    straight_log, log, ckpt = tmp_path / "straight.jsonl", tmp_path / "log.jsonl", tmp_path / "ckpt"
    run("torchrun", 2, base + ["--log-json", straight_log, "--save", ckpt, "--save-interval", 4])
    files = sorted(p.name for p in (ckpt / "iter_0000004").iterdir())
    assert "layer_0_expert_3_mp_rank_00_model_states.pt" in files
    (ckpt / "latest").write_text("iter_0000004")
    run("torchrun", 2, base + ["--log-json", log, "--load", ckpt])
    straight, resumed = read_log(straight_log), read_log(log)
    assert [r["iteration"] for r in resumed] == list(range(5, 9))
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in straight[4:]], "bitwise on CPU"


@pytest.mark.slow
def test_load_hf_mixtral_trains_at_ep2_as_at_one_rank_evaluates_to_transformers_at_ep2_and_exports(data, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from tests.hf_families import make_family
    from checks.launch_helpers import read_log, run
    from tests.test_families import TRAIN
    path = tmp_path / "mixtral"
    hf = make_family("mixtral", path)
    flags = ["--load-hf", path, "--data-path", data, "--moe-aux-loss-coeff", 0.01] + TRAIN
    run("python", 1, flags + ["--log-json", tmp_path / "one.jsonl"])
    run("torchrun", 2, flags + EP2 + ["--log-json", tmp_path / "two.jsonl", "--save", tmp_path / "ckpt",
                                      "--export-hf", tmp_path / "export", "--deepspeed", "ds_configs/zero1.json"])
    one, two = ([r["lm_loss"] for r in read_log(tmp_path / p)] for p in ("one.jsonl", "two.jsonl"))
    assert len(one) == 4 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, two)), (one, two)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert type(reloaded).__name__ == "MixtralForCausalLM" and not info["missing_keys"] and not info["unexpected_keys"]
    original = load_file(str(path / "model.safetensors"))
    trained = load_file(str(tmp_path / "export" / "model.safetensors"))
    expert = "model.layers.0.block_sparse_moe.experts.3.w1.weight"
    assert set(trained) == set(original) and not torch.equal(trained[expert], original[expert])
    assert_evaluation_is_transformers_loss(path, hf, data, tmp_path)  # the imported model, experts over 2 ranks


def assert_evaluation_is_transformers_loss(path, hf, data, tmp_path, layouts=(("--expert-model-parallel-size", 2),),
                                          tp2_pp2: bool = False):
    """The HF model at `path` converted, evaluated by launch/evaluate.py with its experts split over 2
    ranks (or each of the 2-rank `layouts`; `tp2_pp2`: also converted to TP 2 x PP 2 and evaluated there with
    sequence parallelism): transformers' loss on the same windows, within 1e-5."""
    from hybrid.conversion.checkpoint_util import main as convert
    from checks.launch_helpers import read_log, run
    from tests.test_conversion import hf_windows_loss
    want = hf_windows_loss(hf, data, 32, 8)
    runs = [("hybrid", 2, []), ("tp2pp2", 4, ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size",
                                            "2"])][:2 if tp2_pp2 else 1]
    for name, _, target in runs:
        assert convert(["--loader", "hf", "--load-dir", str(path), "--save-dir", str(tmp_path / name),
                        "--no-progress-bar", *target]) == 0
    evaluations = [("hybrid", 2, layout) for layout in layouts] + \
        ([("tp2pp2", 4, ("--sequence-parallel",))] if tp2_pp2 else [])
    for i, (name, ranks, layout) in enumerate(evaluations):
        log = tmp_path / f"eval{i}.jsonl"
        run("torchrun", ranks, ["--load", tmp_path / name, "--data-path", data, "--seq-length", 32,
                                "--micro-batch-size", 2, "--eval-iters", 4, *layout, "--log-json", log],
            script="launch/evaluate.py")
        ours = read_log(log)[0]["lm_loss"]
        assert abs(ours - want) <= 1e-5 * abs(want), (name, layout, ours, want)


@pytest.mark.parametrize("extra,world,message", [
    (["--expert-model-parallel-size", 2], 2, "the model has none"),
    (["--num-experts", 3, "--disable-bias-linear", "--expert-model-parallel-size", 2], 2,
     "--num-experts 3 is not divisible by --expert-model-parallel-size 2"),
    (["--num-experts", 4, "--disable-bias-linear", "--tensor-model-parallel-size", 2], 2, "needs --sequence-parallel"),
    (["--num-experts", 4, "--disable-bias-linear", "--moe-router-enable-expert-bias"], 1,
     "needs --moe-router-score-function sigmoid"),
    (["--num-experts", 4, "--disable-bias-linear", "--moe-router-topk", 5], 1, "must be between 1 and --num-experts 4"),
    (["--num-experts", 4, "--disable-bias-linear", "--moe-layer-freq", "[1,0]"], 1, "one 0 or 1 per layer"),
    (["--num-experts", 4, "--disable-bias-linear", "--expert-model-parallel-size", 2, "--zero-stage", 3], 2,
     "ZeRO-3 at --expert-model-parallel-size 1"),
])
def test_moe_refusals_name_the_flags(extra, world, message):
    from hybrid.config import build_run_config
    from hybrid.errors import ConfigError
    from hybrid.flags import build_parser
    from tests.test_capabilities import BASE
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_run_config(build_parser().parse_args([str(f) for f in BASE + extra]), world, 64, eod_token=63)


def test_moe_layer_freq_reads_megatron_s_expressions_without_eval():
    from hybrid.flags import _moe_layer_freq
    assert _moe_layer_freq("2") == 2
    assert _moe_layer_freq("([1]*3+[0])*2") == [1, 1, 1, 0, 1, 1, 1, 0]
    assert _moe_layer_freq("[0,1]") == [0, 1]
    with pytest.raises(Exception):
        _moe_layer_freq("__import__('os').system('true')")


def test_dry_run_counts_each_ep_rank_s_experts_and_their_optimizer_states_over_dp_over_ep():
    from hybrid.memory import MemoryPlan, ZeroSettings, estimate, parameter_inventory, is_expert
    config = moe_config(num_layers=4, vocab_size=256)
    inventory = parameter_inventory(config, 1)
    experts = sum(n for name, (n, _) in inventory.items() if is_expert(name))
    assert experts == 4 * 4 * (2 * 12 * 16 + 16 * 12)  # every layer MoE (--moe-layer-freq 1): 4 x 4 experts
    rows = {ep: estimate(MemoryPlan(model=config, dp=4, ep=ep, seq_length=16, zero=ZeroSettings(stage=1, dp=4)))[0]
            for ep in (1, 2, 4)}
    assert rows[1]["parameters"] - rows[2]["parameters"] == experts // 2
    assert rows[2]["parameters"] - rows[4]["parameters"] == experts // 4
    # ZeRO-1 partitions each rank's experts over DP / EP: the experts' optimizer bytes stay the same per rank
    assert abs(rows[1]["optimizer"] - rows[4]["optimizer"]) < 12 * 64


def test_a_plain_load_at_another_ep_size_with_optimizer_state_is_one_message_naming_both():
    import dataclasses

    from hybrid.checkpoint.client_state import ClientState, SavedLayout
    from hybrid.config import build_run_config
    from hybrid.errors import ConfigError
    from hybrid.flags import build_parser
    from hybrid.training.resume import check_same_layout
    from tests.test_capabilities import BASE
    flags = BASE + ["--num-experts", 4, "--disable-bias-linear", "--deepspeed", "ds_configs/zero1.json"]
    run = build_run_config(build_parser().parse_args([str(f) for f in flags]), 2, 64, eod_token=63)
    saved = ClientState(layout=SavedLayout(tensor_parallel=1, pipeline_parallel=1, data_parallel=2, zero_stage=1,
                                           expert_parallel=2))
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size 2 \(this run: 1.*add --no-load-optim"):
        check_same_layout(saved, run, "/ckpt", "iter_0000004")
    check_same_layout(ClientState(layout=dataclasses.replace(saved.layout, expert_parallel=1)), run, "/ckpt", "x")


def test_score_bias_and_counts_stay_fp32_when_the_engine_casts_the_model_to_bf16():
    from hybrid.training.moe_hooks import keep_fp32_buffers
    layer = build_moe(moe_config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
                      ParallelGroups.single(), "layers.0.mlp").bfloat16()  # as DeepSpeed's bf16 engine does
    assert layer.router.score_bias.dtype == torch.bfloat16
    keep_fp32_buffers(layer)
    assert layer.router.score_bias.dtype == layer.router.tokens_per_expert.dtype == torch.float32
    assert layer.router.weight.dtype == torch.bfloat16
    layer.train()(torch.randn(4, 2, 16, dtype=torch.bfloat16)).float().sum().backward()
    assert "router.score_bias" in layer.state_dict() and layer.router.tokens_per_expert.sum() == 16


def test_grouped_linear_backward_falls_back_to_a_loop_with_the_same_gradients(monkeypatch):
    from hybrid.model.moe.experts import GroupedLinear
    g = torch.Generator().manual_seed(3)
    rows, grad = torch.randn(10, 8, generator=g), torch.randn(10, 4, generator=g)
    weights = [torch.randn(4, 8, generator=g).requires_grad_() for _ in range(3)]
    offsets = torch.tensor([3, 3, 10], dtype=torch.int32)  # an expert with no rows

    def grads():
        x = rows.clone().requires_grad_()
        (GroupedLinear.apply(x, offsets, *weights) * grad).sum().backward()
        out = [x.grad] + [w.grad.clone() for w in weights]
        for w in weights:
            w.grad = None
        return out
    want = grads()
    real = torch._grouped_mm
    calls = []

    def refuse_in_backward(*args, **kwargs):  # a device whose kernel runs the forward only
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("no kernel for this layout")
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_grouped_mm", refuse_in_backward)
    got = grads()
    assert len(calls) == 2  # the forward's GEMM, then the backward's attempt
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_evaluates_to_transformers_loss_with_its_experts_split_over_2_ranks(family, data, tmp_path):
    """Shared expert with its gate and a dense layer (Qwen2-MoE), MoE every second layer with Q/K norms
    (Qwen3-MoE): launch/evaluate.py at EP 2 gives transformers' loss on the same windows."""
    from tests.hf_families import make_family
    hf = make_family(family, tmp_path / "hf", tokenizer=False)
    assert_evaluation_is_transformers_loss(tmp_path / "hf", hf, data, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "gpt_oss", "mistral4", "minimax_m2", "deepseek_v32",
                                    "glm_moe_dsa", "gemma4_moe"])
def test_frontier_moe_families_evaluate_to_transformers_loss_at_ep2_cp2_and_tp2_sp_pp2(family, data,
                                                                                                   tmp_path):
    """GLM-4.5 (partial rope, score-biased group-limited sigmoid routing, a shared expert, a dense first layer),
    DeepSeek-V3 (MLA, YaRN, the same MoE), GPT-OSS (sinks, windows, biased experts, the clamped quick-GeGLU),
    Mistral 4 (MLA with Llama 4's query temperature past 16 of the 32 positions, a scaled softmax router) and
    MiniMax-M2 (Q/K norms across heads, which TP splits: their statistics summed over TP): launch/evaluate.py at
    EP 2, at CP 2 (the ring; GPT-OSS's sinks on its merged output and its windowed layers' blocks masked; each rank
    scaling its queries by their own positions) and at TP 2 + SP x PP 2 gives transformers' loss on the same
    windows. DeepSeek-V3.2 (its sparse attention choosing 8 of the 32 keys) and GLM-5 (its layers sharing their
    indexers' choice) at EP 2 and TP 2 + SP x PP 2; CP is refused with them (tests/test_capabilities.py). Gemma 4's
    26B-A4B form (its MoE block beside each dense MLP, the router's own input norm and scales) at all three."""
    from tests.hf_families import make_family
    hf = make_family(family, tmp_path / "hf", tokenizer=False)  # (its score biases random, as its norms)
    layouts = [("--expert-model-parallel-size", 2)] + \
        ([] if family in ("deepseek_v32", "glm_moe_dsa") else [("--context-parallel-size", 2)])
    assert_evaluation_is_transformers_loss(tmp_path / "hf", hf, data, tmp_path, layouts, tp2_pp2=True)


@pytest.mark.parametrize("experts,k,groups,chosen,function", [(16, 4, 4, 2, "sigmoid"), (16, 6, 4, 2, "sigmoid"),
                                                              (12, 3, 3, 1, "softmax"), (8, 2, 4, 1, "sigmoid")])
def test_group_limited_routing_equals_megatron_core_and_where_both_define_it_transformers(experts, k, groups, chosen,
                                                                                           function):
    """--moe-router-num-groups / --moe-router-group-topk: megatron-core's own topk_routing_with_score_function
    (groups scored by their top k // g), with the score bias and scaling; and DeepSeek-V3's / GLM-4.5's router in
    transformers (groups scored by their top 2) where k // g = 2."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    torch.manual_seed(experts + k)
    sigmoid = function == "sigmoid"
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, add_bias_linear=False,
                         num_experts=experts, moe_router_topk=k, moe_router_num_groups=groups,
                         moe_router_group_topk=chosen, moe_router_score_function=function,
                         moe_router_enable_expert_bias=sigmoid, moe_router_topk_scaling_factor=2.5)
    logits, bias = torch.randn(64, experts), 0.2 * torch.randn(experts) if sigmoid else None
    probs, indices = route(logits, config, bias)
    want_probs, want_map = topk_routing_with_score_function(
        logits, k, num_groups=groups, group_topk=chosen, scaling_factor=2.5, score_function=function,
        expert_bias=bias)
    dense = torch.zeros(64, experts).scatter(1, indices, probs)
    assert torch.equal(dense != 0, want_map)
    torch.testing.assert_close(dense, want_probs, rtol=1e-6, atol=1e-7)
    grouped = route(logits, dataclasses.replace(config, moe_router_num_groups=None, moe_router_group_topk=None), bias)
    assert not torch.equal(grouped[1].sort(-1).values, indices.sort(-1).values)  # the groups restrict the choice
    if sigmoid and k // chosen == 2:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
        hf = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=16, n_routed_experts=experts, num_experts_per_tok=k,
                                                   n_group=groups, topk_group=chosen, routed_scaling_factor=2.5,
                                                   norm_topk_prob=True))
        x = torch.randn(64, 16)
        with torch.no_grad():
            hf.weight.normal_()
            hf.e_score_correction_bias.copy_(bias)
            probs, indices = route(x @ hf.weight.t(), config, bias)
            _, hf_weights, hf_indices = hf(x)
        order, hf_order = indices.argsort(-1), hf_indices.argsort(-1)
        assert torch.equal(indices.gather(1, order), hf_indices.gather(1, hf_order))
        torch.testing.assert_close(probs.gather(1, order), hf_weights.gather(1, hf_order), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("function,pre_softmax,groups", [("softmax", False, None), ("softmax", True, None),
                                                          ("sigmoid", False, None), ("sigmoid", False, 4)])
def test_replayed_routing_weighs_the_recorded_experts_as_megatron_cores_router_replay(function, pre_softmax, groups):
    """--moe-routing-replay's router: the recorded experts [T, k] are the choice, weighed from the live logits as
    megatron-core's RouterReplay (REPLAY_FORWARD) weighs them in its own topk_routing_with_score_function (softmax
    after or before the top-k, sigmoid with the score bias, group-limited, the scaling factor); a row recorded as -1
    keeps the live choice bitwise, and the rows whose live choice was another set are the ones counted."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from hybrid.model.moe.router import replayed
    torch.manual_seed(7)
    experts, k, tokens = 16, 4, 48
    sigmoid = function == "sigmoid"
    config = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, add_bias_linear=False,
                         num_experts=experts, moe_router_topk=k, moe_router_score_function=function,
                         moe_router_pre_softmax=pre_softmax, moe_router_num_groups=groups,
                         moe_router_group_topk=2 if groups else None, moe_router_enable_expert_bias=sigmoid,
                         moe_router_topk_scaling_factor=2.5)
    logits, bias = torch.randn(tokens, experts), 0.2 * torch.randn(experts) if sigmoid else None
    live = route(logits, config, bias)
    recorded = torch.rand(tokens, experts).argsort(dim=-1)[:, :k]
    recorded[:4] = live[1][:4]  # tokens the generator routed as the trainer does
    replay = recorded.to(torch.int16)
    replay[-5:] = -1  # tokens the generator recorded nothing for (padding)
    probs, indices, was_recorded, differ = replayed(logits, live, replay, config)
    replay_data = RouterReplay()
    try:
        replay_data.set_target_indices(recorded)
        replay_data.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        want_probs, want_map = topk_routing_with_score_function(
            logits, k, use_pre_softmax=pre_softmax, num_groups=groups, group_topk=2 if groups else None,
            scaling_factor=2.5, score_function=function, expert_bias=bias, router_replay=replay_data)
    finally:
        RouterReplay.clear_global_router_replay_instances()
    dense = torch.zeros(tokens, experts).scatter(1, indices, probs)
    assert torch.equal(indices[:-5], recorded[:-5]) and torch.equal(dense[:-5] != 0, want_map[:-5])
    torch.testing.assert_close(dense[:-5], want_probs[:-5], rtol=1e-6, atol=1e-7)
    assert torch.equal(indices[-5:], live[1][-5:]) and torch.equal(probs[-5:], live[0][-5:])
    assert torch.equal(probs[:4], live[0][:4])  # the same choice weighs bitwise as route's own
    assert was_recorded.tolist() == [True] * (tokens - 5) + [False] * 5
    same = (live[1].sort(-1).values == recorded.sort(-1).values).all(-1)
    assert differ.tolist() == (~same & was_recorded).tolist() and differ[4:-5].all()


def test_router_dtype_fp32_gives_transformers_deepseek_router_logits_in_bf16_and_the_import_sets_it():
    """--moe-router-dtype fp32 (megatron-core's; what --load-hf of DeepSeek-V3 and GLM-4.5 sets): under bf16 the
    router's GEMM runs on fp32 casts, as transformers' DeepseekV3TopkRouter computes its logits, bit for bit; without
    it the GEMM runs in bf16 (Mixtral's and Qwen's routers), which differs."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from hybrid.conversion.families import DeepseekV3Adapter
    from hybrid.model.moe.router import Router
    from tests.hf_families import COMMON, FAMILY_CONFIGS
    hf_config = transformers.DeepseekV3Config(**{**COMMON, **FAMILY_CONFIGS["deepseek_v3"][2], "hidden_size": 64,
                                                 "n_group": 1, "topk_group": 1})
    assert DeepseekV3Adapter.config_from_hf(hf_config).moe_router_dtype == "fp32"
    hf = DeepseekV3TopkRouter(hf_config).to(torch.bfloat16)
    torch.nn.init.normal_(hf.weight, std=0.5)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = hf(x)
    want = want[0] if isinstance(want, tuple) else want  # (the logits)
    got = {}
    for dtype in ("fp32", None):
        router = Router(moe_config(hidden_size=64, num_experts=8, moe_router_dtype=dtype,
                                   moe_router_score_function="sigmoid"), ParallelGroups.single(), "router").eval()
        router.to(torch.bfloat16).weight.data.copy_(hf.weight.data)
        got[dtype] = router(x, 64)[2]
    assert want.dtype == got["fp32"].dtype == torch.float32
    assert torch.equal(got["fp32"], want)
    assert not torch.equal(got[None], want)
    with pytest.raises(ConfigError, match="--moe-router-dtype fp64: only fp32"):
        moe_config(moe_router_dtype="fp64")
