"""--grpo-environment: multi-turn episodes. A tool environment runs end to end at TP 2 + SP and at EP 2 (an MoE
model: the expert group's ranks decode every turn together) equal to one rank, with more than one turn per episode,
the environment's replies masked from the loss (the sampler's log-probabilities match the trainer's on every
trained token, which a reply's 0 would not); replies in a conversation are the chat template's rendering (TRL's
own tool-result suffix; the whole conversation's template); a failing environment is one message."""

from __future__ import annotations

import types

import pytest

from checks.launch_helpers import read_log, run

CALCULATOR = '''import re


class Calculator:
    """A counting tool for the embedded arithmetic task: every turn is a call, the reply counts its digits and asks
    again; the task's answer ends the episode with reward 1 (each turn's digit share before it); an odd answer's
    episode ends after two turns (so one data-parallel rank's episodes can end while the other's go on)."""

    def reset(self, prompt, answer, **columns):
        assert prompt.startswith("Question: ") and prompt.endswith("Answer:"), prompt  # the row, as TRL's example
        self.answer, self.turns = answer, 0

    def step(self, action):
        self.turns += 1
        found = re.search(r"-?\\d+", action)
        if found and found.group(0) == self.answer:
            return {"observation": None, "reward": 1.0, "done": True}
        if int(self.answer) % 2 and self.turns == 2:
            return None
        digits = sum(ch.isdigit() for ch in action)
        return {"observation": f" [tool: {digits} digits] Answer:", "reward": digits / 8.0, "done": False}


class Broken(Calculator):
    def step(self, action):
        raise KeyError("the tool is down")


class Silent(Calculator):
    def step(self, action):
        return "go on"
'''

BASE = ["--grpo", "--num-layers", 2, "--hidden-size", 64, "--num-attention-heads", 4, "--seq-length", 48,
        "--max-position-embeddings", 48, "--global-batch-size", 16, "--micro-batch-size", 8, "--lr", 3e-2,
        "--max-new-tokens", 32, "--grpo-group-size", 8, "--log-interval", 1, "--no-demo", "--seed", 3]
TASK = BASE + ["--grpo-max-turns", 3, "--grpo-max-tokens-per-turn", 4, "--train-iters", 4]
MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--disable-bias-linear"]


@pytest.fixture(scope="module")
def calculator(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "calculator.py"
    path.write_text(CALCULATOR)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", [([], ["--tensor-model-parallel-size", 2, "--sequence-parallel"]),
                                          (MOE, ["--expert-model-parallel-size", 2])])
def test_tool_episodes_train_at_tp2_and_ep2_as_at_one_rank(model, layout, calculator, tmp_path):
    from checks.launch_helpers import one_rank
    flags = TASK + model + ["--grpo-environment", f"{calculator}:Calculator"]
    want = one_rank(flags)
    log = tmp_path / "log.jsonl"
    run("torchrun", 2, flags + layout + ["--log-json", log])
    got = read_log(log)
    assert len(got) == len(want) == 4
    for x, y in zip(want, got):
        assert x["turns_per_episode"] == y["turns_per_episode"] > 1.5, (x, y)
        assert x["replies_per_episode"] == y["replies_per_episode"] > 0.5, (x, y)
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-9), (x, y)
        assert abs(x["lm_loss"] - y["lm_loss"]) <= 1e-5 + 1e-4 * abs(x["lm_loss"]), (x, y)
        # a reply's tokens carry the sampler's log-probability 0: trained on, the gap would be their -log p
        assert x["logprob_mismatch"] <= 1e-5 and y["logprob_mismatch"] <= 1e-5
        assert 0 < y["completion_length"] < 32  # the model's tokens only (TRL counts tool_mask's ones)


def _environment(tokenizer, conversational=True):
    from hybrid.training.environments import Environment
    return Environment("hybrid.data.arithmetic:digits", tokenizer, [tokenizer.eos_token_id], conversational, 3, None)


def test_replies_in_a_conversation_are_the_chat_templates_rendering():
    """A tool reply's tokens are TRL's own tool-result suffix (GRPOTrainer._get_tool_suffix_ids); a user reply's
    make prompt + turn + reply the template's rendering of the whole conversation with the next generation prompt;
    a turn the per-turn limit cut gets the end token first."""
    from trl import GRPOTrainer

    from hybrid.training.environments import Reply
    from tests.chat_templates import family_tokenizer
    tok = family_tokenizer("qwen25")
    env = _environment(tok)
    trl = types.SimpleNamespace(processing_class=tok, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
                                _tokenizer=tok)
    for text, name in [("42", "add"), ("{'error': 'no such file'}", "read")]:
        want = GRPOTrainer._get_tool_suffix_ids(trl, [{"role": "tool", "name": name, "content": text}])
        assert env.reply_ids(Reply(text, None, False, "tool", name), True) == want
    prompt = [{"role": "user", "content": "What is 2 plus 3?"}]
    turn, reply = "Let me count.", "Count again, please."

    def ids(messages, generation):
        return list(tok.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True,
                                            return_dict=True)["input_ids"])
    turn_ids = ids(prompt + [{"role": "assistant", "content": turn}], False)
    turn_ids = turn_ids[:max(k for k, t in enumerate(turn_ids) if t == tok.eos_token_id) + 1]
    whole = ids(prompt + [{"role": "assistant", "content": turn}, {"role": "user", "content": reply}], True)
    assert turn_ids + env.reply_ids(Reply(reply, None, False), True) == whole
    assert env.reply_ids(Reply(reply, None, False), False) == [tok.eos_token_id] + env.reply_ids(
        Reply(reply, None, False), True)


