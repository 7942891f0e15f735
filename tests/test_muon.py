"""--optimizer muon against torch.optim.Muon itself: an imported HF Llama trained by the engine gives the losses of
transformers trained with torch.optim.Muon on its q, k, v, o, gate, up and down matrices and torch.optim.AdamW on
the rest, batch for batch, at one rank, DP 2 (ZeRO-0, and ZeRO-1/2/3's partitions: each matrix gathered and
orthogonalized on one owner rank), TP 2 + SP and PP 2; resumes are bitwise (the momentum buffers are in the
checkpoint, partitioned under ZeRO); what cannot be made exact is refused by the capability table."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.hf_families import make_family
from checks.launch_helpers import read_log, run

SEQ = 16
LR = 0.01
RUN = ["--seq-length", SEQ, "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 5, "--lr", LR,
       "--lr-decay-style", "constant", "--lr-warmup-iters", 0, "--weight-decay", 0.1, "--clip-grad", 0,
       "--hidden-dropout", 0, "--attention-dropout", 0, "--eval-iters", 0, "--log-interval", 1, "--no-progress-bar",
       "--split", "100,0,0"]


@pytest.fixture(scope="module")
def reference(llama):
    """transformers + torch.optim.Muon + AdamW's five losses (once for the module)."""
    return transformers_with_muon(llama["hf"], llama["window"], 5, LR, 0.1)


def close(ours: list, want: list, tolerance: float = 1e-4) -> bool:
    return len(ours) == len(want) and all(abs(a - b) <= tolerance * abs(b) for a, b in zip(ours, want))


