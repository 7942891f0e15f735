"""--grpo: TRL's GRPO on the engine's own completions. The loss and gradients equal TRL 1.16's own
GRPOTrainer._compute_loss on the same completions and values; the advantages equal TRL's formula with its nanstd;
reward functions that fail are one message naming them and the prompt; launched runs learn, equal one rank at
TP 2 + SP, and resume bitwise."""

from __future__ import annotations

import json

import pytest
import torch

from tests.hf_families import make_family, save_embedded_tokenizer
from checks.launch_helpers import MERGES, VOCAB, read_log, run

G, NEW = 4, 6


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    hf = make_family("llama3", root / "m", tokenizer=False)
    save_embedded_tokenizer(root / "m")
    return root / "m", hf


def _completions(seed: int = 5):
    """2 prompts x G completions of 1 .. NEW tokens, prompts of different lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 8192, (n,), generator=g).tolist() for n in (5, 9)]
    rows = [p for p in prompts for _ in range(G)]
    completions = [torch.randint(1, 8192, (int(n),), generator=g).tolist()
                   for n in torch.randint(1, NEW + 1, (len(rows),), generator=g)]
    return rows, completions


def _trl_trainer(hf, path, tmp, loss_type, beta, temperature, **config):
    """TRL's GRPOTrainer on `hf` (TRL 1.16 builds the temperature into the model's fused LM head here: a trainer's
    temperature is its construction's)."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(output_dir=str(tmp), report_to=[], use_cpu=True, bf16=False, fp16=False, num_generations=G,
                      per_device_train_batch_size=2 * G, max_completion_length=NEW, loss_type=loss_type, beta=beta,
                      epsilon=0.2, epsilon_high=0.28, temperature=temperature, **config)
    hf.config._name_or_path = str(path)  # where TRL loads its reference model from (beta > 0)
    trainer = GRPOTrainer(model=hf, reward_funcs=lambda prompts, completions, **_: [0.0] * len(prompts), args=args,
                          train_dataset=datasets.Dataset.from_list([{"prompt": "x"}] * 8),
                          processing_class=AutoTokenizer.from_pretrained(path))
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _trl_inputs(rows, completions, advantages):
    """TRL's batch: prompts left-padded, completions right-padded, with their masks."""
    width = max(len(p) for p in rows)
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in rows])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
    completion_ids = torch.tensor([c + [0] * (NEW - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (NEW - len(c)) for c in completions])
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages,
            "num_items_in_batch": completion_mask.sum().float()}


def _objective_against_trl(path, hf, rows, completions, advantages, options, fresh, sampled, planes: dict):
    """The GRPO objective as the runtime runs it (target, loss, the runtime's item scale) on TRL's batch: rows of
    `rows` + `completions` with the sampler's log-probabilities `sampled` [n, NEW] and the other planes (Value ->
    [n, NEW]) at the completions' positions; its loss backpropagated into a one-rank copy of `path`, whose
    gradients must equal `hf`'s (TRL's backward, already run). Returns (loss, objective)."""
    from hybrid.model.grpo import Value, completion_rows
    from hybrid.model.objectives import GroupPolicy
    from hybrid.parallel.groups import ParallelGroups
    from hybrid.training.reduction import ItemScale
    from tests.test_generation import one_rank_model
    seq = max(len(p) for p in rows) + NEW
    ids, labels, values = completion_rows(rows, completions, [sampled[r, :len(c)].tolist()
                                                              for r, c in enumerate(completions)], advantages, seq, 0)
    for r, c in enumerate(completions):
        first = len(rows[r]) - 1
        for plane, tensor in planes.items():
            values[r, plane, first:first + len(c)] = tensor[r, :len(c)]
    values[:, Value.FRESH] = 1.0 if fresh else 0.0
    model = one_rank_model(path).train()
    groups = ParallelGroups.single()
    objective = GroupPolicy(groups, model.config.vocab_size, options)
    scale = ItemScale(objective, groups, torch.device("cpu"))([(ids, labels)])
    loss = objective.loss(model(ids, stage=0), objective.target(ids, labels, (values,)), scale)
    loss.backward()
    for ours, theirs in [(model.embedding.word_embeddings.weight.grad[:8192], hf.model.embed_tokens.weight.grad),
                         (model.final_norm.weight.grad, hf.model.norm.weight.grad),
                         (model.layers[1].input_norm.weight.grad, hf.model.layers[1].input_layernorm.weight.grad),
                         (model.layers[0].mlp.fc2.weight.grad, hf.model.layers[0].mlp.down_proj.weight.grad)]:
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * theirs.abs().max().item())
    return loss, objective


@pytest.mark.parametrize("loss_type,beta,fresh,temperature,config", [
    ("dapo", 0.0, False, 0.8, {}), ("grpo", 0.0, False, 0.8, {}), ("dapo", 0.04, False, 0.8, {}),
    ("grpo", 0.04, False, 0.8, {}), ("dr_grpo", 0.0, False, 0.8, {}), ("dapo", 0.04, True, 0.8, {}),
    pytest.param("bnpo", 0.0, False, 0.8, {}, marks=pytest.mark.slow),
    # temperature 1 in fp32: the cross-entropy overwrites the logits, the entropies are read before it
    pytest.param("grpo", 0.04, False, 1.0, {"top_entropy_quantile": 0.4}, marks=pytest.mark.slow,
                 id="grpo-kl-t1-top_entropy")])
