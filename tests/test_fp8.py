"""FP8 training on torchao's float8 casts (hybrid.parallel.fp8): each GEMM equals torchao's Float8Linear
bitwise (tensorwise and rowwise), a fused weight's projections scale as transformers' separate projections
do, a model read from transformers evaluates at TP 2 to the loss torchao's float8 gives the transformers
model, TP 2 + SP computes one rank's FP8 gradients, delayed scaling's history resumes bitwise, and an FP8
run exports a bf16 model transformers loads. The launched layouts (TP 2 + SP, PP 2, CP 2, EP 2 and delayed
scaling at DP 2, each 4 iterations equal to one rank and resumed bitwise) are cells of the combination
sweep (tests/test_combinations.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install torchao)")

from hybrid.model.config import ModelConfig  # noqa: E402
from hybrid.parallel.fp8 import Fp8Gemm, Fp8Settings, end_iteration, fp8_linear  # noqa: E402
from hybrid.parallel.groups import ParallelGroups  # noqa: E402
from checks.launch_helpers import read_log, run  # noqa: E402
from tests.model_harness import LLAMA, assemble_grads, batch, compare_grads, reference, sharded_run  # noqa: E402


def _torchao(module, recipe: str, **kwargs):
    """torchao's convert_to_float8_training with its recipe, emulated (CPU)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = Float8LinearConfig(**{**Float8LinearConfig.from_recipe_name(recipe).__dict__, "emulate": True})
    convert_to_float8_training(module, config=config, **kwargs)
    return module


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_an_fp8_gemm_is_torchaos_float8_linear_bitwise(recipe):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=False)
    reference = _torchao(torch.nn.Sequential(copy.deepcopy(linear)), recipe)
    x = torch.randn(8, 64, requires_grad=True)
    ours_x = x.detach().clone().requires_grad_()
    want = reference(x)
    want.square().sum().backward()
    got = fp8_linear(ours_x, linear.weight, None, Fp8Gemm(Fp8Settings(recipe), ParallelGroups.single(), "column"))
    got.square().sum().backward()
    assert torch.equal(got, want) and torch.equal(ours_x.grad, x.grad)
    assert torch.equal(linear.weight.grad, reference[0].weight.grad)
    assert (got - x.detach() @ linear.weight.detach().t()).abs().max() > 1e-3  # it is FP8


def test_a_fused_weight_scales_each_projection_as_separate_linears():
    """QKV as one weight: one scale per projection, the forward torchao's q/k/v Linears give (one scale
    for the fused weight would not)."""
    torch.manual_seed(1)
    q, k, v = (torch.nn.Linear(32, n, bias=False) for n in (32, 8, 8))
    with torch.no_grad():
        k.weight.mul_(8.0)  # projections of different magnitudes
    separate = _torchao(torch.nn.ModuleList([copy.deepcopy(m) for m in (q, k, v)]), "tensorwise")
    x = torch.randn(6, 32)
    want = torch.cat([m(x) for m in separate], dim=-1)
    fused = torch.cat([q.weight, k.weight, v.weight]).detach()
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate((32, 8, 8))])
    got = fp8_linear(x, fused, None, Fp8Gemm(Fp8Settings("tensorwise"), ParallelGroups.single(), "column", segments))
    one_scale = fp8_linear(x, fused, None, Fp8Gemm(Fp8Settings("tensorwise"), ParallelGroups.single(), "column"))
    # (the same FP8 operands; one GEMM's sums may round in another order than three GEMMs')
    assert (got - want).abs().max() < 1e-6 and (one_scale - want).abs().max() > 1e-3


FP8_LLAMA = dict(LLAMA, fp8_recipe="tensorwise")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tp2_sp_computes_one_ranks_fp8_gradients(recipe):
    """Every amax over the whole tensor (TP-split weights and output gradients, SP-gathered inputs): TP 2 + SP
    gives the one-rank FP8 model's loss and gradients."""
    from checks.rank_pool import run_on_ranks
    data = batch()
    cfg = dict(FP8_LLAMA, fp8_recipe=recipe)
    ref_loss, _, ref_grads = reference(cfg, data)
    _, _, high_grads = reference(LLAMA, data)
    results = run_on_ranks(sharded_run, 2, cfg, 2, 1, data, True)
    assert abs(results[0]["loss"] - ref_loss) <= 1e-6
    compare_grads(assemble_grads(results), ref_grads, cfg["vocab_size"], 1e-5)
    assert (ref_grads["layers.0.attention.qkv.weight"] - high_grads["layers.0.attention.qkv.weight"]).abs().max() > 1e-4