def test_step_answers_are_read_as_gym_and_trl_give_them_and_bad_ones_are_one_message():
    from hybrid.errors import ConfigError
    from hybrid.training.environments import Reply, reply_of
    obs = types.SimpleNamespace(observation="x", reward=1, done=False)  # an object with the fields (OpenEnv's kind)
    for result, want in [("more", Reply("more", None, False)), (None, Reply(None, None, True)),
                         (("o", 0.5, True), Reply("o", 0.5, True)),
                         (("o", 0.5, False, True, {}), Reply("o", 0.5, True)),
                         ({"observation": "t", "reward": None, "done": False, "role": "tool", "name": "add"},
                          Reply("t", None, False, "tool", "add")), (obs, Reply("x", 1.0, False))]:
        assert reply_of(result, "e.py:E") == want
    for result, message in [(3, "step returned int"), ({"observation": 3, "done": False}, "observation is int"),
                            (("o", float("nan"), False), "reward is nan"),
                            ({"observation": "o", "done": False, "role": "system"}, "role is 'user' or 'tool'")]:
        with pytest.raises(ConfigError, match=message):
            reply_of(result, "e.py:E")


def test_a_failing_environment_is_one_message_naming_it(calculator, capsys):
    from hybrid.training.run import main
    for spec, message in [(f"{calculator}:Broken", "step raised KeyError: 'the tool is down'"),
                          (f"{calculator}:Missing", "has no class Missing"),
                          (f"{calculator}:Silent", "no episode of the batch got a reward")]:
        flags = [str(f) for f in TASK] + ["--grpo-environment", spec, "--train-iters", "1"]
        assert main(flags) == 2
        err = capsys.readouterr().err
        assert f"--grpo-environment {spec}" in err and message in err and "Traceback" not in err, err


def test_reasoning_gym_tasks_are_its_own_prompts_and_scorers():
    """--grpo-reasoning-gym: the prompts are reasoning_gym's entries (create_dataset, seeded by --seed + the task's
    place), as text or, with a chat template, its default system prompt and the question; the reward is the
    entry's own dataset scorer on the tagged answer, or the first line without tags."""
    import reasoning_gym as rg

    from hybrid.data import gym_tasks
    from hybrid.errors import ConfigError
    from tests.chat_templates import family_tokenizer
    tok = family_tokenizer("qwen25")
    plain = gym_tasks.prompts(type("Plain", (), {"__call__": lambda self, text: tok(text=text)})(),
                              ["basic_arithmetic", "chain_sum"], 4, 7)
    chat = gym_tasks.prompts(tok, ["basic_arithmetic", "chain_sum"], 4, 7)
    want = [e for k, name in enumerate(["basic_arithmetic", "chain_sum"])
            for e in rg.create_dataset(name, size=4, seed=7 + k)]
    assert [p.columns["entry"] for p in chat] == [p.columns["entry"] for p in plain] == want
    assert [p.prompt for p in plain] == [f"Question: {e['question']}\nAnswer:" for e in want]
    assert [p.prompt[-1]["content"] for p in chat] == [e["question"] for e in want]
    assert chat[0].prompt[0] == {"role": "system", "content": rg.utils.SYSTEM_PROMPTS["default"]}
    assert chat[0].ids == list(tok.apply_chat_template(chat[0].prompt, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])
    entries = [p.columns["entry"] for p in chat]
    completions = [f"Thinking.\n<answer>{entries[0]['answer']}</answer>", f"{entries[1]['answer']}\nbecause",
                   "<answer>12345678</answer>", [{"role": "assistant", "content": f"<answer>{entries[3]['answer']}"
                                                                                    f"</answer>"}]]
    got = gym_tasks.score([], completions, entries)
    scorers = [rg.create_dataset(e["metadata"]["source_dataset"], size=4, seed=7) for e in entries]
    assert got == [s.score_answer(a, e) for s, a, e in zip(scorers, [entries[0]["answer"], entries[1]["answer"],
                                                                      "12345678", entries[3]["answer"]], entries)]
    assert got[0] == got[1] == got[3] == 1.0 and got[2] < 1.0
    with pytest.raises(ConfigError, match="no such task .did you mean basic_arithmetic"):
        gym_tasks.prompts(tok, ["basic_arithmetik"], 4, 7)


def test_a_reasoning_gym_task_trains(tmp_path):
    """The task's prompts and reasoning_gym's scorer in a --grpo run (2 iterations, one rank): it runs to the end
    and logs the reward of every completion scored."""
    from hybrid.training.run import main
    log = tmp_path / "log.jsonl"
    assert main([str(f) for f in BASE] + ["--grpo-reasoning-gym", "basic_arithmetic", "--grpo-reasoning-gym-size", "64",
                         "--train-iters", "2", "--log-json", str(log)]) == 0
    records = read_log(log)
    assert len(records) == 2 and all(0.0 <= r["reward_mean"] <= 1.0 for r in records)