def test_loss_and_gradients_equal_trls_compute_loss(loss_type, beta, fresh, temperature, config, policy, tmp_path):
    """Fixed completions, advantages, old log-probabilities (the policy's own, perturbed so that ratios leave the
    clip range on both sides: a later pass of --grpo-iterations) and reference log-probabilities: the GRPO objective
    as the runtime runs it (target, loss, the runtime's item scale) against TRL 1.16's GRPOTrainer._compute_loss on
    a copy of the model. `fresh`: a batch's first pass, where TRL takes the old log-probabilities as the current
    ones detached (no old_per_token_logps given) and so does the objective, whatever the sampler's were."""
    import copy
    from hybrid.model.grpo import GRPOOptions, Value
    path, hf = policy
    hf = copy.deepcopy(hf).train()
    rows, completions = _completions()
    advantages = torch.tensor([1.5, -0.5, 0.25, -1.25, 0.75, -0.75, 2.0, -2.0])
    trainer = _trl_trainer(hf, path, tmp_path, loss_type, beta, temperature, **config)
    inputs = _trl_inputs(rows, completions, advantages)
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        current, entropies, _ = trainer._get_per_token_logps_and_entropies(hf, ids, mask, NEW, compute_entropy=True)
    if "top_entropy_quantile" in config:  # the mask keeps some of the batch's tokens and drops others
        kept = trainer.get_high_entropy_mask(entropies, inputs["completion_mask"], 1 - config["top_entropy_quantile"])
        assert 0 < kept.sum() < inputs["completion_mask"].sum()
    noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(2))
    inputs["old_per_token_logps"] = current + 0.3 * noise
    inputs["ref_per_token_logps"] = current - 0.2 * noise.abs()
    want = trainer._compute_loss(hf, {k: v for k, v in inputs.items() if not (fresh and k == "old_per_token_logps")})
    want.backward()

    options = GRPOOptions(G, 0.2, 0.28, beta, loss_type, max_new_tokens=NEW, temperature=temperature, **config)
    loss, objective = _objective_against_trl(
        path, hf, rows, completions, advantages, options, fresh, inputs["old_per_token_logps"],
        {Value.REFERENCE: inputs["ref_per_token_logps"]})
    assert abs(loss.item() - want.item()) <= 1e-5 * max(abs(want.item()), 1e-3), (loss.item(), want.item())
    stats = objective.metrics()
    trl_clip = trainer._metrics["train"]["clip_ratio/region_mean"][-1]
    assert abs(stats["clip_fraction"] - trl_clip) < 1e-6 and (trl_clip == 0 if fresh else 0 < trl_clip < 1)
    if fresh:  # measured against the sampler's log-probabilities (here 0.3 x noise away)
        assert stats["logprob_mismatch"] == pytest.approx(0.3 * float((noise * inputs["completion_mask"]).abs().max()),
                                                          rel=1e-5)
    if beta:
        assert abs(stats["kl"] - trainer._metrics["train"]["kl"][-1]) < 1e-5


@pytest.fixture(scope="module")
def trl_trainer(policy, tmp_path_factory):
    """One TRL GRPOTrainer (with its reference model) whose objective settings each case sets (they are read in
    _compute_loss)."""
    path, hf = policy
    return _trl_trainer(hf, path, tmp_path_factory.mktemp("trl"), "dapo", 0.04, 0.8)


SLOW = pytest.mark.slow
OBJECTIVES = [  # our GRPOOptions fields (TRL's the same by name), fresh: a batch's first pass
    pytest.param({"loss_type": "cispo"}, False, id="cispo"),
    pytest.param({"loss_type": "sapo"}, False, id="sapo", marks=SLOW),
    pytest.param({"loss_type": "luspo", "importance_sampling_level": "sequence"}, False, id="luspo_sequence",
                 marks=SLOW),
    pytest.param({"loss_type": "vespo"}, False, id="vespo"),
    pytest.param({"loss_type": "grpo", "importance_sampling_level": "sequence", "delta": 1.25}, False, id="gspo_delta",
                 marks=SLOW),
    pytest.param({"loss_type": "cispo", "importance_sampling_level": "sequence",
                  "rollout_correction": "token_truncate"}, True, id="cispo_sequence_token_truncate"),
    pytest.param({"loss_type": "dapo", "rollout_correction": "token_mask", "correction_clip_min": 0.8,
                  "correction_clip_max": 1.25, "beta": 0.04}, False, id="dapo_token_mask_kl", marks=SLOW),
    pytest.param({"loss_type": "grpo", "rollout_correction": "sequence_truncate", "correction_clip_min": 0.5}, False,
                 id="grpo_sequence_truncate", marks=SLOW),
    pytest.param({"loss_type": "dapo", "rollout_correction": "sequence_mask", "correction_clip_max": 2.0}, True,
                 id="dapo_sequence_mask_fresh", marks=SLOW),
    pytest.param({"loss_type": "vespo", "rollout_correction": "token_truncate", "beta": 0.04}, False,
                 id="vespo_token_truncate_kl", marks=SLOW),
    pytest.param({"loss_type": "grpo", "off_policy_mask_threshold": 0.02}, False, id="grpo_off_policy_mask",
                 marks=SLOW),
    pytest.param({"loss_type": "dapo", "importance_sampling_level": "sequence", "beta": 0.04}, False,
                 id="dapo_sequence_kl", marks=SLOW),
    pytest.param({"loss_type": "grpo", "top_entropy_quantile": 0.4, "beta": 0.04}, False, id="grpo_top_entropy_kl"),
]


