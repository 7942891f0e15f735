"""Generation with the engine's own layers (hybrid.model.generate, launch/generate.py): greedy decoding equals
transformers' `generate(do_sample=False)` token for token for every family, batched prompts of different lengths,
at one rank, TP 2 + SP, PP 2 and EP 2; each token's log-probability equals transformers' forward on the finished
sequence (the train-inference mismatch); seeded sampling does not depend on the layout or the batch."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.hf_families import FAMILIES, make_family
from checks.launch_helpers import run
from checks.rank_pool import run_on_ranks

PROMPT_LENGTHS = (5, 11, 2, 7)
NEW = 12


def prompts(seed: int = 3, lengths=PROMPT_LENGTHS, vocab: int = 8192) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf, prompt: list, new: int = NEW) -> list:
    """transformers' greedy completion of one unpadded prompt (no EOS stop: min_new_tokens = new)."""
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_logprobs(hf, prompt: list, completion: list, temperature: float = 1.0) -> torch.Tensor:
    """transformers' forward on prompt + completion: each completion token's log-probability."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    return {family: (root / family, make_family(family, root / family, tokenizer=False)) for family in FAMILIES}


def one_rank_model(path):
    from hybrid.evaluation import loaded_model
    from hybrid.conversion.hf import hf_parts, read_hf_config
    from hybrid.parallel.groups import ParallelGroups
    config = read_hf_config(str(path), "--load-hf")
    groups = ParallelGroups.single()
    return loaded_model(config, groups, lambda wanted: hf_parts(str(path), config, wanted), torch.device("cpu"))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_and_the_logprobs_equal_its_forward(family, hf_models):
    from hybrid.memory import decoding_cache_bytes
    from hybrid.model.generate import SamplingOptions, generate
    path, hf = hf_models[family]
    model = one_rank_model(path)
    batch = prompts()
    out = generate(model, None, batch, SamplingOptions(max_new_tokens=NEW))
    for prompt, tokens, logps in zip(batch, out.tokens, out.logprobs):
        assert tokens == hf_greedy(hf, prompt), family
        mismatch = (hf_logprobs(hf, prompt, tokens) - torch.tensor(logps)).abs().max().item()
        assert mismatch <= 1e-5, (family, mismatch)
    # the cache is what --dry-run counts for a --grpo run's rollouts (hybrid.memory.decoding_cache_bytes)
    slots = max(PROMPT_LENGTHS) + NEW
    counted = decoding_cache_bytes(model.config, 1, len(batch), slots, range(model.config.num_layers), 4)
    assert out.stats["new_tokens"] == NEW * len(batch) and out.stats["cache_bytes"] == counted > 0


def test_mla_decoding_caches_latents_and_rope_keys_not_each_heads_keys_and_values(hf_models):
    """DeepSeek-V3's cache (hybrid.model.kv_cache.attend_latent): per layer and slot its normed latent (12) and
    shared rope key (4), not 4 heads' keys (12) and values (6); the greedy tokens and log-probabilities equal
    transformers' (test above) with the up projection absorbed in each one-token step (the prompt's step makes its
    slots' keys and values from their latents)."""
    from hybrid.model.generate import SamplingOptions, generate
    path, _ = hf_models["deepseek_v3"]
    model = one_rank_model(path)
    batch = prompts()
    out = generate(model, None, batch, SamplingOptions(max_new_tokens=NEW))
    slots = max(PROMPT_LENGTHS) + NEW
    c = model.config
    assert out.stats["cache_bytes"] == c.num_layers * len(batch) * slots * (c.kv_lora_rank + c.qk_pos_emb_head_dim) * 4
    assert c.kv_lora_rank + c.qk_pos_emb_head_dim < c.num_attention_heads * (c.qk_head_dim + c.qk_pos_emb_head_dim
                                                                              + c.v_head_dim)