def close_routed(ours: list, want: list, start: float, share: float = 0.01) -> bool:
    """An MoE run against its reference: within 1e-4 plus `share` of how far training has moved the loss since
    `start`. Top-k routing is discontinuous: weights that differ in their last bits (torch's Newton-Schulz runs in
    bf16, and another CPU's kernels sum in another order) send a few tokens to other experts, which moves the loss by
    a small part of the training's own change (seen: 1.2e-3 of 2.26 after 4 steps on an AMD EPYC, 0 on the machine
    the test was written on); a wrong update (AdamW's, or Newton-Schulz over stacked experts) misses by far more."""
    return len(ours) == len(want) and all(abs(a - b) <= 1e-4 * abs(b) + share * abs(b - start)
                                          for a, b in zip(ours, want))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny HF Llama 3 (untied head, GQA) and a corpus whose every window is the same SEQ + 1 tokens (one
    document repeating a SEQ-token pattern: the samples' order cannot matter)."""
    from hybrid.data.indexed import IndexedDatasetBuilder
    root = tmp_path_factory.mktemp("muon")
    make_family("llama3", root / "hf", tie_word_embeddings=False)
    pattern = np.random.RandomState(3).randint(10, 2000, size=SEQ)
    builder = IndexedDatasetBuilder(str(root / "corpus_text_document"), dtype=np.uint16)
    builder.add_document(np.tile(pattern, 64))
    builder.finalize()
    window = torch.from_numpy(np.concatenate([pattern, pattern[:1]]).astype(np.int64))
    return {"hf": root / "hf", "data": str(root / "corpus_text_document"), "window": window}


def transformers_with_muon(path, window, iterations: int, lr: float, weight_decay: float) -> list[float]:
    """transformers' model trained on `window` (every sample of the batch) with torch.optim.Muon (its defaults) on
    each layer's q, k, v, o, gate, up and down matrix (an MoE layer's: every expert's gate, up and down, which
    transformers stores stacked in 3-D tensors: torch's Muon steps a 2-D copy of each, its gradient copied in and
    the result copied back) and torch.optim.AdamW on the embedding, the head, the router and the norms (weight
    decay on the matrices, none on norms: Megatron-LM's rule): the losses before each step."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    named = dict(model.named_parameters())
    router = {n for n in named if n.endswith("mlp.gate.weight")}
    matrices = [p for n, p in named.items() if n.startswith("model.layers.") and p.dim() == 2 and n not in router]
    stacked = {n: p for n, p in named.items() if p.dim() == 3}  # experts: gate_up_proj [E, 2f, h], down_proj [E, h, f]
    slices = []  # (stacked tensor, expert, rows, its 2-D copy)
    for n, p in stacked.items():
        for e in range(p.shape[0]):
            for rows in torch.arange(p.shape[1]).chunk(2 if n.endswith("gate_up_proj") else 1):
                slices.append((p, e, rows, torch.nn.Parameter(p.detach()[e, rows].clone())))
    norms = [p for p in named.values() if p.dim() == 1]
    others = [p for n, p in named.items() if p.dim() == 2 and (not n.startswith("model.layers.") or n in router)]
    muon = torch.optim.Muon(matrices + [c for *_, c in slices], lr=lr, weight_decay=weight_decay)
    adamw = torch.optim.AdamW([{"params": others, "weight_decay": weight_decay},
                               {"params": norms, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for _ in range(iterations):
        loss = model(window[None], labels=window[None]).loss
        losses.append(loss.item())
        loss.backward()
        for p, e, rows, copy in slices:
            copy.grad = p.grad[e, rows].clone()
        muon.step()
        adamw.step()
        with torch.no_grad():
            for p, e, rows, copy in slices:
                p[e, rows] = copy
        muon.zero_grad()
        adamw.zero_grad()
        for p in stacked.values():
            p.grad = None
    return losses


@pytest.mark.slow
def test_muon_trains_an_imported_llama_as_transformers_with_torch_muon_and_adamw(llama, reference, tmp_path):
    """Five iterations at one rank equal transformers + torch.optim.Muon + AdamW within 1e-4 (fused QKV and gate/up
    split into their HF matrices for the update), and clearly differ from the AdamW run of the same flags."""
    flags = ["--load-hf", llama["hf"], "--data-path", llama["data"], *RUN]
    muon, adam = tmp_path / "muon.jsonl", tmp_path / "adam.jsonl"
    proc = run("python", 1, flags + ["--optimizer", "muon", "--log-json", muon])
    assert "torch.optim.Muon on 28 matrices (16 weights" in proc.stdout + proc.stderr
    run("python", 1, flags + ["--log-json", adam])
    ours = [r["lm_loss"] for r in read_log(muon)]
    adamw = [r["lm_loss"] for r in read_log(adam)]
    want = reference
    assert len(ours) == 5 and close(ours, want), (ours, want)
    assert ours[0] == adamw[0] and abs(ours[-1] - adamw[-1]) > 100 * 1e-4 * abs(adamw[-1]), (ours, adamw)


@pytest.mark.slow
def test_muon_at_dp2_equals_one_rank_and_resumes_bitwise(llama, tmp_path):
    """DP 2 (ZeRO-0: each rank steps the whole matrices with the all-reduced gradients) gives the one-rank losses;
    a run resumed from its iteration-2 checkpoint continues bitwise (Muon's momentum buffers and AdamW's moments
    saved and loaded)."""
    flags = ["--load-hf", llama["hf"], "--data-path", llama["data"], *RUN, "--optimizer", "muon"]
    one, two, resumed = (tmp_path / f"{n}.jsonl" for n in ("one", "two", "resumed"))
    run("python", 1, flags + ["--log-json", one])
    run("torchrun", 2, flags + ["--log-json", two, "--save", tmp_path / "ckpt", "--save-interval", 2])
    (tmp_path / "ckpt" / "latest").write_text("iter_0000002")
    run("torchrun", 2, flags + ["--log-json", resumed, "--load", tmp_path / "ckpt"])
    a, b, c = ([r["lm_loss"] for r in read_log(p)] for p in (one, two, resumed))
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)) and len(b) == 5, (a, b)
    assert c == b[2:], (b, c)
    # without ZeRO torch's Muon state is per HF matrix: no universal form, one message
    from hybrid.conversion.checkpoint_util import main
    assert main(["--saver", "universal", "--load-dir", str(tmp_path / "ckpt"), "--no-progress-bar"]) != 0
    assert not list((tmp_path / "ckpt").glob("*_universal"))


@pytest.mark.parametrize("flags,rule", [(["--bf16"], "muon-precision")])
def test_what_muon_cannot_do_exactly_yet_is_refused_by_the_capability_table(flags, rule):
    from hybrid.capabilities import RefusedCombination
    from hybrid.training.run import run_training
    base = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--optimizer", "muon",
            "--dry-run-world-size", 2]
    with pytest.raises(RefusedCombination) as refused:
        run_training([str(f) for f in base + flags])
    assert refused.value.rule == rule and "--optimizer muon" in str(refused.value)


def test_muon_flags_without_muon_and_a_factor_torch_has_not_are_one_message():
    from hybrid.errors import ConfigError
    from hybrid.training.run import run_training
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--dry-run-world-size", "1"]
    with pytest.raises(ConfigError, match="--muon-momentum set Muon: add --optimizer muon"):
        run_training(base + ["--muon-momentum", "0.9"])
    with pytest.raises(ConfigError, match="--muon-extra-scale-factor 2.0: torch.optim.Muon's update has no extra"):
        run_training(base + ["--optimizer", "muon", "--muon-extra-scale-factor", "2"])


def test_the_fused_projections_rows_are_the_hf_matrices():
    """muon_rows: the fused QKV's q, k and v rows (hybrid.model.qkv's layout) and fc1's gate and up rows give back
    exactly the HF weights fused into them."""
    from hybrid.model.config import ModelConfig
    from hybrid.model.qkv import fuse_qkv
    from hybrid.training.muon import muon_rows
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                         max_position_embeddings=16, swiglu=True)
    q, k, v = torch.randn(32, 32), torch.randn(16, 32), torch.randn(16, 32)
    fused = fuse_qkv(q, k, v, 2)
    rows = muon_rows("layers.0.attention.qkv.weight", fused, config)
    assert all(torch.equal(fused[r], t) for r, t in zip(rows, (q, k, v)))
    gate, up = torch.randn(64, 32), torch.randn(64, 32)
    rows = muon_rows("layers.0.mlp.fc1.weight", torch.cat([gate, up]), config)
    assert torch.equal(torch.cat([gate, up])[rows[0]], gate) and torch.equal(torch.cat([gate, up])[rows[1]], up)
    assert muon_rows("layers.0.mlp.fc2.weight", torch.randn(32, 64), config) == [None]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_dry_run_counts_muons_state_as_the_optimizer_holds_it(moe):
    """hybrid.memory's Muon bytes equal the state the optimizer holds after a step: torch's Muon momentum buffers,
    the fused matrices' parts (their rows and gradients; every expert's gated fc1 too), torch's AdamW moments and
    steps (the router's among them)."""
    from hybrid.memory import _muon_state_bytes, parameter_inventory
    from hybrid.model.build import build_model
    from hybrid.model.config import ModelConfig
    from hybrid.parallel.groups import ParallelGroups
    from hybrid.training.muon import MuonWithAdamW
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                         max_position_embeddings=16, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                         position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                         **(dict(num_experts=2, moe_router_topk=1, moe_ffn_hidden_size=24) if moe else {}))
    model = build_model(config, ParallelGroups.single())
    params = [p for p in model.parameters()]
    optimizer = MuonWithAdamW(model, config, 2, [{"params": params, "weight_decay": 0.1}], 1e-3, 0.1, (0.9, 0.999),
                              1e-8, 0.95, True, 5, "original")
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    states = [*optimizer.adamw.state.values(), *optimizer.muon.state.values()]
    held = sum(t.nbytes for s in states for t in s.values() if torch.is_tensor(t))
    held += 2 * sum(part.nbytes for _, _, _, part in optimizer.parts)  # the rows and, during the step, their gradients
    want = _muon_state_bytes(parameter_inventory(config, 1), config)
    assert want["optimizer"] == held and want["params"] == 4 * sum(p.numel() for p in params)