@pytest.mark.parametrize("fields,fresh", OBJECTIVES)
def test_every_trl_objective_and_correction_equals_trls_compute_loss(fields, fresh, policy, trl_trainer):
    """TRL 1.16's other loss types (cispo, sapo, luspo, vespo), sequence-level importance sampling (GSPO), two-sided
    clipping (delta), the rollout correction in its four modes (TRL's vLLM importance sampling correction, the ratio
    of the trainer's log-probabilities at generation to the sampler's, per token or per sequence, truncated or
    masked), DeepSeek-V3.2's off-policy sequence mask and the KL with each: the objective's loss and gradients equal
    TRL's own _compute_loss on the same completions, the trainer's old log-probabilities (a later pass of
    --grpo-iterations, or a first pass: fresh) and the sampler's. TRL computes the correction's ratio while generating
    (vLLM): the test computes it by TRL's formula (its _generate_and_score_completions) and hands it in; the
    statistics (the correction's ratios) are checked against the same values."""
    import copy
    import math
    from hybrid.model.grpo import GRPOOptions, Value
    path, hf = policy
    hf = copy.deepcopy(hf).train()
    trainer = trl_trainer
    trainer.model.train()  # (TRL files its statistics under the model's mode)
    o = GRPOOptions(G, 0.2, 0.28, max_new_tokens=NEW, iterations=2, **{"loss_type": "dapo", "temperature": 0.8,
                                                                        **fields})
    trainer.loss_type, trainer.beta, trainer.temperature = o.loss_type, o.beta, o.temperature
    trainer.importance_sampling_level = o.importance_sampling_level
    trainer.off_policy_mask_threshold = o.off_policy_mask_threshold
    trainer.top_entropy_quantile = o.top_entropy_quantile
    trainer.args.delta = o.delta
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = o.rollout_correction is not None
    rows, completions = _completions()
    advantages = torch.tensor([1.5, -0.5, 0.25, -1.25, 0.75, -0.75, 2.0, -2.0])
    inputs = _trl_inputs(rows, completions, advantages)
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        current, _, _ = trainer._get_per_token_logps_and_entropies(hf, ids, mask, NEW)
    generator = torch.Generator().manual_seed(2)
    noise, drift = torch.randn(current.shape, generator=generator), torch.randn(current.shape, generator=generator)
    cmask = inputs["completion_mask"]
    trainer_old = current if fresh else current + 0.3 * noise  # TRL's old_per_token_logps
    sampled = trainer_old + 0.15 * drift  # the sampler's (TRL: vLLM's sampling_per_token_logps)
    inputs["sampling_per_token_logps"] = sampled
    inputs["ref_per_token_logps"] = current - 0.2 * noise.abs()
    if not fresh:
        inputs["old_per_token_logps"] = trainer_old
    if o.rollout_correction:  # TRL's formula in _generate_and_score_completions
        diff = (trainer_old - sampled) * cmask
        if o.rollout_correction.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)
        ratio = torch.exp(diff)
        low = -math.inf if o.correction_clip_min is None else o.correction_clip_min
        high = math.inf if o.correction_clip_max is None else o.correction_clip_max
        ratio = torch.clamp(ratio, low, high) if o.rollout_correction.endswith("truncate") else \
            ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
        inputs["importance_sampling_ratio"] = ratio
        trl_ratios = ratio[cmask.bool()] if ratio.size(1) > 1 else ratio.flatten()
        assert 0 < len(set(trl_ratios.tolist())) and (trl_ratios != 1).any()
    if o.off_policy_mask_threshold is not None:  # some sequences dropped, some kept
        kept = trainer.get_off_policy_mask(advantages[:, None], current, sampled, cmask, o.off_policy_mask_threshold)
        assert 0 < kept.sum() < len(kept)
    if o.top_entropy_quantile < 1.0:  # the mask keeps some tokens of the batch and drops others
        _, entropies, _ = trainer._get_per_token_logps_and_entropies(hf, ids, mask, NEW, compute_entropy=True)
        kept = trainer.get_high_entropy_mask(entropies, cmask, 1 - o.top_entropy_quantile)
        assert 0 < kept.sum() < cmask.sum()
    want = trainer._compute_loss(hf, inputs)
    want.backward()

    loss, objective = _objective_against_trl(
        path, hf, rows, completions, advantages, o, fresh, sampled,
        {Value.REFERENCE: inputs["ref_per_token_logps"], Value.TRAINER: trainer_old})
    # the loss is a sum of terms of both signs: its tolerance is relative to their size (CISPO's and VESPO's terms
    # are advantage x log-probability, about 9 x 2 here, summing to 1e-3: fp32's 1e-7 per log-probability shows)
    terms = float(advantages.abs().max()) * (float(current.abs().max()) if o.loss_type in ("cispo", "vespo") else 2.0)
    assert abs(loss.item() - want.item()) <= 1e-6 * terms, (loss.item(), want.item())
    stats = objective.metrics()
    if o.rollout_correction:
        assert stats["is_ratio_mean"] == pytest.approx(float(trl_ratios.mean()), rel=1e-5)
        assert (stats["is_ratio_min"], stats["is_ratio_max"]) == pytest.approx(
            (float(trl_ratios.min()), float(trl_ratios.max())), rel=1e-5)
    if o.loss_type == "cispo":
        assert stats["clip_fraction"] == pytest.approx(trainer._metrics["train"]["cispo_clip_ratio"][-1], abs=1e-6) \
            if o.importance_sampling_level == "token" else True