def test_a_row_stops_at_its_eos_and_the_batch_when_every_row_has(hf_models):
    from hybrid.model.generate import SamplingOptions, generate
    path, hf = hf_models["llama3"]
    model = one_rank_model(path)
    batch = prompts()
    free = generate(model, None, batch, SamplingOptions(max_new_tokens=NEW)).tokens
    eos = free[1][3]  # row 1 ends at its 4th token (and any other row where that token comes first)
    out = generate(model, None, batch, SamplingOptions(max_new_tokens=NEW, eos=(eos,)))
    for full, cut in zip(free, out.tokens):
        end = full.index(eos) + 1 if eos in full else len(full)
        assert cut == full[:end]
    everyone = generate(model, None, batch, SamplingOptions(max_new_tokens=NEW, eos=tuple({r[0] for r in free})))
    assert everyone.stats["steps"] == 1 and [len(t) for t in everyone.tokens] == [1] * len(batch)


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3", "qwen3_5", "glm_moe_dsa"])
def test_a_groups_prompt_is_prefilled_once_and_ended_rows_leave_the_batch(family, hf_models):
    """Rows with one prompt (a --grpo group) share one prefill and rows that end leave the batch: every row's
    sampled tokens equal its generation alone (its own key), its log-probabilities within 1e-5, transformers'
    forward's too; the prompts' step ran over the distinct prompts and rows left (dense, MLA's latents, Gated
    DeltaNet's state and conv tail, DSA's indexer keys)."""
    from hybrid.model.generate import SamplingOptions, generate
    path, hf = hf_models[family]
    model = one_rank_model(path)
    distinct = prompts(seed=5)[:3]
    batch = [distinct[0]] * 3 + [distinct[1]] * 3 + [distinct[2]] * 2
    keys = list(range(20, 28))
    options = SamplingOptions(max_new_tokens=NEW, temperature=1.0, seed=3)
    free = generate(model, None, batch, options, keys=keys)
    eos = tuple({free.tokens[r][k] for r, k in ((0, 1), (3, 2), (4, 5))})  # rows end at different steps
    options = SamplingOptions(max_new_tokens=NEW, temperature=1.0, seed=3, eos=eos)
    out = generate(model, None, batch, options, keys=keys, record_routes=True)
    assert out.stats["prefilled"] == 3 and out.stats["rows_at_end"] < len(batch), out.stats
    assert (out.routes is not None) == (family in ("deepseek_v3", "glm_moe_dsa"))
    width = max(len(p) for p in batch)
    for r, (prompt, key) in enumerate(zip(batch, keys)):
        alone = generate(model, None, [prompt], options, keys=[key], record_routes=True)
        assert out.tokens[r] == alone.tokens[0], r
        if out.routes is not None:  # every fed token's experts, as alone (the rows that left kept theirs)
            fed = len(prompt) + len(alone.tokens[0]) - 1
            assert torch.equal(out.routes[r, width - len(prompt):width - len(prompt) + fed], alone.routes[0, :fed])
        assert torch.allclose(torch.tensor(out.logprobs[r]), torch.tensor(alone.logprobs[0]), atol=1e-5, rtol=0)
        reference = hf_logprobs(hf, prompt, out.tokens[r])
        assert (reference - torch.tensor(out.logprobs[r])).abs().max().item() <= 1e-5, r


def test_rows_that_ended_and_stay_never_run_past_learned_position_tables():
    """A row that ended early but stays in the batch (fewer than a quarter ended) while a row with a shorter prompt
    and a longer limit decodes on: fed at position 0, not past the learned table (max_position_embeddings 48; a
    30-token row that stops after 2 tokens would reach position 60); every row equals its generation alone."""
    from hybrid.model.build import build_model
    from hybrid.model.config import ModelConfig
    from hybrid.model.generate import SamplingOptions, generate
    from hybrid.pipeline_plan import PipelineSchedule
    from hybrid.parallel.groups import ParallelGroups
    torch.manual_seed(0)
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
                         max_position_embeddings=48, position_embedding_type="learned_absolute")
    model = build_model(config, ParallelGroups.single(), PipelineSchedule()).eval()
    batch = prompts(seed=9, lengths=(30, 6, 6, 6, 6), vocab=64)
    limits = [2, 26, 26, 26, 26]
    options = SamplingOptions(max_new_tokens=32)
    out = generate(model, None, batch, options, stop=lambda r, tokens: len(tokens) >= limits[r])
    assert [len(t) for t in out.tokens] == limits
    for r, prompt in enumerate(batch):
        alone = generate(model, None, [prompt], SamplingOptions(max_new_tokens=limits[r]))
        assert out.tokens[r] == alone.tokens[0], r