@pytest.mark.slow
def test_muon_under_zero_equals_transformers_and_resumes_bitwise(llama, reference, tmp_path):
    """DP 2 with ZeRO-1, 2 and 3, and ZeRO-1 and 3 with optimizer offload (DeepSpeed's flat partitions: the momentum
    partitioned, each matrix's blend gathered and orthogonalized by torch's Newton-Schulz on one owner rank, the
    update reduce-scattered): transformers + torch.optim.Muon + AdamW's losses within 1e-4; ZeRO-3 resumed from its
    iteration-2 checkpoint continues
    bitwise (the partitioned momentum saved and loaded)."""
    flags = ["--load-hf", llama["hf"], "--data-path", llama["data"], *RUN, "--optimizer", "muon"]
    losses = {}
    # ZeRO-2 with DeepSpeed's round-robin gradient order, ZeRO-3 in small sub-groups (one step call each), and
    # optimizer offload (the partitions and their step on the host)
    configs = {1: {}, 2: {"round_robin_gradients": True}, 3: {"sub_group_size": 3000},
               "1_offload": {"offload_optimizer": {"device": "cpu"}},
               "3_offload": {"offload_optimizer": {"device": "cpu"}}}
    for stage, extra in configs.items():
        log = tmp_path / f"zero{stage}.jsonl"
        save = ["--save", tmp_path / "ckpt", "--save-interval", 2] if stage == 3 else []
        config = tmp_path / f"zero{stage}.json"
        config.write_text(json.dumps({"zero_optimization": {"stage": int(str(stage)[0]), **extra}}))
        zero = ["--deepspeed", config]
        proc = run("torchrun", 2, flags + zero + ["--log-json", log, *save])
        assert "Newton-Schulz on one owner rank per matrix" in proc.stdout + proc.stderr
        losses[stage] = [r["lm_loss"] for r in read_log(log)]
        assert close(losses[stage], reference), (stage, losses[stage], reference)
    assert losses["1_offload"] == losses[1]  # the same update, stepped on the host
    (tmp_path / "ckpt" / "latest").write_text("iter_0000002")
    resumed = tmp_path / "resumed.jsonl"
    run("torchrun", 2,
        flags + ["--deepspeed", tmp_path / "zero3.json", "--log-json", resumed, "--load", tmp_path / "ckpt"])
    assert [r["lm_loss"] for r in read_log(resumed)] == losses[3][2:], (losses[3], read_log(resumed))
    # the momentum carried to another layout: DeepSpeed's universal checkpoint (its exp_avg), resumed at TP 2 + SP
    # ZeRO-1 from the ZeRO-3 DP 2 checkpoint, continues as transformers does
    from hybrid.conversion.checkpoint_util import main
    assert main(["--saver", "universal", "--load-dir", str(tmp_path / "ckpt"), "--no-progress-bar"]) == 0
    assert (tmp_path / "ckpt" / "iter_0000002_universal" / "zero" / "layers.0.mlp.fc1.weight" / "exp_avg.pt").exists()
    universal = tmp_path / "universal.jsonl"
    run("torchrun", 2, flags + ["--zero-stage", 1, "--tensor-model-parallel-size", 2, "--sequence-parallel",
                                "--load", tmp_path / "ckpt", "--universal-checkpoint", "--log-json", universal])
    moved = [r["lm_loss"] for r in read_log(universal)]
    assert close(moved, reference[2:]), (moved, reference)
    # Muon's momentum is not Adam's moments: an AdamW run refuses it with one message
    adam = [f for f in flags if f not in ("--optimizer", "muon")]
    proc = run("python", 1, adam + ["--zero-stage", 1, "--load", tmp_path / "ckpt", "--universal-checkpoint"],
               check=False)
    assert proc.returncode != 0 and "its optimizer state is Muon's momentum" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_muon_at_pp2_equals_transformers_and_resumes_bitwise(llama, reference, tmp_path):
    """PP 2 (each stage's optimizer steps its own layers' matrices): transformers + torch.optim.Muon + AdamW within
    1e-4, and a resume from iteration 2 continues bitwise."""
    flags = ["--load-hf", llama["hf"], "--data-path", llama["data"], *RUN, "--optimizer", "muon",
             "--pipeline-model-parallel-size", 2]
    first, resumed = tmp_path / "pp2.jsonl", tmp_path / "resumed.jsonl"
    run("torchrun", 2, flags + ["--log-json", first, "--save", tmp_path / "ckpt", "--save-interval", 2])
    losses = [r["lm_loss"] for r in read_log(first)]
    assert close(losses, reference), (losses, reference)
    (tmp_path / "ckpt" / "latest").write_text("iter_0000002")
    run("torchrun", 2, flags + ["--log-json", resumed, "--load", tmp_path / "ckpt"])
    assert [r["lm_loss"] for r in read_log(resumed)] == losses[2:]