def test_advantages_equal_trls_formula():
    """Group means and (group or batch) nanstd + 1e-4 as TRL computes them, None rewards (NaN) left out."""
    from trl.trainer.utils import nanstd
    from hybrid.model.grpo import advantages
    rewards = torch.tensor([1.0, 0.0, 0.5, float("nan"), 2.0, 2.0, 2.0, 2.0, 0.1, 0.9, 0.3, 0.3], dtype=torch.float64)
    grouped = rewards.view(-1, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(G)
    group_std = nanstd(grouped, dim=1).repeat_interleave(G)
    batch_std = nanstd(rewards).expand_as(rewards)
    for scale, want in [("group", (rewards - mean) / (group_std + 1e-4)),
                        ("batch", (rewards - mean) / (batch_std + 1e-4)), ("none", rewards - mean)]:
        torch.testing.assert_close(advantages(rewards, G, scale), want, equal_nan=True, rtol=0, atol=1e-12)
    assert advantages(rewards, G, "group")[4:8].abs().max() == 0  # equal rewards: no signal


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_a_failing_reward_function_is_one_message_naming_it_and_the_prompt(tmp_path):
    from hybrid.data.prompts import Prompt
    from hybrid.errors import ConfigError
    from hybrid.training.rollout import Rewards
    rewards = _write(tmp_path / "r.py", "def good(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n"
                     "def short(prompts, completions, **kw):\n    return [1.0]\n"
                     "def boom(prompts, completions, answer, **kw):\n"
                     "    return [1.0 / (a != 'x') for a in answer]\n"
                     "def inf(prompts, completions, **kw):\n    return [float('inf')] * len(prompts)\n"
                     "import torch\ndef scalars(prompts, completions, **kw):\n"
                     "    return [torch.tensor(0.5), torch.tensor(1.5, dtype=torch.float64)]\n")
    prompts = [Prompt("p0", [1], {"answer": "a"}, "data.jsonl line 1"),
               Prompt("p1", [2], {"answer": "x"}, "data.jsonl line 2")]
    total, table = Rewards([f"{rewards}:good", "hybrid.data.arithmetic:digits"], [1.0, 2.0])(prompts, ["12", "ab"],
                                                                                           [[1], [2]])
    assert total.tolist() == [1.0 + 2 * 0.25, 1.0] and table.shape == (2, 2)
    # 0-d tensors, as TRL accepts them (it makes a tensor of the list); before: refused as not a number
    assert Rewards([f"{rewards}:scalars"], [])(prompts, ["12", "ab"], [[1], [2]])[0].tolist() == [0.5, 1.5]
    for spec, message in [(f"{rewards}:short", "returned 1 values for 2 completions"),
                          (f"{rewards}:boom", "raised ZeroDivisionError: float division by zero (on data.jsonl line 2"),
                          (f"{rewards}:inf", "returned inf for data.jsonl line 1"),
                          (f"{rewards}:missing", "has no function missing"),
                          (f"{tmp_path}/nope.py:f", "no file"), ("no_colon", "expected FILE.py:NAME")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            Rewards([spec], [])(prompts, ["12", "ab"], [[1], [2]])


TASK = ["--grpo", "--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 32,
        "--max-position-embeddings", 32, "--global-batch-size", 32, "--micro-batch-size", 8, "--lr", 3e-2,
        "--max-new-tokens", 8, "--grpo-group-size", 8, "--log-interval", 1, "--no-demo", "--seed", 3]


# CISPO's loss with GSPO's sequence ratio and the rollout correction truncating each token's trainer / sampler ratio
OBJECTIVE = ["--grpo-loss-type", "cispo", "--grpo-importance-sampling-level", "sequence",
             "--grpo-rollout-correction", "token_truncate"]


@pytest.mark.slow
def test_cispo_with_sequence_ratios_and_the_rollout_correction_learns_at_tp2(tmp_path):
    """CISPO's loss with GSPO's sequence-level ratio and the token-truncated rollout correction (OBJECTIVE) on the
    embedded task from scratch at TP 2 + SP: the reward rises within 30 iterations; the correction's ratios (the
    trainer's log-probabilities against the sampler's, fp32) are 1 within 1e-5 and logged each iteration; the first
    8 iterations equal one rank's (later a near-tie in some draw may part the two runs: CISPO's loss sums advantage
    x log-probability, terms near 10 cancelling to about 0.05, so fp32's last bits weigh more than in dapo's; 19
    iterations of one rank's run and TP 2's parted so)."""
    log = tmp_path / "tp2.jsonl"
    run("torchrun", 2, TASK + ["--train-iters", 30] + OBJECTIVE + ["--tensor-model-parallel-size", 2,
                                                                   "--sequence-parallel", "--log-json", log])
    got = read_log(log)
    assert len(got) == 30
    for r in got:
        assert 1 - 1e-5 <= r["is_ratio_min"] <= r["is_ratio_mean"] <= r["is_ratio_max"] <= 1 + 1e-5, r
        assert r["logprob_mismatch"] <= 1e-5
    first, last = (sum(r["reward_mean"] for r in got[k:k + 5]) / 5 for k in (0, 25))
    assert last > first + 0.3, [round(r["reward_mean"], 3) for r in got]
    from checks.launch_helpers import one_rank
    for x, y in zip(one_rank(TASK + ["--train-iters", 30, "--exit-interval", 8] + OBJECTIVE), got[:8]):
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-9), (x, y)
        assert abs(x["lm_loss"] - y["lm_loss"]) <= 5e-5 + 1e-4 * abs(x["lm_loss"]), (x, y)


@pytest.mark.slow
def test_grpo_at_tp2_sp_equals_one_rank_and_resumes_bitwise(tmp_path):
    """The embedded arithmetic task from scratch: at TP 2 + SP the run's completions, losses, gradient norms and
    rewards equal one rank's (the sampler is keyed by completion, not by rank); the sampler's log-probabilities equal
    the trainer's within 1e-5 (fp32); a run resumed at iteration 4 continues bitwise. (That the reward rises: the
    README command's test at one rank, CISPO's at TP 2.)"""
    from checks.launch_helpers import one_rank
    flags = TASK + ["--train-iters", 6]  # (test_grpo_layouts_equal_one_rank's one-rank baseline: run once)
    two = tmp_path / "two.jsonl"
    a = one_rank(flags)
    run("torchrun", 2, flags + ["--tensor-model-parallel-size", 2, "--sequence-parallel", "--log-json", two])
    b = read_log(two)
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert abs(x["lm_loss"] - y["lm_loss"]) <= 1e-5 + 1e-4 * abs(x["lm_loss"]), (x["iteration"], x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-6 + 1e-4 * x["grad_norm"], (x, y)
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-9)
        assert x["logprob_mismatch"] <= 1e-5 and y["logprob_mismatch"] <= 1e-5

    save, resumed = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    run("python", 1, flags + ["--save", save, "--save-interval", 4, "--exit-interval", 4])
    run("python", 1, flags + ["--save", save, "--load", save, "--log-json", resumed])
    again = read_log(resumed)
    assert [r["iteration"] for r in again] == [5, 6]
    for x, y in zip(a[4:6], again):
        assert x["lm_loss"] == y["lm_loss"] and x["reward_mean"] == y["reward_mean"], (x, y)


def test_bad_grpo_flags_are_one_message(tmp_path, capsys):
    from hybrid.training.run import main
    for flags, message in [(["--grpo", "--grpo-group-size", "1"], "--grpo-group-size 1"),
                           (["--grpo", "--sft"], "--grpo with --sft or --dpo"),
                           (["--grpo-beta", "0.1"], "set GRPO: add --grpo"),
                           (["--grpo", "--data-path", str(tmp_path / "p.jsonl"), "--vocab-file", VOCAB, "--merge-file",
                             MERGES], "needs --reward-function"),
                           (["--grpo", "--reward-function", "a.py:f", "--reward-weights", "1", "2"],
                            "2 weights for 1 --reward-function"),
                           (["--grpo", "--temperature", "0"], "--temperature 0.0"),
                           (["--grpo", "--global-batch-size", "12", "--micro-batch-size", "4"],
                            "--global-batch-size 12: --grpo counts completions"),
                           (["--grpo", "--grpo-beta", "0.1"], "--grpo-beta > 0 needs --load-hf"),
                           (["--grpo", "--dry-run", "--dry-run-world-size", "4", "--context-parallel-size", "4",
                             "--global-batch-size", "2", "--grpo-group-size", "2", "--micro-batch-size", "1"],
                            "each of the 4 ranks of the sequence split samples"),
                           (["--grpo", "--grpo-loss-type", "vespo", "--grpo-rollout-correction", "sequence_mask"],
                            "VESPO folds the correction"),
                           (["--grpo", "--grpo-rollout-correction-clip-max", "2"], "give a mode"),
                           (["--grpo", "--grpo-rollout-correction", "token_mask", "--grpo-rollout-correction-clip-min",
                             "2", "--grpo-rollout-correction-clip-max", "1.5"], "give 0 <= min < max"),
                           (["--grpo", "--grpo-delta", "0.9"], "must exceed 1"),
                           (["--grpo-mask-truncated-completions"], "set GRPO: add --grpo"),
                           (["--grpo", "--grpo-top-entropy-quantile", "1.5"], "--grpo-top-entropy-quantile 1.5"),
                           (["--moe-routing-replay"], "--moe-routing-replay set GRPO: add --grpo"),
                           (["--grpo", "--moe-routing-replay"], "the model has no MoE layers"),
                           (["--grpo", "--moe-routing-replay", "R2"], "with --grpo-iterations 1 there are none"),
                           (["--grpo", "--grpo-max-turns", "2"], "add --grpo-environment"),
                           (["--grpo", "--grpo-environment", "e.py:E", "--grpo-max-tokens-per-turn", "0"],
                            "give at least 1"),
                           (["--grpo-environment", "e.py:E"], "--grpo-environment set GRPO: add --grpo"),
                           (["--grpo", "--grpo-dynamic-sampling-max-rounds", "3"], "with --grpo-dynamic-sampling"),
                           (["--grpo", "--grpo-reasoning-gym-size", "8"], "add --grpo-reasoning-gym TASK"),
                           (["--grpo", "--grpo-reasoning-gym", "chain_sum", "--data-path", "p.jsonl", "--vocab-file",
                             VOCAB, "--merge-file", MERGES], "one prompt source")]:
        assert main(flags + ["--no-demo", "--save", str(tmp_path / "s")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (flags, err)
    assert not (tmp_path / "s").exists()


def test_prompts_that_leave_no_room_for_the_completion_are_left_out_and_counted(caplog):
    from hybrid.data.prompts import Prompt
    from hybrid.errors import ConfigError
    from hybrid.training.rollout import usable_prompts
    prompts = [Prompt(f"p{n}", list(range(1, n + 1)), {}, f"line {n}") for n in (3, 9, 10, 12)]
    kept = usable_prompts(prompts, seq_length=16, max_new_tokens=7)  # room: 16 + 1 - 7 = 10 prompt tokens
    assert [len(p.ids) for p in kept] == [3, 9, 10]
    with pytest.raises(ConfigError, match="no prompt fits --seq-length 8 with --max-new-tokens 7"):
        usable_prompts(prompts, seq_length=8, max_new_tokens=7)


def test_prompt_rows_are_tokenized_as_trl_does():
    from tests.chat_templates import family_tokenizer
    from hybrid.data.prompts import encode_prompt
    tok = family_tokenizer("llama3")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert encode_prompt(tok, "Hello there") == tok(text="Hello there")["input_ids"]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert encode_prompt(tok, messages) == want and tok.decode(want).endswith("assistant<|end_header_id|>\n\n")


MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--disable-bias-linear"]
MLA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", 16, "--kv-lora-rank", 12, "--qk-head-dim", 16,
       "--qk-pos-emb-head-dim", 8, "--v-head-dim", 12]
# layer 0 Gated DeltaNet, layer 1 gated full attention (Qwen3.5's)
GDN = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--qk-layernorm", "--attention-output-gate", "--experimental-attention-variant", "gated_delta_net",
       "--linear-attention-freq", 2, "--linear-num-key-heads", 2, "--linear-num-value-heads", 4,
       "--linear-key-head-dim", 16, "--linear-value-head-dim", 16, "--linear-attention-chunk-size", 16]


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", [
    ([], ["--pipeline-model-parallel-size", 2]),
    (["--grpo-scale-rewards", "batch", "--untie-embeddings-and-output-weights"] + MLA,
     ["--zero-stage", 3]),
    (MOE, ["--expert-model-parallel-size", 2]),
    (GDN, ["--tensor-model-parallel-size", 2, "--sequence-parallel"]),
    (OBJECTIVE + ["--grpo-top-entropy-quantile", 0.5, "--grpo-iterations", 2], ["--context-parallel-size", 2]),
    (GDN, ["--ds-sequence-parallel-size", 2]),
])
def test_grpo_layouts_equal_one_rank(model, layout, tmp_path):
    """PP 2 (decoding through the stages), DP 2 with ZeRO-3 (the stage's parameters gathered once per generation
    batch with ZeRO-3's hooks off, and the hooks back for training: an MLA model's up projections with the attention
    that decodes from the latents, the untied tables' row blocks; each rank its own prompt groups, the advantages
    scaled by the whole batch's std) and EP 2 (an MoE model,
    experts split over the data-parallel ranks) and TP 2 + SP for a Gated DeltaNet model (prompts prefilled by
    chunks, completions decoded a token at a time from the cached state and conv tail, trained by chunks), and the
    sequence splits: CP 2 (the ring) with CISPO, GSPO's sequence ratio, the rollout correction, the entropy quantile
    and a second pass over each batch, whose rows need all their tokens at once, and Ulysses 2 on the Gated DeltaNet
    model (each sequence rank samples half of the rows as a data-parallel rank would, then all train on all): the
    completions' rewards, the losses, the gradient norms and the mismatch as at one rank, over 6 iterations."""
    from checks.launch_helpers import one_rank
    flags = TASK + ["--train-iters", 6] + model
    want = one_rank(flags)
    log = tmp_path / "log.jsonl"
    run("torchrun", 2, flags + layout + ["--log-json", log])
    got = read_log(log)
    assert len(got) == len(want) == 6
    for x, y in zip(want, got):
        assert abs(x["lm_loss"] - y["lm_loss"]) <= 1e-5 + 1e-4 * abs(x["lm_loss"]), (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-6 + 1e-4 * x["grad_norm"], (x, y)
        generated = "--grpo-iterations" not in model or x["iteration"] % 2  # (a batch's second pass logs no rollout)
        assert ("reward_mean" in x) == ("reward_mean" in y) == ("logprob_mismatch" in y) == bool(generated), (x, y)
        if generated:
            assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-9), (x, y)
            for name in ("digits", "exact_answer"):  # each function's own mean (TRL's rewards/NAME/mean), weights 1
                assert x[f"rewards/{name}/mean"] == pytest.approx(y[f"rewards/{name}/mean"], abs=1e-9), (name, x, y)
            assert y["rewards/digits/mean"] + y["rewards/exact_answer/mean"] == pytest.approx(y["reward_mean"],
                                                                                           abs=1e-9)
            assert y["logprob_mismatch"] <= 1e-5


