"""launch/serve.py (hybrid.serving): the `openai` client's completions and chat completions answered at TP 2 + SP
at DP 2 and at PP 2 with transformers' greedy text and its forward's log-probabilities; streamed text equal to the whole
answer; stop strings cut as OpenAI's; separate requests decoded as one batch; seeded sampling equal to one rank's
decoder; bad requests refused with OpenAI's error objects; the script started as users start it and ended by a
signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from checks.launch_helpers import ROOT, env
from checks.rank_pool import run_on_ranks
from tests.hf_families import make_family

NEW = 8
TEXTS = ["The cat sat on", "Once upon a time", "def f(x):", "1, 2, 3,"]
CHAT = [{"role": "user", "content": "Say hello."}]
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "seed": 5, "n": 2}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.chat_templates import family_tokenizer
    tok = family_tokenizer("qwen25")
    path = tmp_path_factory.mktemp("serve") / "model"
    hf = make_family("qwen2", path, tokenizer=False, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    tok.save_pretrained(path)
    return path, hf, tok


def _client(url: str, server) -> dict:
    """Rank 0's client thread: every request the test checks, through the `openai` package."""
    import openai
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    out = {"models": [m.id for m in c.models.list()]}
    greedy = c.completions.create(model="model", prompt=TEXTS[:2], max_tokens=NEW, temperature=0, logprobs=2)
    out["completions"] = greedy.model_dump()
    chat = dict(model="model", messages=CHAT, max_tokens=NEW, temperature=0)
    out["chat"] = c.chat.completions.create(**chat, logprobs=True, top_logprobs=2).model_dump()
    out["chat_stream"] = [ch.model_dump() for ch in c.chat.completions.create(**chat, stream=True)]
    out["stream"] = [ch.model_dump() for ch in c.completions.create(model="model", prompt=TEXTS[0], max_tokens=NEW,
                                                                     temperature=0, stream=True)]
    first = greedy.choices[0].text
    out["stop"] = stop = first[2:5]
    cut = dict(model="model", prompt=TEXTS[0], max_tokens=NEW, temperature=0, stop=[stop, "never there"])
    out["stopped"] = c.completions.create(**cut).model_dump()
    out["stopped_stream"] = [ch.model_dump() for ch in c.completions.create(**cut, stream=True)]
    # a stop string completed by the last token max_tokens allows is still a stop
    ids = server.tokenizer(TEXTS[0])["input_ids"]
    tokens = c.completions.create(model="model", prompt=ids, max_tokens=NEW, temperature=0, logprobs=0)
    pieces = tokens.choices[0].logprobs.tokens
    out["stop_at"] = at = next(m for m in range(1, len(pieces) + 1) if stop in "".join(pieces[:m]))
    out["stop_last"] = c.completions.create(**{**cut, "max_tokens": at}).model_dump()
    out["short"] = c.completions.create(model="model", prompt=TEXTS[1], max_tokens=3, temperature=0).model_dump()
    out["sampled"] = c.completions.create(model="model", prompt=TEXTS[2], max_tokens=NEW, **SAMPLED).model_dump()
    # OpenAI's content parts; a temperature below 1e-5 decodes greedily (vLLM's rule); usage on a streamed request
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]}]
    out["parts"] = c.chat.completions.create(**{**chat, "messages": parts, "temperature": 1e-7}).model_dump()
    out["usage_stream"] = [ch.model_dump() for ch in c.chat.completions.create(
        **chat, stream=True, stream_options={"include_usage": True})]
    # separate requests sent while the decoder takes none: they decode as one batch
    answers = [None] * len(TEXTS)

    def ask(k):
        answers[k] = c.completions.create(model="model", prompt=TEXTS[k], max_tokens=NEW - k, temperature=0,
                                          logprobs=0).model_dump()

    before = dict(server.stats)
    with server.taking:
        threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(TEXTS))]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while server.jobs.qsize() < len(TEXTS) - 1 and time.time() < deadline:  # the decoder holds the first
            time.sleep(0.01)
    for t in threads:
        t.join()
    out["together"] = answers
    out["together_batches"] = server.stats["batches"] - before["batches"]
    errors = {}
    for name, request in [("model", dict(model="other", prompt="x")), ("top_p", dict(model="model", prompt="x",
                                                                                     top_p=0)),
                          ("n", dict(model="model", prompt="x", n=9)), ("echo", dict(model="model", prompt="x",
                                                                                     echo=True)),
                          ("prompt", dict(model="model", prompt=[10 ** 9])),
                          ("temperature", dict(model="model", prompt="x", temperature=-1)),
                          ("max_tokens", dict(model="model", prompt="x", extra_body={"max_tokens": 10 ** 6})),
                          ("tools", dict(model="model", prompt="x", extra_body={"tools": [{"type": "function"}]}))]:
        try:
            c.completions.create(max_tokens=2, **request)
            errors[name] = None
        except openai.APIStatusError as e:
            errors[name] = (e.status_code, e.body)
    out["errors"] = errors
    return out


