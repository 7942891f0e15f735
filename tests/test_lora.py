"""LoRA (--lora-rank, --load-lora) against PEFT itself: a tiny HF Llama with a PEFT adapter whose A and B are both
non-zero, trained by the engine from that adapter, gives the losses of transformers + peft + torch.optim.AdamW batch
for batch at one rank, TP 2 + SP, DP 2 under ZeRO-3 and PP 2; the adapted model's logits and gradients equal PEFT's
(the fused QKV and gate/up carrying one adapter per HF projection); the base holds no gradient and no optimizer
state; bad adapters and flags are one message each."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from checks.launch_helpers import read_log, run
from tests.hf_families import make_family

SEQ = 16
LR = 0.01
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RUN = ["--seq-length", SEQ, "--micro-batch-size", 2, "--global-batch-size", 4, "--train-iters", 5, "--lr", LR,
       "--lr-decay-style", "constant", "--lr-warmup-iters", 0, "--weight-decay", 0.1, "--clip-grad", 0,
       "--hidden-dropout", 0, "--attention-dropout", 0, "--eval-iters", 0, "--log-interval", 1, "--no-progress-bar",
       "--split", "100,0,0"]


def close(ours: list, want: list, tolerance: float = 1e-5) -> bool:
    return len(ours) == len(want) and all(abs(a - b) <= tolerance * abs(b) for a, b in zip(ours, want))


def peft_model(path, targets=TARGETS, rank: int = 4, alpha: float = 8.0, rslora: bool = False, seed: int = 1):
    """transformers' model at `path` with PEFT's LoRA on `targets`, every B drawn non-zero (PEFT starts B at 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                            use_rslora=rslora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny HF Llama 3 (untied head, GQA), a PEFT adapter on every projection (A and B non-zero), and a corpus
    whose every window is the same SEQ + 1 tokens (the samples' order cannot matter)."""
    from hybrid.data.indexed import IndexedDatasetBuilder
    root = tmp_path_factory.mktemp("lora")
    make_family("llama3", root / "hf", tie_word_embeddings=False)
    peft_model(root / "hf").save_pretrained(root / "adapter")
    pattern = np.random.RandomState(3).randint(10, 2000, size=SEQ)
    builder = IndexedDatasetBuilder(str(root / "corpus_text_document"), dtype=np.uint16)
    builder.add_document(np.tile(pattern, 64))
    builder.finalize()
    window = torch.from_numpy(np.concatenate([pattern, pattern[:1]]).astype(np.int64))
    return {"hf": root / "hf", "adapter": root / "adapter", "data": str(root / "corpus_text_document"),
            "window": window, "root": root}


@pytest.fixture(scope="module")
def reference(llama):
    """transformers + peft + torch.optim.AdamW (the adapters only, weight decay 0.1): the losses before each of 5
    steps, and the trained model (for the exports)."""
    model = saved_adapter(llama, trainable=True)
    losses = peft_adamw_losses(llama, 4 * 7 * 2, model)  # layers x projections x (A, B)
    return {"losses": losses, "model": model.eval()}


def peft_adamw_losses(model_and_adapter: dict, trainable: int, model=None) -> list:
    """Five torch.optim.AdamW steps (weight decay 0.1) of the PEFT model on the window: the losses before each."""
    model = model or saved_adapter(model_and_adapter, trainable=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == trainable
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    window = model_and_adapter["window"][None]
    losses = []
    for _ in range(5):
        loss = model(window, labels=window).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def saved_adapter(llama, trainable: bool = False):
    """transformers' model with the fixture's PEFT adapter, as PEFT loads it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(llama["hf"], dtype=torch.float32)
    return PeftModel.from_pretrained(base, llama["adapter"], is_trainable=trainable)


def flags(llama, *extra):
    return ["--load-hf", llama["hf"], "--load-lora", llama["adapter"], "--data-path", llama["data"], *RUN, *extra]


def losses_of(log) -> list:
    return [r["lm_loss"] for r in read_log(log)]


@pytest.mark.slow
def test_lora_from_a_peft_adapter_trains_as_transformers_with_peft_and_adamw(llama, reference, tmp_path):
    """One rank, --load-lora: five AdamW iterations give transformers + peft + torch.optim.AdamW's losses within
    1e-5; the log says what trains (the adapters: 4 layers x 7 projections x (A, B)) and the optimizer holds them
    only."""
    log = tmp_path / "one.jsonl"
    proc = run("python", 1, flags(llama, "--log-json", log))
    out = proc.stdout + proc.stderr
    assert "LoRA: the adapters of" in out and "rank 4, alpha 8" in out, out[-3000:]
    assert close(losses_of(log), reference["losses"]), (losses_of(log), reference["losses"])


@pytest.mark.slow
def test_lora_at_tp2_sp_dp2_zero3_and_pp2_equals_peft_and_exports_as_peft_and_merged(llama, reference, tmp_path):
    """TP 2 + SP (A whole beside the column-parallel QKV and gate/up, B split with their rows; A split beside the
    row-parallel o and down, B whole), DP 2 under ZeRO-3 (the frozen base partitioned too), PP 2 and CP 2:
    transformers + peft + AdamW's losses within 1e-5. The TP 2 checkpoint exports with --saver peft
    (PeftModel.from_pretrained on the base gives the trained reference's logits, 1e-5) and --saver hf (the adapters
    merged: the same logits); each layout's checkpoint holds its adapters as a PEFT directory (`<tag>/adapter`) that
    loads to those logits; a resume of the TP 2 run from iteration 2 continues bitwise."""
    from hybrid.conversion.checkpoint_util import main
    tp2 = ["--tensor-model-parallel-size", 2, "--sequence-parallel", "--zero-stage", 1]
    layouts = {"tp2_sp": tp2 + ["--save", tmp_path / "ckpt", "--save-interval", 2],
               "dp2_zero3": ["--zero-stage", 3, "--save", tmp_path / "zero3", "--save-interval", 5],
               "pp2": ["--pipeline-model-parallel-size", 2, "--save", tmp_path / "pp2", "--save-interval", 5],
               "cp2": ["--context-parallel-size", 2]}
    for name, extra in layouts.items():
        log = tmp_path / f"{name}.jsonl"
        run("torchrun", 2, flags(llama, *extra, "--log-json", log))
        assert close(losses_of(log), reference["losses"]), (name, losses_of(log), reference["losses"])
    # a resume from iteration 2 continues bitwise (the adapters and their Adam state; the frozen base as saved)
    (tmp_path / "ckpt" / "latest").write_text("iter_0000002")
    resumed = tmp_path / "resumed.jsonl"
    proc = run("torchrun", 2, flags(llama, *tp2, "--load", tmp_path / "ckpt", "--log-json", resumed))
    assert "--load-lora" in proc.stdout and "not read; the run resumes" in proc.stdout, proc.stdout[-2000:]
    assert losses_of(resumed) == losses_of(tmp_path / "tp2_sp.jsonl")[2:], proc.stdout[-2000:]
    (tmp_path / "ckpt" / "latest").write_text("iter_0000005")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    window = llama["window"][None]
    with torch.no_grad():
        want = reference["model"](window).logits
        # each checkpoint's own adapter directory (gathered over TP, ZeRO-3's partitions, the pipeline's stages),
        # and the two exports
        saved = [tmp_path / run_dir / "iter_0000005" / "adapter" for run_dir in ("ckpt", "zero3", "pp2")]
        for saver in ("peft", "hf", *saved):
            out = tmp_path / saver if saver in ("peft", "hf") else saver
            if saver in ("peft", "hf"):
                assert main(["--saver", saver, "--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(out),
                             "--no-progress-bar"]) == 0
            if saver != "hf":
                config = json.loads((out / "adapter_config.json").read_text())
                assert config["r"] == 4 and config["base_model_name_or_path"] == str(llama["hf"]), config
                model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama["hf"]), out)
            else:
                model = AutoModelForCausalLM.from_pretrained(out)
            got = model.eval()(window).logits
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (saver, (got - want).abs().max())


def _engine_model(llama, tp: int = 1):
    """Our model (GPTModel) with the HF weights and the PEFT adapter, as --load-hf --load-lora load them."""
    from hybrid.conversion import peft as P
    from hybrid.conversion.layout import load_parts
    from hybrid.conversion.source import HF, open_source
    from hybrid.model.gpt import GPTModel
    from hybrid.model.naming import names_to_load
    from hybrid.parallel.groups import ParallelGroups
    source = open_source(str(llama["hf"]), "--load-hf", kind=HF)
    config = dataclasses.replace(source.config(), **P.flags_of(P.read_config(llama["adapter"])))
    model = GPTModel(config)
    wanted = {n for n in names_to_load(model, config.num_layers) if ".lora." not in n}
    parts = [*source.parts(dataclasses.replace(config, lora_rank=0), wanted), P.read_adapter(llama["adapter"], config)]
    load_parts(model, parts, config, ParallelGroups.single())
    return model, config


def test_the_adapted_model_equals_peft_forward_and_backward_and_the_base_with_adapters_off(llama):
    """Logits equal PeftModel's (1e-5), every adapter's gradient equals PEFT's lora_A / lora_B gradient (fused QKV and
    gate/up split back), and with the adapters off (hybrid.model.lora.adapters_off) the logits are the base model's
    (PEFT's disable_adapter), which the adapters clearly change."""
    from hybrid.model.lora import adapters_off
    model, config = _engine_model(llama)
    reference = saved_adapter(llama, trainable=True)
    ids = llama["window"][None, :-1].repeat(2, 1)
    ids[1] = ids[1].flip(0)
    labels = llama["window"][None, 1:].repeat(2, 1)
    want = reference(ids).logits
    got = model(ids)[..., :want.size(-1)]
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    with adapters_off(model), reference.disable_adapter():
        base = reference(ids).logits
        assert torch.allclose(model(ids)[..., :want.size(-1)], base, atol=1e-5, rtol=0)
    assert (want - base).abs().max() > 0.1
    model(ids, labels).backward()
    torch.nn.functional.cross_entropy(want.flatten(0, 1), labels.flatten()).backward()
    ours = dict(model.named_parameters())
    theirs = dict(reference.named_parameters())
    from hybrid.conversion.peft import peft_key
    names = {peft_key(n): n for n in ours if ".lora." in n}
    assert len(names) == 56
    for key, name in names.items():
        peft_name = key.replace(".weight", ".default.weight")
        assert torch.allclose(ours[name].grad, theirs[peft_name].grad, atol=1e-6, rtol=1e-4), name
    frozen = [n for n, p in ours.items() if ".lora." not in n]
    assert frozen and all(ours[n].grad is not None for n in frozen)  # (autograd: the engine freezes them)


def test_merged_adapters_are_peft_merge_and_unload(llama):
    """hybrid.conversion.peft.merged folds s B A into the fused weights: PEFT's merge_and_unload's weights."""
    from hybrid.conversion.families import adapter_for_model
    from hybrid.conversion.peft import merged
    model, config = _engine_model(llama)
    state = {n: p.detach() for n, p in model.named_parameters()}
    hf = adapter_for_model(dataclasses.replace(config, lora_rank=0)).to_hf(merged(state, config))
    want = saved_adapter(llama).merge_and_unload().state_dict()
    for key, tensor in hf.items():
        assert torch.allclose(tensor, want[key], atol=1e-6, rtol=0), key


@pytest.mark.slow  # (6 s of the quick tier: nine bad inputs, each a run's start)
def test_bad_lora_flags_and_adapters_are_one_message_each(llama, tmp_path):
    """A target the model does not have, a rank above a projection's dimensions, LoRA options without a rank, an
    adapter for another base (shapes), an adapter whose config disagrees with the flags, a pickled adapter: one
    message each, before anything is built."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    other = tmp_path / "other"
    make_family("llama3", other / "hf", tie_word_embeddings=False, hidden_size=48, tokenizer=False)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(other / "hf"), LoraConfig(r=4, target_modules=TARGETS))
    model.save_pretrained(other / "adapter")
    pickled = tmp_path / "pickled"
    model.save_pretrained(pickled, safe_serialization=False)
    base = ["--load-hf", llama["hf"], "--data-path", llama["data"], *RUN]
    cases = {
        "--lora-target-modules qkv_proj: not a projection":
            base + ["--lora-rank", 4, "--lora-target-modules", "qkv_proj"],
        "--lora-rank 40 is larger than": base + ["--lora-rank", 40, "--lora-target-modules", "q_proj"],
        "--lora-alpha sets an option of the adapters; add --lora-rank": base + ["--lora-alpha", 16],
        "an adapter trained on another base model": base + ["--load-lora", other / "adapter"],
        "disagrees with --lora-rank 8 (the adapter's: 4)": base + ["--load-lora", llama["adapter"], "--lora-rank", 8],
        "a pickle: loading it could run code": base + ["--load-lora", pickled],
        "no adapter_config.json there": base + ["--load-lora", tmp_path],
        "an adapter needs the base model it was trained on": [f for f in base if f not in ("--load-hf", llama["hf"])]
        + ["--load-lora", llama["adapter"], "--tokenizer-type", "HFTokenizer", "--tokenizer-model", llama["hf"]],
    }
    for message, argv in cases.items():
        proc = run("python", 1, argv, check=False)
        assert proc.returncode != 0 and message in proc.stderr, (message, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_grpo_with_lora_generates_with_the_adapters_and_takes_its_kl_reference_from_the_base(llama, tmp_path):
    """--grpo with --load-lora and the KL (beta 0.04): no second model (the log says so); the KL is positive from the
    first iteration (the reference is the base, the policy the base with the adapter); the sampler's log-probabilities
    (the adapters on, at the training layout) equal the trainer's; TP 2 + SP gives one rank's rewards and losses."""
    from checks.launch_helpers import one_rank
    grpo = ["--grpo", "--load-hf", llama["hf"], "--load-lora", llama["adapter"], "--grpo-beta", 0.04,
            "--seq-length", 32, "--global-batch-size", 16, "--micro-batch-size", 8, "--lr", 1e-3, "--max-new-tokens",
            8, "--grpo-group-size", 8, "--train-iters", 3, "--log-interval", 1, "--no-demo", "--seed", 3]
    want = one_rank(grpo)
    log = tmp_path / "tp2.jsonl"
    proc = run("torchrun", 2, grpo + ["--tensor-model-parallel-size", 2, "--sequence-parallel", "--log-json", log])
    assert "the reference is the model itself with its adapters off" in proc.stdout + proc.stderr
    got = read_log(log)
    assert len(got) == len(want) == 3 and want[0]["kl"] > 0, want
    for x, y in zip(want, got):
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-9), (x, y)
        assert abs(x["lm_loss"] - y["lm_loss"]) <= 1e-5 + 1e-4 * abs(x["lm_loss"]), (x, y)
        assert abs(x["kl"] - y["kl"]) <= 1e-5 + 1e-4 * abs(x["kl"]), (x, y)
        assert y["logprob_mismatch"] <= 1e-5 and x["logprob_mismatch"] <= 1e-5


@pytest.mark.slow
def test_lora_on_an_moe_models_attention_at_ep2_equals_peft(tmp_path):
    """An imported HF Mixtral (4 experts, top-2) with a PEFT adapter on q, k, v and o (A and B non-zero), its experts
    split over 2 ranks (EP 2, ZeRO-0) and at DP 2 under ZeRO-3: transformers + peft + AdamW's five losses within
    1e-5; adapters on the experts are refused by name (and ZeRO-1/2 by the capability table: DeepSpeed's optimizers
    there need trainable experts)."""
    from hybrid.data.indexed import IndexedDatasetBuilder
    make_family("mixtral", tmp_path / "hf", tie_word_embeddings=False)
    adapter = tmp_path / "adapter"
    peft_model(tmp_path / "hf", targets=TARGETS[:4]).save_pretrained(adapter)
    pattern = np.random.RandomState(5).randint(10, 2000, size=SEQ)
    builder = IndexedDatasetBuilder(str(tmp_path / "corpus_text_document"), dtype=np.uint16)
    builder.add_document(np.tile(pattern, 64))
    builder.finalize()
    window = torch.from_numpy(np.concatenate([pattern, pattern[:1]]).astype(np.int64))
    want = peft_adamw_losses({"hf": tmp_path / "hf", "adapter": adapter, "window": window}, trainable=4 * 4 * 2)
    flags = ["--load-hf", tmp_path / "hf", "--load-lora", adapter, "--data-path", tmp_path / "corpus_text_document",
             *RUN, "--moe-aux-loss-coeff", 0]  # (transformers' loss has no router term unless asked)
    log = tmp_path / "ep2.jsonl"
    run("torchrun", 2, flags + ["--expert-model-parallel-size", 2, "--log-json", log])
    assert close(losses_of(log), want), (losses_of(log), want)
    zero3 = tmp_path / "zero3.jsonl"  # (EP 1: the experts partitioned over DP 2 as ordinary parameters)
    run("torchrun", 2, flags + ["--zero-stage", 3, "--log-json", zero3])
    assert close(losses_of(zero3), want), (losses_of(zero3), want)
    proc = run("python", 1, ["--load-hf", tmp_path / "hf", "--data-path", tmp_path / "corpus_text_document", *RUN,
                             "--lora-rank", 4, "--lora-target-modules", "all-linear"], check=False)
    assert proc.returncode != 0 and "LoRA on experts is not implemented" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_lora_with_modules_to_save_trains_the_head_as_peft_and_writes_it_with_the_adapters(llama, tmp_path):
    """PEFT's modules_to_save (lm_head: the untied head trains whole beside the adapters on q and v): five AdamW
    iterations at one rank and at TP 2 + SP under ZeRO-3 (the head split over TP, in ZeRO-3's row blocks) equal
    transformers + peft + AdamW within 1e-5; the checkpoint's adapter directory (the head gathered and joined)
    loads with PeftModel to the trained reference's logits (1e-4)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    adapter = tmp_path / "adapter"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(llama["hf"]),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                      modules_to_save=["lm_head"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(adapter)
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama["hf"]), adapter, is_trainable=True)
    want = peft_adamw_losses(dict(llama, adapter=adapter), 4 * 2 * 2 + 1, trained)
    flags = ["--load-hf", llama["hf"], "--load-lora", adapter, "--data-path", llama["data"], *RUN]
    one, tp2 = tmp_path / "one.jsonl", tmp_path / "tp2.jsonl"
    run("python", 1, flags + ["--lora-modules-to-save", "lm_head", "--log-json", one])  # (flags that agree with it)
    run("torchrun", 2, flags + ["--tensor-model-parallel-size", 2, "--sequence-parallel", "--zero-stage", 3,
                                "--save", tmp_path / "ckpt", "--save-interval", 5, "--log-json", tp2])
    for log in (one, tp2):
        assert close(losses_of(log), want), (log, losses_of(log), want)
    written = tmp_path / "ckpt" / "iter_0000005" / "adapter"
    assert json.loads((written / "adapter_config.json").read_text())["modules_to_save"] == ["lm_head"]
    window = llama["window"][None]
    with torch.no_grad():
        got = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama["hf"]), written).eval()(window)
        # (the head itself trains here: TP 2's reductions leave 1.5e-5 on logits of about 1 after 5 steps)
        want_logits = trained.eval()(window).logits
        assert torch.allclose(got.logits, want_logits, atol=1e-4, rtol=0), (got.logits - want_logits).abs().max()
    # a merged export of it: DeepSpeed's converter reads ZeRO-3's partitions at TP 2, which hold no frozen base
    from hybrid.conversion.checkpoint_util import main
    assert main(["--saver", "hf", "--load-dir", str(tmp_path / "ckpt"), "--save-dir", str(tmp_path / "hf"),
                 "--no-progress-bar"]) != 0
    assert not (tmp_path / "hf").exists()