REPLAY = TASK[:TASK.index("--global-batch-size")] + [
    "--global-batch-size", 16, "--micro-batch-size", 8, "--lr", 5e-2, "--max-new-tokens", 8, "--grpo-group-size", 8,
    "--log-interval", 1, "--no-demo", "--seed", 3, "--train-iters", 4, "--grpo-iterations", 2] + MOE


@pytest.mark.slow
@pytest.mark.parametrize("mode,layout", [("R3", ["--expert-model-parallel-size", 2]),
                                         ("R3", ["--tensor-model-parallel-size", 2, "--sequence-parallel"]),
                                         ("R3", ["--pipeline-model-parallel-size", 2]),
                                         ("R2", ["--tensor-model-parallel-size", 2, "--sequence-parallel"]),
                                         ("R2", ["--pipeline-model-parallel-size", 2])])
def test_moe_routing_replay_trains_on_recorded_experts_at_every_layout(mode, layout, tmp_path):
    """--moe-routing-replay (megatron-core's RouterReplay, verl's R3): the experts each token was routed to while
    generating are recorded and the training forward routes it to them, weighed by the live router. With
    --grpo-iterations 2 at a large learning rate the second pass over a batch routes most decisions elsewhere
    without replay (routing_mismatch logged, > 0.2) and none with it, which changes that step's loss; at EP 2, TP 2 +
    SP and PP 2 (each stage its own layers' record) the replayed run equals one rank's, with the generator's
    log-probabilities equal to the trainer's (fp32, 1e-5: the record sits at the right positions, or the first
    pass's logits would move). R2 (verl's): the record is the trainer's own routing in its forward for the old
    log-probabilities (the weights that generated the batch), so the first pass replays nothing different (each
    rank writes and reads back its own tokens, its part of the sequence under SP, its stages' layers) and the second
    routes as the first."""
    from checks.launch_helpers import one_rank
    free, r3 = one_rank(REPLAY), one_rank(REPLAY + ["--moe-routing-replay"])
    want = one_rank(REPLAY + ["--moe-routing-replay", mode])
    assert [r["routing_mismatch"] == 0 for r in free] == [True, False, True, False], free
    assert free[1]["routing_mismatch"] > 0.2 and abs(free[1]["lm_loss"] - want[1]["lm_loss"]) > 1e-4
    assert want[1]["routing_replayed"] > 0.2 and want[0]["routing_replayed"] == 0 == free[1]["routing_replayed"]
    if mode == "R2":  # (in fp32 on one CPU the generator routes as the trainer does: both records are the same)
        assert want[0]["lm_loss"] == free[0]["lm_loss"] and [r["lm_loss"] for r in want] == [r["lm_loss"] for r in r3]
    log = tmp_path / "log.jsonl"
    run("torchrun", 2, REPLAY + ["--moe-routing-replay", mode, "--log-json", log] + layout)
    got = read_log(log)
    assert len(got) == len(want) == 4
    for x, y in zip(want, got):  # (the routing shares: every rank's rows, layers and part of the sequence)
        assert x["routing_mismatch"] == y["routing_mismatch"] == 0, (x, y)
        assert x["routing_replayed"] == pytest.approx(y["routing_replayed"], abs=1e-9), (x, y)
        assert abs(x["lm_loss"] - y["lm_loss"]) <= 1e-5 + 1e-4 * abs(x["lm_loss"]), (x, y)
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-9) if "reward_mean" in x else True
        if x["iteration"] % 2:  # a batch's first pass
            assert y["logprob_mismatch"] <= 1e-5 and x["logprob_mismatch"] <= 1e-5