def test_delayed_scaling_history_resumes_bitwise():
    """Delayed scaling: the history moves once per iteration (every micro-batch's amax), lives in the model's
    buffers (saved with it), and a model loaded from them continues bitwise."""
    from hybrid.model.gpt import GPTModel
    config = ModelConfig(**dict(LLAMA, fp8_recipe="delayed", fp8_amax_history_len=3, fp8_amax_compute_algo="max"))

    def step(model, optimizer, seed):
        loss = sum(model(*batch(seed=seed + m)) for m in range(2)) / 2  # two micro-batches
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        end_iteration(model, None)
        return loss.item()
    model = GPTModel(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [step(model, optimizer, 10 * i) for i in range(2)]
    saved = copy.deepcopy(model.state_dict())
    assert saved["layers.0.attention.qkv.fp8.amax_history"][:2].gt(0).all()  # (input, grad, q, k, v) x 2 iterations
    assert saved["layers.0.attention.qkv.fp8.amax_history"].shape == (3, 5)
    uninterrupted = [step(model, optimizer, 10 * i) for i in range(2, 4)]
    resumed_model = GPTModel(config)
    resumed_model.load_state_dict(saved)
    resumed_optimizer = torch.optim.SGD(resumed_model.parameters(), lr=0.1)
    resumed = [step(resumed_model, resumed_optimizer, 10 * i) for i in range(2, 4)]
    assert resumed == uninterrupted and losses[0] != uninterrupted[-1]


def test_delayed_scales_come_from_the_previous_iteration_and_a_spike_or_a_skipped_step_leaves_them():
    """Iteration 2's input, weight and gradient casts use fp8-max / iteration 1's amaxes (not the tensors' own:
    a history ignored would pass the resume test above); an iteration whose input amax is not finite leaves that
    column's history as it was (Transformer Engine keeps the previous scale; entered, the scale would be 0 and
    every later gradient NaN) while the finite columns move; a skipped optimizer step leaves every history."""
    from hybrid.parallel import fp8 as fp8_module
    from hybrid.parallel.fp8 import GRAD, INPUT, WEIGHT
    gemm = Fp8Gemm(Fp8Settings("delayed", "hybrid", history_len=2), ParallelGroups.single(), "column")
    weight = torch.nn.Parameter(torch.randn(8, 16))
    e4m3, e5m2 = torch.finfo(torch.float8_e4m3fn).max, torch.finfo(torch.float8_e5m2).max
    seen = []
    original = fp8_module._cast

    def spy(t, dtype, role, axiswise_dim, groups, round_pow2, scale=None, record=None, complete=True):
        seen.append((role, None if scale is None else scale.clone()))
        return original(t, dtype, role, axiswise_dim, groups, round_pow2, scale, record, complete)

    def iteration(x, upstream=1.0, stepped=True):
        seen.clear()
        (fp8_linear(x.requires_grad_(), weight, None, gemm) * upstream).sum().backward()
        end_iteration(gemm, None, stepped=stepped)
    fp8_module._cast = spy
    try:
        x1 = torch.randn(4, 16)
        iteration(x1, upstream=3.0)
        amax1 = gemm.amax_history[0].clone()
        assert amax1[INPUT] == x1.abs().max() and amax1[GRAD] == 3.0 and amax1[WEIGHT] == weight.detach().abs().max()
        iteration(10 * torch.randn(4, 16))  # another amax: the scales must still be iteration 1's
        roles = fp8_module._roles()
        scales = {role: scale for role, scale in seen if scale is not None}
        assert torch.allclose(scales[roles.INPUT], torch.tensor(e4m3 / amax1[INPUT].item()), rtol=1e-6)
        assert torch.allclose(scales[roles.GRAD_OUTPUT], torch.tensor(e5m2 / 3.0), rtol=1e-6)
        assert gemm.amax_history[1].equal(amax1)  # rolled
        before = gemm.amax_history.clone()
        spike = torch.randn(4, 16)
        spike[0, 0] = float("inf")
        iteration(spike)
        assert gemm.amax_history[:, INPUT].equal(before[:, INPUT])  # the spike's column kept its history
        assert gemm.amax_history[1, GRAD].equal(before[0, GRAD])  # the finite columns moved on
        assert torch.isfinite(gemm.delayed_scale(INPUT)).all() and gemm.delayed_scale(INPUT).gt(0).all()
        before = gemm.amax_history.clone()
        iteration(100 * torch.randn(4, 16), stepped=False)
        assert gemm.amax_history.equal(before) and gemm.amax_current.eq(0).all()
    finally:
        fp8_module._cast = original


def _windows(prefix, windows):
    from hybrid.data.indexed import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(prefix)
    builder.add_document(windows.flatten().numpy())
    builder.finalize()


def _mean_loss(model, windows, micro_batch):
    losses = []
    with torch.no_grad():
        for i in range(0, windows.size(0), micro_batch):
            chunk = windows[i:i + micro_batch]
            logits = model(chunk[:, :-1]).logits
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()).item())
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_evaluate_fp8_at_tp2_equals_torchao_on_the_transformers_model(tmp_path):
    """evaluate.py --load-hf at TP 2 with --fp8-format e4m3 and --fp8-recipe tensorwise / rowwise: the loss of
    the transformers model converted by torchao (its lm_head left out, as hybrid keeps the output layer in the
    high precision), within 1e-4, and not the high-precision loss."""
    from tests.hf_families import make_family
    hf = make_family("llama3", tmp_path / "model")
    windows = torch.randint(0, 8000, (4, 17), generator=torch.Generator().manual_seed(5))
    _windows(str(tmp_path / "windows"), windows)
    high = _mean_loss(hf, windows, 2)
    for recipe in ("tensorwise", "rowwise"):
        want = _mean_loss(_torchao(copy.deepcopy(hf), recipe, module_filter_fn=lambda m, fqn: fqn != "lm_head"),
                          windows, 2)
        log = str(tmp_path / f"{recipe}.json")
        run("torchrun", 2, ["--load-hf", tmp_path / "model", "--data-path", tmp_path / "windows", "--seq-length", 16,
                            "--micro-batch-size", 2, "--eval-iters", 2, "--tensor-model-parallel-size", 2,
                            "--fp8-format", "e4m3", "--fp8-recipe", recipe, "--log-json", log],
            script="launch/evaluate.py")
        with open(log) as f:
            got = json.loads(f.read().strip().splitlines()[-1])["lm_loss"]
        assert abs(got - want) < 1e-4 and abs(got - high) > 1e-3, (recipe, got, want, high)