def _serve_on_rank(path: str, flags: list):
    from hybrid.serving import build_parser, run
    asked = {}

    def ready(url, server):
        def work():
            try:
                asked.update(_client(url, server))
            except BaseException as e:  # the assertion in pytest names it
                import traceback
                asked["failure"] = f"{e}\n{traceback.format_exc()}"
            finally:
                server.stop()
        threading.Thread(target=work, daemon=True).start()

    stats = run(build_parser().parse_args(["--load-hf", path, "--port", "0", "--max-batch-size", "8"] + flags),
                ready=ready)
    return {"asked": asked, "stats": stats}


def _greedy(hf, tok, ids: list, new: int) -> list:
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                      max_new_tokens=new, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()


def _logprobs(hf, ids: list, completion: list) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids + completion])).logits[0, len(ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def _text(tok, ids: list) -> tuple:
    """transformers' completion as OpenAI returns it: the text without the EOS, and the finish reason."""
    if ids and ids[-1] == tok.eos_token_id:
        return tok.decode(ids[:-1], skip_special_tokens=True), "stop"
    return tok.decode(ids, skip_special_tokens=True), "length"


@pytest.mark.slow  # (about 18 s for the first layout, 8 s each after: the quick tier keeps its 5 minutes)
@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    [],  # DP 2: rows split over the ranks, gathered on rank 0
    ["--pipeline-model-parallel-size", "2"]], ids=["tp2_sp", "dp2", "pp2"])