@pytest.mark.slow
def test_grpo_from_load_hf_with_chat_prompts_a_reward_file_and_the_kl(tmp_path):
    """A HuggingFace model with a chat template: conversational prompts (their answer column passed to the reward),
    a reward function from a file, the KL to the frozen starting model (beta 0.04, TRL's bias-corrected k3) at
    TP 2 + SP: it runs, the KL is 0 on the first iteration (policy = reference) and positive after, the sampler's
    log-probabilities equal the trainer's, and the checkpoint generates with launch/generate.py."""
    from tests.chat_templates import family_tokenizer
    tok = family_tokenizer("qwen25")
    path = tmp_path / "model"
    make_family("qwen2", path, tokenizer=False, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                max_position_embeddings=128)
    tok.save_pretrained(path)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": str(a + b)}
            for a in range(4) for b in range(4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = _write(tmp_path / "reward.py", "def has_answer(prompts, completions, completion_ids, answer, **kw):\n"
                    "    assert completions[0][0]['role'] == 'assistant'\n"
                    "    return [float(a in c[0]['content']) + 0.01 * len(ids) for c, a, ids in "
                    "zip(completions, answer, completion_ids)]\n")
    log, save = tmp_path / "log.jsonl", tmp_path / "ckpt"
    run("torchrun", 2, ["--grpo", "--load-hf", path, "--data-path", tmp_path / "prompts.jsonl", "--reward-function",
                        f"{reward}:has_answer", "--grpo-beta", 0.04, "--grpo-group-size", 4, "--global-batch-size", 8,
                        "--micro-batch-size", 4, "--seq-length", 64, "--max-new-tokens", 8, "--train-iters", 3,
                        "--lr", 1e-3, "--tensor-model-parallel-size", 2, "--sequence-parallel", "--log-interval", 1,
                        "--log-json", log, "--save", save])
    records = read_log(log)
    assert len(records) == 3 and records[0]["kl"] == 0.0 and records[-1]["kl"] > 0
    assert all(r["logprob_mismatch"] <= 1e-5 and r["completion_length"] > 0 for r in records)
    assert (save / "reward.png").stat().st_size > 1000
    out = tmp_path / "out.jsonl"
    run("torchrun", 2, ["--load", save, "--tokenizer-model", path, "--prompts", tmp_path / "prompts.jsonl",
                        "--max-new-tokens", 4, "--output", out], script="launch/generate.py")
    assert len(out.read_text().splitlines()) == len(rows)


@pytest.mark.slow
def test_readme_grpo_command_learns_the_embedded_task_and_draws_the_reward(tmp_path):
    """The README's --grpo command (its flags on one rank, 12 of its 30 iterations; the launcher itself is the main
    command's test): the reward on the embedded task rises from near 0 (the LR schedule is 12 iterations long
    here), reward.png is written and the export samples."""
    import shlex
    from checks.docs import page_with
    readme = page_with("grpo-command")
    command = shlex.split(readme.split("<!-- grpo-command -->")[1].split("```bash")[1].split("```")[0].strip())
    assert command[:2] == ["deepspeed", "launch/train.py"] and "--grpo" in command, command
    log, save = tmp_path / "log.jsonl", tmp_path / "grpo"
    proc = run("python", 1, command[2:] + ["--train-iters", 12, "--save", save, "--log-json", log,
                                           "--no-progress-bar"])
    rewards = [r["reward_mean"] for r in read_log(log)]
    assert len(rewards) == 12 and sum(rewards[:3]) / 3 < 0.1 and sum(rewards[-3:]) / 3 > 0.4, rewards
    assert (save / "reward.png").stat().st_size > 1000 and "sample (transformers, from" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], pytest.param(["--pipeline-model-parallel-size", 2], marks=pytest.mark.slow)])