@pytest.mark.slow
def test_muon_trains_an_moe_model_as_transformers_at_ep2_and_under_zero(llama, tmp_path):
    """An imported HF Mixtral (4 experts, top-2): every expert's gate, up and down is a Muon matrix of its own (the
    router and norms take AdamW); one rank, EP 2 (each rank steps its own experts) and EP 2 under ZeRO-1 (the
    experts' partitions over their own data-parallel group) equal transformers + torch.optim.Muon + AdamW within
    1e-4 and 1% of the loss's own change (close_routed; transformers stacks the experts: its reference steps a 2-D
    copy of each)."""
    make_family("mixtral", tmp_path / "hf", tie_word_embeddings=False)
    want = transformers_with_muon(tmp_path / "hf", llama["window"], 5, LR, 0.1)
    flags = ["--load-hf", tmp_path / "hf", "--data-path", llama["data"], *RUN, "--optimizer", "muon",
             "--moe-aux-loss-coeff", 0]
    save = ["--save", tmp_path / "ckpt", "--save-interval", 2]
    for launcher, ranks, extra in (("python", 1, []), ("torchrun", 2, ["--expert-model-parallel-size", 2]),
                                   ("torchrun", 2, ["--expert-model-parallel-size", 2, "--zero-stage", 1, *save])):
        log = tmp_path / f"{ranks}_{len(extra)}.jsonl"
        proc = run(launcher, ranks, flags + extra + ["--log-json", log])
        losses = [r["lm_loss"] for r in read_log(log)]
        assert close_routed(losses, want, want[0]), (extra, losses, want)
    # 4 layers: q, k, v, o, 2 experts x 3
    assert "Muon's update on 40 matrices (24 weights" in proc.stdout + proc.stderr
    # the experts' momentum through a universal checkpoint: EP 2 ZeRO-1's iteration 2 resumed at one rank
    (tmp_path / "ckpt" / "latest").write_text("iter_0000002")
    from hybrid.conversion.checkpoint_util import main
    assert main(["--saver", "universal", "--load-dir", str(tmp_path / "ckpt"), "--no-progress-bar"]) == 0
    log = tmp_path / "universal.jsonl"
    run("python", 1,
        flags + ["--zero-stage", 1, "--load", tmp_path / "ckpt", "--universal-checkpoint", "--log-json", log])
    moved = [r["lm_loss"] for r in read_log(log)]
    assert close_routed(moved, want[2:], want[0]), (moved, want)