def test_openai_client_gets_transformers_greedy_text_and_logprobs_streamed_stopped_and_batched(layout, served):
    from hybrid.model.generate import SamplingOptions, generate
    from tests.test_generation import one_rank_model
    path, hf, tok = served
    ranks = run_on_ranks(_serve_on_rank, 2, str(path), layout, timeout=600)
    assert "failure" not in ranks[0]["asked"], ranks[0]["asked"].get("failure")
    got, stats = ranks[0]["asked"], ranks[0]["stats"]
    assert got["models"] == ["model"]

    # completions: transformers' greedy text, each token's log-probability of its forward, the top alternatives
    for k, choice in enumerate(got["completions"]["choices"]):
        ids = tok(TEXTS[k])["input_ids"]
        want = _greedy(hf, tok, ids, NEW)
        assert (choice["text"], choice["finish_reason"]) == _text(tok, want), k
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(want) and "".join(logprobs["tokens"]) == \
            tok.decode(want, skip_special_tokens=False)
        assert (torch.tensor(logprobs["token_logprobs"]) - _logprobs(hf, ids, want)).abs().max() <= 1e-5
        for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
            assert len(top) == 2 and max(top.values()) == pytest.approx(lp, abs=1e-6) and token in top
    prompt_ids = [len(tok(t)["input_ids"]) for t in TEXTS[:2]]
    assert got["completions"]["usage"]["prompt_tokens"] == sum(prompt_ids)
    assert got["sampled"]["usage"]["prompt_tokens"] == len(tok(TEXTS[2])["input_ids"])  # n = 2: counted once

    # chat: the template's generation prompt, the assistant's text, per-token log-probabilities with alternatives
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    want = _greedy(hf, tok, ids, NEW)
    chat = got["chat"]["choices"][0]
    assert (chat["message"]["content"], chat["finish_reason"]) == _text(tok, want)
    assert chat["message"]["role"] == "assistant" and got["chat"]["usage"]["prompt_tokens"] == len(ids)
    content = chat["logprobs"]["content"]
    assert (torch.tensor([c["logprob"] for c in content]) - _logprobs(hf, ids, want)).abs().max() <= 1e-5
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"] for c in content)

    # streaming: the deltas add up to the whole answer; the last chunk carries the finish reason
    chunks = got["chat_stream"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks) == chat["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == chat["finish_reason"]
    assert sum(bool(c["choices"][0]["delta"]["content"]) for c in chunks[:-1]) >= 2  # deltas as decoded
    usage = got["usage_stream"]
    assert usage[-1]["choices"] == [] and usage[-1]["usage"]["completion_tokens"] == got["chat"]["usage"][
        "completion_tokens"] and usage[-1]["usage"]["prompt_tokens"] == len(ids)
    assert got["parts"]["choices"][0]["message"]["content"] == chat["message"]["content"]
    streamed = got["stream"]
    assert "".join(c["choices"][0]["text"] for c in streamed) == got["completions"]["choices"][0]["text"]
    assert len(streamed) > 2  # more than the whole text and the finish chunk: deltas came as decoded

    # stop: the text ends before the first stop string (OpenAI's), finish_reason "stop"
    stopped = got["stopped"]["choices"][0]
    full = got["completions"]["choices"][0]["text"]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == full[:full.find(got["stop"])]
    assert "".join(c["choices"][0]["text"] for c in got["stopped_stream"]) == stopped["text"]
    assert got["stopped_stream"][-1]["choices"][0]["finish_reason"] == "stop"
    last = got["stop_last"]["choices"][0]
    assert (last["finish_reason"], last["text"]) == ("stop", stopped["text"]), got["stop_at"]
    short = got["short"]["choices"][0]
    assert short["finish_reason"] == "length" and got["short"]["usage"]["completion_tokens"] == 3

    # requests sent together decode as one batch, each with its own max_tokens, each as if alone
    assert got["together_batches"] == 1 and stats["largest_batch"] >= len(TEXTS)
    for k, answer in enumerate(got["together"]):
        ids = tok(TEXTS[k])["input_ids"]
        want = _greedy(hf, tok, ids, NEW - k)
        assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == _text(tok, want), k

    # seeded sampling: choice j draws from generator (seed, j), as one rank's decoder with those keys
    eos = (tok.eos_token_id,)
    single = generate(one_rank_model(path), None, [tok(TEXTS[2])["input_ids"]] * 2,
                      SamplingOptions(NEW, SAMPLED["temperature"], SAMPLED["top_p"], 0, SAMPLED["seed"], eos, eos[0]),
                      keys=[0, 1])
    assert [c["text"] for c in got["sampled"]["choices"]] == [_text(tok, t)[0] for t in single.tokens]

    # bad requests: OpenAI's error objects and statuses
    errors = got["errors"]
    assert errors["model"][0] == 404 and "model" in errors["model"][1]["message"]
    refused = ("top_p", "n", "echo", "prompt", "temperature", "max_tokens", "tools")
    assert {k: (errors[k][0], errors[k][1]["param"]) for k in refused} == {k: (400, k) for k in refused}
    assert "--max-batch-size" in errors["n"][1]["message"] and "context length" in errors["max_tokens"][1]["message"]


@pytest.mark.slow
def test_serve_script_starts_as_users_start_it_and_a_signal_ends_it(served):
    path, hf, tok = served
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "serve.py"), "--load-hf", str(path),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        line = ""
        while "serving" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()
        url = json.loads(line)["serving"]
        request = urllib.request.Request(url + "/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"prompt": TEXTS[0], "max_tokens": 4,
                                                          "temperature": 0}).encode())
        answer = json.load(urllib.request.urlopen(request, timeout=120))
        assert answer["choices"][0]["text"] == _text(tok, _greedy(hf, tok, tok(TEXTS[0])["input_ids"], 4))[0]
        for body in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "messages": 3', b'[1, 2]'):
            bad = urllib.request.Request(url + "/completions", data=body, headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:  # JSON's NaN (Python reads it), broken JSON
                urllib.request.urlopen(bad, timeout=120)
            assert refused.value.code == 400 and json.load(refused.value)["error"]["type"] == "invalid_request_error"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err
    assert json.loads(out.strip().splitlines()[-1])["requests"] == 1


@pytest.mark.parametrize("flags,message", [(["--port", "70000"], "--port 70000"),
                                           (["--max-batch-size", "0"], "--max-batch-size"),
                                           ([], "give one of --load")])
def test_bad_server_flags_are_one_message_exit_2(flags, message, served, capsys):
    from hybrid.serving import main
    path, _, _ = served
    code = main((["--load-hf", str(path)] if "--load" not in message else []) + flags)
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


class _Chars:
    """A tokenizer of one character per id (0: the end) or, from 1000, one byte per id, whose unfinished character
    decodes to one U+FFFD per byte (SentencePiece's byte fallback: Llama 2, Mistral, Gemma)."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        data = b"".join(bytes([i - 1000]) if i >= 1000 else chr(i).encode() for i in ids if i)
        good = data.decode(errors="ignore")
        try:
            return data.decode()
        except UnicodeDecodeError:
            return good + "\ufffd" * (len(data) - len(good.encode()))


@pytest.mark.parametrize("text,stops,limit", [
    ("Observation: x", ["Observation:"], 50),  # the stop string at the start: nothing of it is sent
    ("ab STOP cd", ["STOP"], 50), ("plain text", [], 4), ("hi\N{GRINNING FACE}!", [], 50),
    ("\N{GRINNING FACE}\N{GRINNING FACE} ok", ["ok"], 50)])
def test_streamed_deltas_add_up_to_the_answer_and_never_send_a_stop_string(text, stops, limit):
    """hybrid.serving's streaming on its own: step by step as the decoder calls it, then the finish."""
    from types import SimpleNamespace
    from hybrid.model.generate import SamplingOptions
    from hybrid.generation import holds_stop
    from hybrid.serving import Job, Server, _Streams
    tokenizer = _Chars()
    server = Server(SimpleNamespace(), SimpleNamespace(), None, tokenizer, SamplingOptions(eos=(0,)), "m", "cpu")
    ids = [t for ch in text for t in ([ord(ch)] if ord(ch) < 1000 else [1000 + b for b in ch.encode()])] + [0]
    job = Job(False, [[1]], server.options, [limit], stops, [0], 0, False, True, [1])
    streams, out, sent = _Streams(server, [job], [0]), [], []
    for t in ids:
        streams.step([t])
        out.append(t)
        while not job.chunks.empty():
            sent.append(job.chunks.get_nowait()["choices"][0]["text"])
        if t == 0 or len(out) >= limit or (stops and holds_stop(tokenizer, out, stops)):
            break
    job.result = [server.finish(job, out, [0.0] * len(out), None, bool(stops) and holds_stop(tokenizer, out, stops))]
    _Streams.finish(server, job)
    while (chunk := job.chunks.get_nowait()) is not None:
        sent.append(chunk["choices"][0]["text"])
    answer = job.result[0][4]
    want = text[:text.find(stops[0])] if stops else text[:limit]
    assert answer == want and "".join(sent) == answer and all("\ufffd" not in d for d in sent)
    assert not any(s[:2] in "".join(sent) for s in stops)