def test_grpo_iterations_reuse_a_generation_batch_against_the_samplers_log_probabilities(layout, tmp_path):
    """--grpo-iterations 2: a batch is generated every second iteration (its rewards logged then), the second step
    on it is off-policy (the ratio moved: some tokens clipped), and the mismatch is measured on first passes only.
    The second pass's old log-probabilities are the trainer's from generation time (computed by the rollout, on the
    last stage at PP 2): with the rollout correction on, its ratios to the sampler's are 1 within 1e-5 on both
    passes (a missing or misplaced plane would give exp(sampler) or another token's)."""
    log = tmp_path / "log.jsonl"
    run("python" if not layout else "torchrun", 1 if not layout else 2, TASK[:TASK.index("--global-batch-size")] + [
        "--global-batch-size", 16, "--micro-batch-size", 8, "--lr", 2e-2, "--max-new-tokens", 8, "--grpo-group-size",
        8, "--log-interval", 1, "--no-demo", "--seed", 3, "--train-iters", 4, "--grpo-iterations", 2,
        "--grpo-loss-type", "grpo", "--grpo-rollout-correction", "token_truncate", "--log-json", log] + layout)
    records = read_log(log)
    assert [("reward_mean" in r, "logprob_mismatch" in r) for r in records] == [(True, True), (False, False)] * 2
    assert records[1]["clip_fraction"] > 0 and records[0]["clip_fraction"] == 0
    for r in records:
        assert 1 - 1e-5 <= r["is_ratio_min"] <= r["is_ratio_max"] <= 1 + 1e-5, r


@pytest.mark.slow
def test_dynamic_sampling_refills_groups_without_signal_at_tp2_as_at_one_rank(tmp_path):
    """--grpo-dynamic-sampling (DAPO's): without it a model from scratch trains on groups whose rewards all agree
    (TRL's frac_reward_zero_std > 0); with it every batch that filled within the rounds holds none, more groups
    were sampled than trained (groups_dropped), and TP 2 + SP draws the same refills, rewards and losses as one rank
    (the refill prompts and keys depend on the seed, generation, data-parallel rank and round only)."""
    from checks.launch_helpers import one_rank
    flags = TASK + ["--train-iters", 4]
    plain = one_rank(flags + ["--exit-interval", 2])
    assert max(r["frac_reward_zero_std"] for r in plain) > 0, plain
    want = one_rank(flags + ["--grpo-dynamic-sampling", "--grpo-dynamic-sampling-max-rounds", 6])
    log = tmp_path / "tp2.jsonl"
    run("torchrun", 2, flags + ["--grpo-dynamic-sampling", "--grpo-dynamic-sampling-max-rounds", 6,
                                "--tensor-model-parallel-size", 2, "--sequence-parallel", "--log-json", log])
    got = read_log(log)
    assert len(got) == len(want) == 4
    assert any(r["sampling_rounds"] > 1 and r["groups_dropped"] > 0 for r in want), want
    for x, y in zip(want, got):
        assert (x["sampling_rounds"], x["groups_dropped"]) == (y["sampling_rounds"], y["groups_dropped"]), (x, y)
        assert x["sampling_rounds"] == 6 or x["frac_reward_zero_std"] == 0.0, x
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-9), (x, y)
        assert abs(x["lm_loss"] - y["lm_loss"]) <= 1e-5 + 1e-4 * abs(x["lm_loss"]), (x, y)
        assert y["logprob_mismatch"] <= 1e-5


def test_a_group_has_signal_when_its_scored_rewards_differ():
    from hybrid.training.rollout import _has_signal
    nan = float("nan")
    for rewards, want in [([0.0, 0.0, 0.0], False), ([0.0, 1.0, 0.0], True), ([nan, nan], False),
                          ([1.0, nan, nan], False), ([1.0, nan, 0.5], True), ([0.25, 0.25, nan], False)]:
        assert _has_signal(torch.tensor(rewards, dtype=torch.float64)) is want, rewards


def test_masked_truncated_completions_count_as_trl_counts_them():
    """--grpo-mask-truncated-completions on a batch of ended and truncated completions: the truncated rows (last token
    neither an end token nor the pad, TRL's rule) keep no label, the ended ones all theirs; a token mean (dapo) then
    counts the ended rows' tokens only, a sequence mean (grpo) every row (TRL's num_items_in_batch and its .mean())."""
    from types import SimpleNamespace
    from hybrid.model.grpo import GRPOOptions
    from hybrid.model.objectives import GroupPolicy
    from hybrid.parallel.cross_entropy import IGNORE_INDEX
    from hybrid.parallel.groups import ParallelGroups
    from hybrid.training.rollout import Rollout
    eos, pad = 7, 9
    rollout = object.__new__(Rollout)
    rollout.options = GRPOOptions(2, max_new_tokens=3, mask_truncated_completions=True)
    rollout.eos, rollout.tokenizer, rollout.seq_length = (eos,), SimpleNamespace(pad_token_id=pad), 8
    rollout.device, rollout.reference = torch.device("cpu"), None
    prompts = [SimpleNamespace(ids=[1, 2]), SimpleNamespace(ids=[3])] * 2
    tokens = [[4, eos], [4, 5, 6], [5, 5, pad], [6]]  # ended, truncated, ended at the pad, stopped early (truncated)
    _, labels, _ = rollout._rows(prompts, tokens, [[-1.0] * len(t) for t in tokens], torch.ones(4))
    kept = (labels != IGNORE_INDEX).sum(1).tolist()
    assert kept == [2, 0, 3, 0]
    groups = ParallelGroups.single()
    for loss_type, count in (("dapo", 5), ("grpo", 4), ("cispo", 5), ("luspo", 4)):
        objective = GroupPolicy(groups, 16, GRPOOptions(2, loss_type=loss_type))
        assert int(objective.count(None, labels)) == count, loss_type


@pytest.mark.slow
def test_truncated_completions_can_train_on_nothing(tmp_path):
    """--grpo-mask-truncated-completions (TRL's mask_truncated_completions): a model from scratch never ends a
    completion within 8 tokens, so every row is masked: the loss and the gradient are 0, where without the flag
    they are not (the same completions, whose rewards differ)."""
    flags = TASK[:TASK.index("--global-batch-size")] + [
        "--global-batch-size", 16, "--micro-batch-size", 8, "--max-new-tokens", 8, "--grpo-group-size", 8,
        "--log-interval", 1, "--no-demo", "--seed", 3, "--train-iters", 1, "--lr", 1e-2]
    masked, free = tmp_path / "masked.jsonl", tmp_path / "free.jsonl"
    run("python", 1, flags + ["--grpo-mask-truncated-completions", "--log-json", masked])
    run("python", 1, flags + ["--log-json", free])
    masked, free = read_log(masked), read_log(free)
    assert all(r["completion_length"] == 8 for r in masked + free)  # every completion truncated
    assert [(r["lm_loss"], r["grad_norm"]) for r in masked] == [(0.0, 0.0)]
    assert free[0]["grad_norm"] > 0.1 and free[0]["reward_std"] > 0  # (rewards that differ: a signal to mask)