def test_seeded_sampling_is_per_row_uses_transformers_warpers_and_reports_the_tempered_logprob(hf_models):
    from hybrid.model.generate import SamplingOptions, generate
    path, hf = hf_models["qwen2"]
    model = one_rank_model(path)
    batch = prompts()
    options = SamplingOptions(max_new_tokens=NEW, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    together = generate(model, None, batch, options, keys=[10, 11, 12, 13])
    alone = generate(model, None, [batch[2]], options, keys=[12])  # the same row, alone: the same draw
    assert alone.tokens[0] == together.tokens[2]
    again = generate(model, None, batch, options, keys=[10, 11, 12, 13])
    assert again.tokens == together.tokens
    other = generate(model, None, batch, SamplingOptions(**{**options.__dict__, "seed": 8}), keys=[10, 11, 12, 13])
    assert other.tokens != together.tokens
    for prompt, tokens, logps in zip(batch, together.tokens, together.logprobs):
        mismatch = (hf_logprobs(hf, prompt, tokens, 0.8) - torch.tensor(logps)).abs().max().item()
        assert mismatch <= 1e-5, mismatch
    top1 = generate(model, None, batch, SamplingOptions(max_new_tokens=NEW, temperature=1.0, top_k=1))
    assert top1.tokens == generate(model, None, batch, SamplingOptions(max_new_tokens=NEW)).tokens


def _generate_on_rank(path: str, tp: int, pp: int, ep: int, sp: bool, batch: list, options: dict):
    import dataclasses
    from hybrid.conversion.hf import hf_parts, read_hf_config
    from hybrid.evaluation import loaded_model
    from hybrid.memory import decoding_cache_bytes
    from hybrid.model.generate import SamplingOptions, generate
    from hybrid.parallel.dims import ParallelDims
    from hybrid.parallel.groups import build_groups
    config = read_hf_config(path, "--load-hf")
    config = dataclasses.replace(config, sequence_parallel=sp)
    groups = build_groups(ParallelDims(2, tp, pp, expert_parallel=ep), experts=bool(config.num_experts))
    model = loaded_model(config, groups, lambda wanted: hf_parts(path, config, wanted), torch.device("cpu"))
    mine = batch if ep == 1 else batch[groups.dp.rank::2]  # EP: each data-parallel rank its own rows
    keys = list(range(len(batch))) if ep == 1 else list(range(groups.dp.rank, len(batch), 2))
    out = generate(model, groups, mine, SamplingOptions(**options), keys=keys,
                   sync=groups.ep if ep > 1 else None)
    # the cache this rank decoded with, and the dry run's count of it for this rank's layers (hybrid.memory)
    slots = max(len(p) for p in mine) + options["max_new_tokens"]
    counted = decoding_cache_bytes(model.config, tp, len(mine), slots, [int(i) for i in model.layers.keys()], 4)
    return keys, out.tokens, out.logprobs, model.config.sequence_parallel, (out.stats["cache_bytes"], counted)


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,pp,ep,sp", [("llama3", 2, 1, 1, True), ("qwen3", 1, 2, 1, False),
                                                ("mistral", 2, 1, 1, False), ("mixtral", 1, 1, 2, False),
                                                ("qwen3_moe", 2, 1, 1, True), ("deepseek_v3", 2, 1, 1, True),
                                                ("deepseek_v32", 2, 1, 1, True), ("glm_moe_dsa", 1, 2, 1, False),
                                                ("gemma4", 2, 1, 1, True), ("gemma4_e", 2, 1, 1, True),
                                                ("qwen3_5", 2, 1, 1, True), ("qwen3_next", 1, 2, 1, False),
                                                ("qwen3_5_moe", 1, 1, 2, False)])
def test_greedy_at_tp2_sp_pp2_ep2_equals_transformers_and_sampling_equals_one_rank(family, tp, pp, ep, sp,
                                                                                   hf_models):
    from hybrid.model.generate import SamplingOptions, generate
    path, hf = hf_models[family]
    batch = prompts(lengths=(5, 11, 2, 7, 9, 3))
    ranks = run_on_ranks(_generate_on_rank, 2, str(path), tp, pp, ep, sp, batch, {"max_new_tokens": NEW})
    rows = {k: (t, lp) for keys, tokens, logps, *_ in ranks for k, t, lp in zip(keys, tokens, logps)}
    assert sorted(rows) == list(range(len(batch)))
    assert all(r[3] == sp for r in ranks)  # sequence parallelism is back on after decoding
    assert all(r[4][0] == r[4][1] > 0 for r in ranks), [r[4] for r in ranks]  # --dry-run's cache: this rank's
    for k, prompt in enumerate(batch):
        tokens, logps = rows[k]
        assert tokens == hf_greedy(hf, prompt), (family, k)
        mismatch = (hf_logprobs(hf, prompt, tokens) - torch.tensor(logps)).abs().max().item()
        assert mismatch <= 1e-5, (family, mismatch)
    sampling = {"max_new_tokens": NEW, "temperature": 1.0, "top_p": 0.95, "seed": 3}
    ranks = run_on_ranks(_generate_on_rank, 2, str(path), tp, pp, ep, sp, batch, sampling)
    sharded = {k: t for keys, tokens, *_ in ranks for k, t in zip(keys, tokens)}
    single = generate(one_rank_model(path), None, batch, SamplingOptions(**sampling), keys=range(len(batch)))
    assert [sharded[k] for k in range(len(batch))] == single.tokens