@pytest.mark.slow
def test_muon_at_tp2_with_sp_equals_transformers(llama, reference, tmp_path):
    """TP 2 + SP: each matrix's rows (QKV, gate and up) or columns (o, down) gathered over TP, Newton-Schulz on the
    whole matrix, each rank keeping its slice; at ZeRO-0 (every rank steps every matrix) and at ZeRO-1 and ZeRO-3
    (the owner rank's TP group gathers it): transformers + torch.optim.Muon + AdamW within 1e-4. torch's Newton-Schulz
    runs in bf16, so the TP reductions' last-bit differences in the gradient flip bf16 roundings of the update
    (with the iteration in fp32, a test-only change, TP 2 equals one rank within 1e-5); Newton-Schulz on each TP
    shard instead of the whole matrix misses by far more."""
    flags = ["--load-hf", llama["hf"], "--data-path", llama["data"], *RUN, "--optimizer", "muon",
             "--tensor-model-parallel-size", 2, "--sequence-parallel"]
    for stage in (0, 1, 3):
        log = tmp_path / f"tp2_zero{stage}.jsonl"
        run("torchrun", 2, flags + ["--zero-stage", stage, "--log-json", log])
        losses = [r["lm_loss"] for r in read_log(log)]
        assert close(losses, reference), (stage, losses, reference)


@pytest.mark.slow
def test_muon_with_context_parallelism_equals_one_rank(llama, tmp_path):
    """CP 2 (the sequence split, its gradients reduced over DP x CP before the step): every rank steps the whole
    matrices with the reduced gradients, the one-rank losses within the bf16 Newton-Schulz's noise (5e-4)."""
    flags = ["--load-hf", llama["hf"], "--data-path", llama["data"], *RUN, "--optimizer", "muon"]
    one, two = tmp_path / "one.jsonl", tmp_path / "cp2.jsonl"
    run("python", 1, flags + ["--log-json", one])
    run("torchrun", 2, flags + ["--context-parallel-size", 2, "--log-json", two])
    a, b = ([r["lm_loss"] for r in read_log(p)] for p in (one, two))
    assert len(b) == 5 and all(abs(x - y) <= 5e-4 * abs(x) for x, y in zip(a, b)), (a, b)