def test_a_prompt_the_chat_template_refuses_is_one_message_naming_its_line(tmp_path, capsys):
    """Two user turns in a row under Mistral's template (which raises on roles out of order): one message naming
    the file's line, for --grpo's prompts and launch/generate.py alike (before: a jinja2 traceback)."""
    from hybrid.data.prompts import read_prompts
    from hybrid.errors import ConfigError
    from hybrid.generation import main
    from tests.chat_templates import family_tokenizer
    tok = family_tokenizer("mistral")
    rows = [{"prompt": [{"role": "user", "content": "Hi."}]},
            {"prompt": [{"role": "user", "content": "One."}, {"role": "user", "content": "Two."}]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=f"{path} line 2: the chat template could not render the prompt"):
        read_prompts(str(path), tok, "--data-path")
    model = tmp_path / "model"
    make_family("llama3", model, tokenizer=False, vocab_size=len(tok))
    tok.save_pretrained(model)
    assert main(["--load-hf", str(model), "--prompts", str(path), "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "line 2: the chat template could not render" in err and "Traceback" not in err


def test_prompt_files_in_jsonl_and_parquet_give_the_same_prompts_and_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from hybrid.data.prompts import read_prompts
    from tests.chat_templates import family_tokenizer
    tok = family_tokenizer("qwen25")
    rows = [{"prompt": "Two plus two?", "answer": "4"},
            {"prompt": [{"role": "user", "content": "Three plus one?"}], "answer": "4"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "Three plus one?"}],
                                          "answer": "4"}]), tmp_path / "p.parquet")
    jsonl, parquet = read_prompts(str(tmp_path / "p.jsonl"), tok), read_prompts(str(tmp_path / "p.parquet"), tok)
    assert jsonl[0].ids == tok("Two plus two?")["input_ids"] and jsonl[0].columns == {"answer": "4"}
    assert parquet[0].ids == jsonl[1].ids and parquet[0].columns == {"answer": "4"}
    assert jsonl[1].where.endswith("line 2") and parquet[0].where.endswith("row 0")


@pytest.mark.slow
def test_grpo_ends_completions_at_every_eos_of_the_generation_config(policy, tmp_path):
    """A model whose generation_config.json lists end tokens beyond the tokenizer's EOS (Gemma 3's <end_of_turn>,
    GLM-4.5's <|user|>, GPT-OSS's <|call|>): the rollout stops at each, as TRL and launch/generate.py do. Here every
    id ends a turn, so every completion is its first token (before: only the tokenizer's EOS stopped it, and the
    rewards and loss were computed on text after the turn ended)."""
    import shutil

    from checks.launch_helpers import one_rank
    path = tmp_path / "m"
    shutil.copytree(policy[0], path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(8192))}))
    records = one_rank(["--grpo", "--load-hf", path, "--grpo-group-size", 2, "--global-batch-size", 4,
                        "--micro-batch-size", 2, "--seq-length", 64, "--max-new-tokens", 6, "--train-iters", 2,
                        "--lr", 1e-4, "--log-interval", 1, "--no-demo"])
    assert [r["completion_length"] for r in records] == [1.0, 1.0], records


def _entropies_on_ranks(logits: torch.Tensor, mask: torch.Tensor, vocab: int, threshold: float):
    """Rank r: the entropies of its TP half of the (padded) vocabulary, and the high-entropy mask of its half of
    the rows with the quantile over both ranks (as over two data-parallel ranks)."""
    import torch.distributed as dist
    from hybrid.model.grpo import high_entropy_mask
    from hybrid.parallel.cross_entropy import vocab_parallel_entropy
    from hybrid.parallel.groups import Axis
    rank, half = dist.get_rank(), logits.size(-1) // 2
    entropies = vocab_parallel_entropy(logits[..., rank * half:(rank + 1) * half], dist.group.WORLD, vocab)
    rows = logits.size(0) // 2
    mine = slice(rank * rows, (rank + 1) * rows)
    keep = high_entropy_mask(entropies[mine], mask[mine], threshold, Axis(2, rank, dist.group.WORLD))
    return entropies, keep


def test_top_entropy_quantile_entropies_and_mask_equal_trls_over_tp_and_data_parallel_ranks():
    """--grpo-top-entropy-quantile's parts at 2 ranks: the entropy from TP-split logits (the vocabulary's padding
    left out) equals TRL's entropy_from_logits on the whole vocabulary, and the mask with the quantile over both
    ranks' tokens equals TRL's get_high_entropy_mask on the whole batch (its gather being over its processes)."""
    from types import SimpleNamespace
    from checks.rank_pool import run_on_ranks
    from trl import GRPOTrainer
    from trl.trainer.utils import entropy_from_logits
    vocab, padded = 37, 40
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 9, padded, generator=g) * torch.linspace(0.2, 4.0, 6)[:, None, None]
    logits[..., vocab:] = 50.0  # padding columns: never part of the softmax
    mask = torch.rand(6, 9, generator=g) > 0.3
    want = entropy_from_logits(logits[..., :vocab])
    single = SimpleNamespace(accelerator=SimpleNamespace(pad_across_processes=lambda t, dim, pad_index: t,
                                                         gather=lambda t: t))
    for threshold in (0.6, 0.25):
        ranks = run_on_ranks(_entropies_on_ranks, 2, logits, mask, vocab, threshold)
        for entropies, _ in ranks:
            torch.testing.assert_close(entropies, want, rtol=1e-5, atol=1e-5)
        trl_mask = GRPOTrainer.get_high_entropy_mask(single, want, mask, threshold)
        ours = torch.cat([keep for _, keep in ranks])
        assert torch.equal(ours, trl_mask) and 0 < ours.sum() < mask.sum()


def test_reward_columns_are_named_once_each():
    from hybrid.training.rollout import unique_names
    assert unique_names(["f", "x", "f_3", "f", "f"]) == ["f", "x", "f_3", "f_2", "f_4"]
    assert unique_names(["digits", "environment", "environment"]) == ["digits", "environment", "environment_2"]