def _ranks_stop_together(path: str, eos_on_first: bool):
    from hybrid.conversion.hf import hf_parts, read_hf_config
    from hybrid.evaluation import loaded_model
    from hybrid.model.generate import SamplingOptions, generate
    from hybrid.parallel.dims import ParallelDims
    from hybrid.parallel.groups import build_groups
    config = read_hf_config(path, "--load-hf")
    groups = build_groups(ParallelDims(2, 1, 1))
    model = loaded_model(config, groups, lambda wanted: hf_parts(path, config, wanted), torch.device("cpu"))
    batch = prompts()[groups.dp.rank::2]
    first = generate(model, None, batch, SamplingOptions(max_new_tokens=NEW)).tokens
    eos = (first[0][0],) if groups.dp.rank == 0 else (-5,)  # rank 0's first row ends at once, rank 1's never
    out = generate(model, groups, batch[:1], SamplingOptions(max_new_tokens=NEW, eos=eos),
                   sync=groups.dp if eos_on_first else None)
    return out.stats["steps"], [len(t) for t in out.tokens]


@pytest.mark.slow
def test_ranks_that_must_step_together_decode_until_every_one_has_ended(hf_models):
    """`sync` (ZeRO-3's data-parallel ranks, whose every step gathers parameters; EP's expert group): a rank whose
    rows have all ended keeps stepping until its peers' have (its row stays ended); without it, it stops."""
    path = str(hf_models["llama3"][0])
    together = run_on_ranks(_ranks_stop_together, 2, path, True)
    alone = run_on_ranks(_ranks_stop_together, 2, path, False)
    assert together == [(NEW, [1]), (NEW, [NEW])] and alone == [(1, [1]), (NEW, [NEW])]


def _write(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@pytest.mark.slow
def test_generate_script_writes_transformers_completions_for_text_and_chat_prompts_at_tp2(tmp_path):
    from tests.chat_templates import family_tokenizer
    tok = family_tokenizer("qwen25")
    path = tmp_path / "model"
    hf = make_family("qwen2", path, tokenizer=False, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    tok.save_pretrained(path)
    rows = [{"prompt": "The cat sat on", "answer": "mat"},
            {"messages": [{"role": "user", "content": "Say hello."}]},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}]}]
    _write(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "out.jsonl"
    proc = run("torchrun", 2, ["--load-hf", path, "--tensor-model-parallel-size", 2, "--prompts",
                               tmp_path / "prompts.jsonl", "--max-new-tokens", 8, "--output", out],
               script="launch/generate.py")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    written = [json.loads(line) for line in open(out)]
    assert len(written) == 3 and summary["prompts"] == 3
    for row, got in zip(rows, written):
        prompt = row.get("prompt", row.get("messages"))
        ids = tok(prompt)["input_ids"] if isinstance(prompt, str) else \
            tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           do_sample=False, max_new_tokens=8, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        assert got["completion_ids"] == want and got["prompt"] == prompt
        assert got["completion"] == tok.decode(want, skip_special_tokens=True) and len(got["logprobs"]) == len(want)

    # --stop: a completion ends at the token that completes the stop string, which it keeps
    first = written[0]["completion"]
    stop = first[1:4] if len(first) >= 4 else first
    run("python", 1, ["--load-hf", path, "--prompts", tmp_path / "prompts.jsonl", "--max-new-tokens", 8, "--output",
                      out, "--stop", stop], script="launch/generate.py")
    cut = [json.loads(line) for line in open(out)][0]
    assert stop in cut["completion"] and written[0]["completion_ids"][:len(cut["completion_ids"])] == \
        cut["completion_ids"] and stop not in tok.decode(cut["completion_ids"][:-1], skip_special_tokens=True)


@pytest.mark.parametrize("rows,flags,message", [
    ([{"text": "no prompt here"}], [], "no prompt: give 'prompt'"),
    ([{"prompt": "fine"}], ["--top-p", "0"], "--top-p 0.0: give a value in (0, 1]"),
    ([{"prompt": "fine"}], ["--max-new-tokens", "0"], "--max-new-tokens 0: give at least 1"),
])
def test_bad_prompts_and_settings_are_one_message_exit_2(rows, flags, message, tmp_path, hf_models, capsys):
    from hybrid.generation import main
    from tests.hf_families import save_embedded_tokenizer
    path, _ = hf_models["llama3"]
    save_embedded_tokenizer(path)
    _write(tmp_path / "p.jsonl", rows)
    code = main(["--load-hf", str(path), "--prompts", str(tmp_path / "p.jsonl"), "--output",
                 str(tmp_path / "o.jsonl")] + flags)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and not (tmp_path / "o.jsonl").exists()


def test_generate_ends_at_every_eos_of_the_models_generation_config_with_another_tokenizer_dir(tmp_path, hf_models):
    """generation_config.json's eos_token_id is read from the model's directory (--load-hf) when --tokenizer-model
    names another one without it (before: from the tokenizer's, so the model's end tokens were missed); every id
    listed ends a row: here every id, so each completion is one token."""
    import shutil

    from hybrid.generation import main
    from tests.hf_families import save_embedded_tokenizer
    model, tokenizer = tmp_path / "model", tmp_path / "tokenizer"
    shutil.copytree(hf_models["llama3"][0], model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(8192))}))
    save_embedded_tokenizer(tokenizer)
    _write(tmp_path / "p.jsonl", [{"prompt": "The cat sat on"}, {"prompt": "Once upon a"}])
    assert main(["--load-hf", str(model), "--tokenizer-model", str(tokenizer), "--prompts", str(tmp_path / "p.jsonl"),
                 "--max-new-tokens", "6", "--output", str(tmp_path / "o.jsonl")]) == 0
    assert [len(json.loads(line)["completion_ids"]) for line in open(tmp_path / "o.jsonl")] == [1, 1]