def _sharded_against_torch_muon(contiguous: bool) -> list:
    """On each pool rank: a tiny GQA SwiGLU model's matrices laid out as ZeRO-1/2 (`contiguous`: one flat buffer cut
    in two) or ZeRO-3 (each parameter cut in two) lays them out, stepped twice by ShardedMuonWithAdamW, gathered
    back and compared with MuonWithAdamW (torch.optim.Muon on each HF matrix) on the same gradients; under a watch
    for tensor factories without a device. -> (bitwise equal, the factories without a device)."""
    import torch.distributed as dist
    from hybrid.model.build import build_model
    from hybrid.model.config import ModelConfig
    from hybrid.parallel.groups import ParallelGroups
    from hybrid.training.muon import FlatPartition, MuonWithAdamW, Partitioned, ShardedMuonWithAdamW
    from tests.test_generation import FactoriesWithoutDevice
    torch.manual_seed(0)
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                         max_position_embeddings=16, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                         position_embedding_type="rope", untie_embeddings_and_output_weights=True, kv_channels=12,
                         ffn_hidden_size=40)
    model, reference = build_model(config, ParallelGroups.single()), build_model(config, ParallelGroups.single())
    reference.load_state_dict(model.state_dict())
    settings = (1e-2, 0.1, (0.9, 0.999), 1e-8, 0.95, True, 5, "original")
    ours = ShardedMuonWithAdamW(model, config, 2, [{"params": list(model.parameters())}], *settings)
    theirs = MuonWithAdamW(reference, config, 2, [{"params": list(reference.parameters())}], *settings)
    ranks, rank = dist.get_world_size(), dist.get_rank()
    matrices = ours.matrices
    pieces, params, offset = [], [], 0
    if contiguous:
        whole = torch.cat([p.detach().reshape(-1) for p in matrices])
        whole = torch.nn.functional.pad(whole, (0, -whole.numel() % ranks))
        size = whole.numel() // ranks
        flat = whole[rank * size:(rank + 1) * size].clone()
        for p in matrices:
            params.append(Partitioned(p, tuple(p.shape), offset))
            offset += p.numel()
    else:
        for p in matrices:
            part = -(-p.numel() // ranks)
            padded = torch.nn.functional.pad(p.detach().reshape(-1), (0, ranks * part - p.numel()))
            pieces.append(padded[rank * part:(rank + 1) * part])
            params.append(Partitioned(p, tuple(p.shape), offset, part, contiguous=False))
            offset += part
        flat = torch.cat(pieces).clone()
    partition = FlatPartition(flat, dist.group.WORLD, ranks, rank, params, flat.device)
    ours.param_groups[-1]["params"] = [flat]  # as DeepSpeed's ZeRO puts its partition in the client's group
    ours.attach([partition])
    watch = FactoriesWithoutDevice()
    for step in range(2):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
                 for i, p in enumerate(matrices)]
        gathered = torch.zeros(ranks * flat.numel())
        for p, g in zip(params, grads):
            p.write(gathered.view(ranks, -1), g)
        flat.grad = gathered.view(ranks, -1)[rank].clone()
        for p, g in zip(theirs.matrices, grads):
            p.grad = g.clone()
        with watch:
            ours.step()
        theirs.step()
    everything = torch.empty(ranks * flat.numel())
    dist.all_gather_into_tensor(everything, flat)
    equal = all(torch.equal(p.read(everything.view(ranks, -1)), q.detach())
                for p, q in zip(params, theirs.matrices))
    return equal, watch.missing


@pytest.mark.parametrize("contiguous", [True, False], ids=["zero12", "zero3"])
def test_sharded_muon_equals_torch_muon_on_each_hf_matrix_bitwise(contiguous):
    """The ZeRO form on 2 ranks (DeepSpeed's ZeRO-1/2 and ZeRO-3 partition layouts, a matrix cut between the ranks,
    fused QKV with a head size of its own and gate/up whose learning-rate adjustment differs from the other
    matrices') steps the weights bitwise as torch.optim.Muon does on each HF matrix, over two steps (the
    momentum); and it makes no tensor without a device (on a GPU one would be made on the host)."""
    from checks.rank_pool import run_on_ranks
    results = run_on_ranks(_sharded_against_torch_muon, 2, contiguous)
    assert all(equal for equal, _ in results), results
    assert all(not missing for _, missing in results), results