@pytest.mark.slow
def test_an_fp8_run_exports_a_bf16_model_transformers_loads(tmp_path):
    """--load-hf of a bf16 model, trained with --bf16 and delayed FP8 scaling (first and last layers kept in
    bf16), exported: transformers loads a bf16 model holding the trained weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.hf_families import make_family
    from checks.launch_helpers import copy_default_corpus
    make_family("llama3", tmp_path / "model", dtype="bfloat16")
    data = copy_default_corpus(str(tmp_path))
    log, export = tmp_path / "log.jsonl", tmp_path / "export"
    run("python", 1, ["--load-hf", tmp_path / "model", "--data-path", data, "--seq-length", 32, "--micro-batch-size",
                      2, "--global-batch-size", 4, "--train-iters", 3, "--lr", 1e-3, "--bf16", "--zero-stage", 1,
                      "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", 4,
                      "--first-last-layers-bf16", "--eval-iters", 0, "--log-interval", 1, "--log-json", log,
                      "--save", tmp_path / "ckpt", "--export-hf", export, "--no-progress-bar"])
    assert len([r for r in read_log(log) if "lm_loss" in r and "iteration" in r]) == 3
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.dtype == torch.bfloat16
    original = load_file(str(tmp_path / "model" / "model.safetensors"))
    trained = load_file(str(export / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in trained.values())
    assert any(not torch.equal(trained[k], original[k]) for k in original)


def test_the_installed_torchao_is_in_the_range_pyproject_allows_and_has_the_internals_fp8_uses():
    """hybrid.parallel.fp8 calls torchao.float8's casts and tensor subclass directly (not its public Float8Linear):
    pyproject bounds torchao to the minor versions checked, and the functions used are there."""
    import os
    import re

    import torchao
    from hybrid.parallel import fp8 as fp8_module
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bounds = set(re.findall(r'"torchao>=([\d.]+),<([\d.]+)"', open(os.path.join(root, "pyproject.toml")).read()))
    assert len(bounds) == 1, bounds  # the fp8 and dev extras agree
    low, high = (tuple(int(x) for x in v.split(".")) for v in bounds.pop())
    version = tuple(int(x) for x in re.match(r"[\d.]+", torchao.__version__).group(0).rstrip(".").split(".")[:3])
    assert low <= version < high, torchao.__version__
    config, ftt, fu = fp8_module._torchao()
    for module, name in ((ftt, "hp_tensor_and_scale_to_float8"), (ftt, "Float8TrainingTensor"), (fu, "amax_to_scale")):
        assert callable(getattr(module, name)), name