def test_stop_strings_match_special_tokens_as_transformers_stop_strings():
    """--stop "<|im_end|>" (a special token) ends a completion where transformers' stop_strings
    (StopStringCriteria) does: the text is matched with special tokens kept (before: decoded without them, so a
    special-token stop never matched and rows ran to --max-new-tokens)."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    from hybrid.generation import stop_rule
    from tests.chat_templates import family_tokenizer
    tok = family_tokenizer("qwen25")
    text = tok("Hello there", add_special_tokens=False)["input_ids"]
    for stop in ("<|im_end|>", "<|im_start|>", "there"):
        rule, criteria = stop_rule(tok, [stop]), StopStringCriteria(tok, [stop])
        for completion in (text, text + [tok.convert_tokens_to_ids(stop) if stop.startswith("<|") else text[-1]],
                           [tok.convert_tokens_to_ids("<|im_end|>")], [tok.convert_tokens_to_ids("<|im_start|>")]):
            want = bool(criteria(torch.tensor([completion]), None)[0])
            assert rule(0, completion) == want, (stop, tok.decode(completion), want)
        assert rule(0, text + [tok.convert_tokens_to_ids(stop) if stop.startswith("<|") else text[-1]])


class FactoriesWithoutDevice(torch.overrides.TorchFunctionMode):
    """Records every tensor factory call made from hybrid's own code without a `device`: on a GPU such a tensor
    would be made on the CPU and meet the CUDA model or a NCCL collective (a CPU run cannot see that)."""

    FACTORIES = {torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.tensor, torch.as_tensor,
                 torch.randint, torch.rand, torch.randn, torch.eye}

    def __init__(self):
        super().__init__()
        self.missing = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1)
            if f"{os.sep}hybrid{os.sep}" in caller.f_code.co_filename:
                self.missing.append(f"{caller.f_code.co_filename}:{caller.f_lineno} {func.__name__}")
        return func(*args, **kwargs)


def test_generation_and_the_grpo_loss_make_every_tensor_on_the_models_device(hf_models):
    """A CPU stand-in for the GPU check: no tensor factory in the decoding loop, the KV cache, sampling or the GRPO
    loss leaves out its device (so none is made on the host beside a CUDA model or for a NCCL collective)."""
    from hybrid.model.generate import SamplingOptions, generate
    from hybrid.model.grpo import GRPOOptions, completion_rows
    from hybrid.model.objectives import GroupPolicy
    from hybrid.parallel.groups import ParallelGroups
    path, _ = hf_models["qwen3"]
    model = one_rank_model(path)
    batch = prompts()
    watch = FactoriesWithoutDevice()
    with watch:
        out = generate(model, None, batch, SamplingOptions(max_new_tokens=4, temperature=1.0, top_p=0.9, eos=(5,)),
                       stop=lambda row, tokens: False)
    ids, labels, values = completion_rows(batch, out.tokens, out.logprobs, torch.ones(len(batch)), 24, 0)
    objective = GroupPolicy(ParallelGroups.single(), model.config.vocab_size, GRPOOptions(2, beta=0.1))
    with watch:
        objective.loss(model(ids, stage=0), objective.target(ids, labels, (values,)), torch.ones(()))
        objective.metrics()
    assert watch.missing == []
