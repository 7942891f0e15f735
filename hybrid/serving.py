"""launch/serve.py: an OpenAI-compatible HTTP endpoint over the engine's own decoder (hybrid.model.generate), from
--load, --load-hf or a Megatron checkpoint at any TP x PP x EP, as Megatron-LM's text-generation server serves
its checkpoints: rank 0 answers HTTP, every rank decodes together.

    torchrun --nproc_per_node 2 launch/serve.py --load-hf DIR --tensor-model-parallel-size 2 --port 8000
    openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none").chat.completions.create(...)

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template with its
generation prompt). Request fields: max_tokens (max_completion_tokens), temperature, top_p, top_k (vLLM's
extra), n, stop, seed, logprobs (completions: an int, the alternatives per token; chat: true, with top_logprobs),
stream (server-sent events, a chunk per decoded step), echo refused by name. Anything else of OpenAI's is
ignored, as vLLM ignores what it does not use; a bad value is HTTP 400 with OpenAI's error object.

Batching: requests waiting when the decoder frees up decode together (up to --max-batch-size rows), grouped by
the settings one decode shares (temperature, top_p, top_k, seed, the number of alternatives); each row keeps its
own max_tokens and stop strings. Rank 0 hands each batch to every rank by a broadcast over the world group; the
data-parallel ranks split its rows (row k on rank k mod DP), as launch/generate.py does. While idle, rank 0
broadcasts a heartbeat each minute, so the other ranks' wait never reaches --distributed-timeout-minutes.

Completions are exactly launch/generate.py's: greedy equals transformers' `generate`; a sampled row draws from
its own generator, keyed by the request's `seed` and the choice's index (without a seed: the server's --seed and
a running row count). A completion ends at every id of the model's generation_config.json eos_token_id and the
tokenizer's EOS (finish_reason "stop"), at a stop string matched on its text with special tokens kept (the text
returned stops before it, as OpenAI's), or at max_tokens ("length"). SIGINT / SIGTERM end the server cleanly.
"""

from __future__ import annotations

import json
import math
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

import torch
import torch.distributed as dist
from jinja2.exceptions import TemplateError

from hybrid.data.prompts import encode_prompt
from hybrid.data.tokenizer import HFTokenizer, end_ids
from hybrid.distributed import log
from hybrid.errors import ConfigError
from hybrid.evaluation import add_source_flags, layout_dims, loaded_model, open_checkpoint, rank_device, script_main
from hybrid.flags import FlagParser
from hybrid.generation import holds_stop
from hybrid.model.generate import SamplingOptions, generate
from hybrid.parallel.groups import build_groups

HEARTBEAT_S = 60.0  # well inside the collectives' timeout (10 minutes, hybrid.distributed.init_distributed)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (completions' logprobs: 5)
GREEDY_BELOW = 1e-5  # a smaller temperature decodes greedily (vLLM's rule: logits / T would overflow)
# OpenAI's fields that change the answer and that this server does not apply: refused by name, not ignored
UNSUPPORTED = {  # field: (why, the values that change nothing)
    "tools": ("no tool-call parser", ([],)), "tool_choice": ("no tool-call parser", ("none", "auto")),
    "functions": ("no tool-call parser", ([],)), "response_format": ("no constrained decoding", ({"type": "text"},)),
    "logit_bias": ("no logit bias", ({},)), "presence_penalty": ("no penalties", (0,)),
    "frequency_penalty": ("no penalties", (0,)), "suffix": ("no infilling", ("",)), "best_of": ("no best-of", (1,))}


def build_parser():
    p = FlagParser(description="An OpenAI-compatible endpoint on a checkpoint's own layers at its training layout.",
                   allow_abbrev=False)
    add_source_flags(p)
    p.add_argument("--tokenizer-model", default=None, help="HuggingFace tokenizer directory (default: --load-hf's)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed at start)")
    p.add_argument("--served-model-name", default=None, help="the model's name in /v1/models and in requests "
                                                             "(default: the checkpoint directory's name)")
    p.add_argument("--max-batch-size", type=int, default=8, help="rows decoded together")
    p.add_argument("--max-tokens", type=int, default=256, help="a request's max_tokens when it gives none "
                                                              "(completions without one get OpenAI's 16)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed of requests that give none")
    p.add_argument("--bf16", action="store_true", help="decode in bf16 (the weights cast once; default: fp32)")
    return p


class RequestError(Exception):
    """A request the server refuses: HTTP status, OpenAI's error message and the field it names."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = HTTPStatus.BAD_REQUEST,
                 code: Optional[str] = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param,
                          "code": self.code}}


@dataclass
class Job:
    """One HTTP request: its rows (prompt ids, one per choice), the settings they decode with, and where the
    answer goes (`done` set when `result` holds it; `chunks` gets the streamed deltas)."""

    chat: bool
    rows: list  # prompt ids per choice, choice index = prompt index * n + j
    options: SamplingOptions
    limits: list  # max_tokens per row
    stops: list  # stop strings (every row of the job)
    keys: list  # each row's sampling key
    alternatives: int  # top logprobs asked (0: none)
    logprobs: bool
    stream: bool
    prompt_tokens: list
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    result: Optional[list] = None  # per row: (ids, logprobs, top, finish_reason, text)
    error: Optional[str] = None
    done: threading.Event = field(default_factory=threading.Event)
    chunks: "queue.Queue" = field(default_factory=queue.Queue)
    sent: dict = field(default_factory=dict)  # streaming: per choice, (text sent, tokens so far)
    streaming: bool = True  # turned off if a streamed step fails (the answer still comes whole at the end)

    def batch_key(self) -> tuple:
        o = self.options
        return o.temperature, o.top_p, o.top_k, o.seed, o.top_logprobs


class Server:
    """The decoder every rank runs, and on rank 0 the HTTP front and the queue of jobs."""

    def __init__(self, args, model, groups, tokenizer, options: SamplingOptions, name: str, device):
        self.args, self.model, self.groups, self.tokenizer = args, model, groups, tokenizer
        self.options, self.name, self.device = options, name, device
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()  # put() is safe inside a signal handler
        self.pending: list = []
        self.rows_served, self.lock = 0, threading.Lock()
        # held, the decoder takes no more than the one job it may be waiting for: requests sent meanwhile wait and
        # then decode together (an operator's pause; the tests' way to make a batch of separate requests)
        self.taking = threading.Lock()
        self.http: Optional[ThreadingHTTPServer] = None
        self.stats = {"requests": 0, "rows": 0, "batches": 0, "new_tokens": 0, "largest_batch": 0}

    # ---- rank 0: HTTP ----------------------------------------------------------------------------------------
    def listen(self) -> str:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # one line per request would drown the training log
                pass

            def _send(self, status, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path.rstrip("/") in ("/v1/models", "/models"):
                    self._send(200, {"object": "list", "data": [{"id": server.name, "object": "model",
                                                                 "created": 0, "owned_by": "hybrid"}]})
                elif self.path.rstrip("/") in ("/health", "/v1/health"):
                    self._send(200, {"status": "ok"})
                else:
                    self._send(404, RequestError(f"no route GET {self.path}", status=404).body())

            def do_POST(self):
                try:
                    try:
                        length = int(self.headers.get("Content-Length") or 0)
                    except ValueError:
                        raise RequestError("Content-Length is not a number.")
                    try:
                        body = json.loads(self.rfile.read(length) or b"{}")
                    except ValueError as e:
                        raise RequestError(f"the request body is not JSON ({e}).")
                    if not isinstance(body, dict):
                        raise RequestError("the request body must be a JSON object.")
                    route = self.path.rstrip("/")
                    if route not in ("/v1/completions", "/v1/chat/completions"):
                        raise RequestError(f"no route POST {self.path}", status=404)
                    try:
                        job = server.parse(body, chat=route.endswith("chat/completions"))
                    except RequestError:
                        raise
                    except Exception as e:  # a form parse() did not foresee: the client's error, never the server's end
                        raise RequestError(f"the request could not be read: {type(e).__name__}: {e}")
                except RequestError as e:
                    self._send(e.status, e.body())
                    return
                server.jobs.put(job)
                if job.stream:
                    self._stream(job)
                    return
                job.done.wait()
                if job.error:
                    self._send(500, RequestError(job.error, status=500).body())
                else:
                    self._send(200, server.answer(job))

            def _stream(self, job):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                try:
                    while True:
                        chunk = job.chunks.get()
                        if chunk is None:
                            break
                        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                        self.wfile.flush()
                    if job.error:  # as vLLM: an error event, then the end
                        error = RequestError(job.error, status=500).body()
                        self.wfile.write(b"data: " + json.dumps(error).encode() + b"\n\n")
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):  # the client left; its rows finish unread
                    pass

        self.http = ThreadingHTTPServer((self.args.host, self.args.port), Handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}/v1"

    def parse(self, body: dict, chat: bool) -> Job:
        """A request's JSON -> a Job (RequestError names the field OpenAI's API calls it)."""
        model = body.get("model")
        if model is not None and model != self.name:
            raise RequestError(f"The model `{model}` does not exist: this server serves `{self.name}`.", "model",
                               HTTPStatus.NOT_FOUND, "model_not_found")
        if body.get("echo"):
            raise RequestError("echo is not supported: the prompt is not returned with the completion.", "echo")
        for key, (why, neutral) in UNSUPPORTED.items():  # refused by name: the client would believe they applied
            if body.get(key) is not None and body.get(key) not in neutral:
                raise RequestError(f"{key} is not supported by this server ({why}).", key)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and "role" in m for m in messages):
                raise RequestError("messages: give a non-empty list of {\"role\", \"content\"} objects.", "messages")
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError("the model's tokenizer has no chat template: use /v1/completions.", "messages")
            try:
                prompts = [encode_prompt(self.tokenizer, [_plain(m) for m in messages])]
            except TemplateError as e:
                raise RequestError(f"the chat template could not render the messages: {e}", "messages")
        else:
            prompts = _prompt_ids(self.tokenizer, body.get("prompt"))
        vocab = self.model.config.vocab_size
        for ids in prompts:
            if not ids:
                raise RequestError("a prompt encodes to no tokens.", "prompt")
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(f"a prompt token id is outside the vocabulary [0, {vocab}).", "prompt")
        n = _int(body, "n", 1, low=1)
        default = self.args.max_tokens if chat else 16
        limit = _int(body, "max_completion_tokens", None, low=1) if chat else None
        limit = limit or _int(body, "max_tokens", default, low=1)
        temperature = _number(body, "temperature", 1.0, low=0.0)
        temperature = 0.0 if temperature < GREEDY_BELOW else temperature  # vLLM's rule: 1/T would overflow
        top_p = _number(body, "top_p", 1.0, low=0.0)
        if not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p {top_p}: give a value in (0, 1].", "top_p")
        top_k = _int(body, "top_k", 0, low=-1)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise RequestError("stop: give a string or a list of non-empty strings.", "stop")
        if chat:
            logprobs = bool(body.get("logprobs"))
            alternatives = _int(body, "top_logprobs", 0, low=0) if logprobs else 0
            if not logprobs and body.get("top_logprobs"):
                raise RequestError("top_logprobs needs logprobs: true.", "top_logprobs")
            if alternatives > MAX_TOP_LOGPROBS:
                raise RequestError(f"top_logprobs {alternatives}: give at most {MAX_TOP_LOGPROBS}.", "top_logprobs")
        else:
            alternatives = _int(body, "logprobs", None, low=0) if body.get("logprobs") is not None else None
            logprobs, alternatives = alternatives is not None, alternatives or 0
        if alternatives > MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs {alternatives}: give at most {MAX_TOP_LOGPROBS}.", "logprobs")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError("seed: give an integer.", "seed")
        rows = [ids for ids in prompts for _ in range(n)]
        if len(rows) > self.args.max_batch_size:
            raise RequestError(f"{len(rows)} completions in one request (prompts x n): this server decodes at most "
                               f"{self.args.max_batch_size} together (--max-batch-size).", "n")
        longest, room = max(len(ids) for ids in rows) + limit, self.model.config.max_position_embeddings
        if longest > room:  # the cache holds prompt + max_tokens slots per row: bounded by the model's context
            raise RequestError(f"This model's maximum context length is {room} tokens; the prompt plus max_tokens "
                               f"is {longest}: give a smaller max_tokens or a shorter prompt.", "max_tokens")
        if seed is None:
            with self.lock:
                keys = list(range(self.rows_served, self.rows_served + len(rows)))
                self.rows_served += len(rows)
        else:
            keys = list(range(len(rows)))
        alternatives = min(alternatives, vocab)
        options = replace(self.options, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                          seed=self.args.seed if seed is None else seed, top_logprobs=alternatives,
                          max_new_tokens=limit)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return Job(chat, rows, options, [limit] * len(rows), stops, keys, alternatives, logprobs,
                   bool(body.get("stream")), [len(ids) for ids in prompts], usage)

    def answer(self, job: Job) -> dict:
        """The finished job in OpenAI's response form."""
        choices = []
        for index, (ids, logps, top, reason, text) in enumerate(job.result):
            choice = {"index": index, "finish_reason": reason,
                      "logprobs": self.logprobs_of(job, ids, logps, top) if job.logprobs else None}
            if job.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {"id": ("chatcmpl-" if job.chat else "cmpl-") + job.id,
                "object": "chat.completion" if job.chat else "text_completion", "created": job.created,
                "model": self.name, "choices": choices, "usage": _usage(job), "system_fingerprint": None}

    def logprobs_of(self, job: Job, ids, logps, top) -> dict:
        """OpenAI's logprobs object. Each token's text is what it adds to the decoded text (special tokens kept), so
        the tokens add up to the text (a SentencePiece token's leading space included); an alternative's text is
        its own decode."""
        pieces, before = [], ""
        for k in range(len(ids)):
            now = self.tokenizer.decode(ids[:k + 1], skip_special_tokens=False)
            pieces.append(now[len(before):] if now.startswith(before) else self._piece(ids[k]))
            before = now
        alternatives = [list(top[k]) if top else [] for k in range(len(ids))]
        if job.chat:
            return {"content": [
                {"token": pieces[k], "logprob": lp, "bytes": list(pieces[k].encode()),
                 "top_logprobs": [{"token": self._piece(i), "logprob": v, "bytes": list(self._piece(i).encode())}
                                  for i, v in alternatives[k]]}
                for k, lp in enumerate(logps)]}
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        tops = []
        for k, (t, lp) in enumerate(zip(ids, logps)):  # OpenAI's: the n most likely, and the chosen token
            entry = {self._piece(i): v for i, v in alternatives[k]}
            entry.setdefault(pieces[k], lp)
            tops.append(entry)
        return {"tokens": pieces, "token_logprobs": logps, "text_offset": offsets, "top_logprobs": tops}

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    # ---- every rank: the decoder ---------------------------------------------------------------------------------
    def stop(self, *_) -> None:
        """End serving after the batch being decoded (SIGINT, SIGTERM)."""
        self.jobs.put(None)

    def next_batch(self) -> Optional[list]:
        """Rank 0: the jobs to decode together (waiting up to HEARTBEAT_S for the first); [] on a heartbeat; None
        when the server is told to stop."""
        if not self.pending:
            try:
                self.pending.append(self.jobs.get(timeout=HEARTBEAT_S))
            except queue.Empty:
                return []
        with self.taking:
            while True:
                try:
                    self.pending.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
        if self.pending[0] is None:  # told to stop: the requests still waiting are answered with an error
            while not self.jobs.empty():
                self.pending.append(self.jobs.get_nowait())
            for job in self.pending[1:]:
                if job is not None:
                    job.error = "the server is shutting down"
                    job.chunks.put(None)
                    job.done.set()
            return None
        first = self.pending[0]
        batch, rows, rest = [], 0, []
        for job in self.pending:
            if job is not None and job.batch_key() == first.batch_key() and \
                    rows + len(job.rows) <= self.args.max_batch_size:
                batch.append(job)
                rows += len(job.rows)
            else:
                rest.append(job)
        self.pending = rest
        return batch

    def loop(self) -> None:
        """Every rank: take rank 0's next batch, decode it together, answer on rank 0; until told to stop."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        while True:
            jobs = self.next_batch() if rank == 0 else None
            spec = [None if jobs is None else _spec(jobs)]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(spec, group_src=0)
            if spec[0] is None:
                return
            if not spec[0]["rows"]:
                continue  # a heartbeat
            try:
                results = self.decode(spec[0], jobs)
            except Exception as e:  # answer the waiting clients, then stop as any run stops on a failure
                for job in jobs or []:
                    job.error = f"decoding failed: {e}"
                    job.chunks.put(None)
                    job.done.set()
                raise
            if rank == 0:
                self.deliver(jobs, results)

    def decode(self, spec: dict, jobs: Optional[list]) -> Optional[list]:
        """Decode the batch's rows (split over the data-parallel ranks); per row on rank 0 (ids, logprobs, top,
        stopped), None elsewhere."""
        groups, rows = self.groups, spec["rows"]
        options = replace(spec["options"], max_new_tokens=max(spec["limits"]))
        dp, me = groups.dp.size, groups.dp.rank
        mine = [k for k in range(len(rows)) if k % dp == me]
        idle = not mine
        local = mine or [0]
        limits, stops = [spec["limits"][k] for k in local], [spec["stops"][k] for k in local]
        hits: dict = {}

        def stop(r, tokens):  # the same on every rank of the decode: each reads the same tokens
            if stops[r] and holds_stop(self.tokenizer, tokens, stops[r]):  # before the limit: a stop in the
                hits[r] = True                                               # last token is still a stop
                return True
            return len(tokens) >= limits[r]

        streams = _Streams(self, jobs, local) if jobs and dist_rank() == 0 and spec["stream"] else None
        needed = any(stops) or len(set(spec["limits"])) > 1  # else the decode's own limit ends every row, no host check
        out = generate(self.model, groups, [rows[k] for k in local], options, keys=[spec["keys"][k] for k in local],
                       device=self.device, stop=stop if needed else None,
                       sync=groups.ep if groups.ep.size > 1 else None,
                       on_step=streams.step if streams else None)
        local_rows = [] if idle else [(k, t[:limits[r]], lp[:limits[r]], (out.top[r][:limits[r]] if out.top else None),
                                       bool(hits.get(r))) for r, (k, t, lp) in
                                      enumerate(zip(local, out.tokens, out.logprobs))]
        if groups.tp.rank != 0 or groups.pp.rank != 0:
            return None
        if dp > 1:
            gathered = [None] * dp if me == 0 else None
            dist.gather_object(local_rows, gathered, group=groups.dp.group, group_dst=0)
            if me != 0:
                return None
            local_rows = [row for part in gathered for row in part]
        ordered = sorted(local_rows, key=lambda row: row[0])
        self.stats["new_tokens"] += sum(len(row[1]) for row in ordered)
        return [row[1:] for row in ordered]

    def deliver(self, jobs: list, results: list) -> None:
        """Rank 0: each job's rows, their text and finish reasons; stream jobs get their last chunks."""
        at = 0
        self.stats["batches"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(results))
        for job in jobs:
            mine = results[at:at + len(job.rows)]
            at += len(job.rows)
            job.result = [self.finish(job, ids, logps, top, stopped) for ids, logps, top, stopped in mine]
            self.stats["requests"] += 1
            self.stats["rows"] += len(job.rows)
            if job.stream:
                _Streams.finish(self, job)
            job.done.set()

    def finish(self, job: Job, ids: list, logps: list, top, stopped: bool) -> tuple:
        """(ids, logprobs, top, finish_reason, text): the text without special tokens, cut before a stop string."""
        eos = set(self.options.eos)
        if ids and ids[-1] in eos:
            return ids, logps, top, "stop", self.tokenizer.decode(ids[:-1], skip_special_tokens=True)
        if stopped:
            return ids, logps, top, "stop", self.cut(ids, job.stops)
        return ids, logps, top, "length", self.tokenizer.decode(ids, skip_special_tokens=True)

    def cut(self, ids: list, stops: list) -> str:
        """The text before the first stop string (matched with special tokens kept), special tokens dropped as
        everywhere else: the whole tokens before it decoded as any text, then the part of the next token that
        precedes it (plain text: a special token is matched whole)."""
        decode = self.tokenizer.decode
        text = decode(ids, skip_special_tokens=False)
        at = min((text.find(s) for s in stops if s in text), default=len(text))
        whole = 0  # the most whole tokens whose text is a prefix of the text before the stop (a token ending
        for m in range(1, len(ids) + 1):  # inside a character decodes to U+FFFD, which is no prefix)
            if text[:at].startswith(decode(ids[:m], skip_special_tokens=False)):
                whole = m
        kept = decode(ids[:whole], skip_special_tokens=False)
        return decode(ids[:whole], skip_special_tokens=True) + text[len(kept):at]


class _Streams:
    """Rank 0's streamed deltas: after each decode step, the new text of every streaming row decoded here (rows on
    other data-parallel ranks arrive whole with the finish). Text that could begin a stop string, and a character
    whose bytes have not all come, are held back until they are settled."""

    def __init__(self, server: Server, jobs: list, local: list):
        self.server = server
        self.rows = []  # (job, choice index, local row) per local row that streams
        owner, at = {}, 0
        for job in jobs:
            for j in range(len(job.rows)):
                owner[at + j] = (job, j)
            at += len(job.rows)
        for r, k in enumerate(local):
            job, j = owner[k]
            if job.stream:
                self.rows.append((job, j, r))
                job.sent[j] = ("", [])
        self.eos, self.ended = set(server.options.eos), set()
        for job in jobs:
            if job.stream and job.chat:
                for j in range(len(job.rows)):
                    job.chunks.put(_chunk(server, job, j, {"role": "assistant", "content": ""}))

    def step(self, tokens: list) -> None:
        for job, j, r in self.rows:
            if (job.id, j) in self.ended or not job.streaming:
                continue
            try:
                self._advance(job, j, tokens[r])
            except Exception:  # never let a client's stream stop the ranks: its answer comes whole at the end
                job.streaming = False

    def _advance(self, job: Job, j: int, token: int) -> None:
        tokenizer = self.server.tokenizer
        sent, ids = job.sent[j]
        ids = ids + [token]
        job.sent[j] = (sent, ids)
        if token in self.eos or (job.stops and holds_stop(tokenizer, ids, job.stops)) or len(ids) >= job.limits[j]:
            self.ended.add((job.id, j))  # its last text goes with finish_reason
            return
        text = tokenizer.decode(ids, skip_special_tokens=True)
        hold = max((len(s) for s in job.stops), default=1) - 1  # a stop string may be starting
        ready = text[:max(len(text) - hold, 0)].rstrip("\ufffd")  # U+FFFD: a character's bytes still coming
        if len(ready) > len(sent) and ready.startswith(sent):
            job.chunks.put(_delta(self.server, job, j, ready[len(sent):]))
            job.sent[j] = (ready, ids)

    @staticmethod
    def finish(server: Server, job: Job) -> None:
        for j, (ids, logps, top, reason, text) in enumerate(job.result):
            already = job.sent.get(j, ("", []))[0]
            if text.startswith(already):
                rest = text[len(already):]
            else:  # a tokenizer whose text changed behind what was sent: send nothing twice
                rest = ""
                log(f"serve: request {job.id} choice {j}: the streamed text is not a prefix of the answer")
            if rest:
                job.chunks.put(_delta(server, job, j, rest))
            last = _chunk(server, job, j, {} if job.chat else None, text="", reason=reason)
            if job.logprobs:  # every token's log-probabilities with the finish (not with each delta)
                last["choices"][0]["logprobs"] = server.logprobs_of(job, ids, logps, top)
            job.chunks.put(last)
        if job.include_usage:
            usage = _chunk(server, job, 0, {})
            usage["choices"], usage["usage"] = [], _usage(job)
            job.chunks.put(usage)
        job.chunks.put(None)


def _usage(job: Job) -> dict:
    """OpenAI's usage: each prompt counted once (n choices share it), every completion token."""
    prompt = sum(job.prompt_tokens)
    completion = sum(len(row[0]) for row in job.result)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _plain(message: dict) -> dict:
    """OpenAI's content forms as chat templates take them: a list of text parts joined, None as empty text."""
    content = message.get("content")
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise RequestError("messages: only text content parts ({\"type\": \"text\", \"text\": ...}) are "
                               "supported.", "messages")
        return {**message, "content": "".join(p["text"] for p in content)}
    if not isinstance(content, str):
        raise RequestError("messages: content must be a string or a list of text parts.", "messages")
    return message


def _chunk(server, job, j, delta, text=None, reason=None) -> dict:
    choice = {"index": j, "logprobs": None, "finish_reason": reason}
    if job.chat:
        choice["delta"] = delta
    else:
        choice["text"] = text if text is not None else ""
    return {"id": ("chatcmpl-" if job.chat else "cmpl-") + job.id,
            "object": "chat.completion.chunk" if job.chat else "text_completion", "created": job.created,
            "model": server.name, "choices": [choice]}


def _delta(server, job, j, text: str) -> dict:
    return _chunk(server, job, j, {"content": text}, text=text)


def _spec(jobs: list) -> dict:
    """What every rank needs of a batch (picklable): rows, keys, limits, stops, the shared settings."""
    if not jobs:
        return {"rows": []}
    return {"rows": [ids for job in jobs for ids in job.rows], "keys": [k for job in jobs for k in job.keys],
            "limits": [m for job in jobs for m in job.limits], "stops": [job.stops for job in jobs for _ in job.rows],
            "options": jobs[0].options, "stream": any(job.stream for job in jobs)}


def dist_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _prompt_ids(tokenizer, prompt) -> list:
    """OpenAI's prompt forms: a string, a list of strings, a list of ids, a list of lists of ids."""
    if isinstance(prompt, str):
        return [list(tokenizer(text=prompt)["input_ids"])]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [list(tokenizer(text=p)["input_ids"]) for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            return [list(p) for p in prompt]
    raise RequestError("prompt: give a string, a list of strings, a list of token ids or a list of such lists.",
                       "prompt")


def _int(body: dict, key: str, default, low: int):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{key} {value!r}: give an integer >= {low}.", key)
    return value


def _number(body: dict, key: str, default: float, low: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise RequestError(f"{key} {value!r}: give a finite number >= {low}.", key)
    return float(value)


def run(args, ready: Optional[Callable[[str, "Server"], None]] = None) -> dict:
    """Load the model at its layout and serve until SIGINT / SIGTERM or `Server.stop` (`ready(url, server)` is
    called on rank 0 once it listens: the tests' hook)."""
    if args.max_batch_size < 1 or args.max_tokens < 1:
        raise ConfigError("--max-batch-size and --max-tokens take at least 1.")
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port}: give 0 (any free port) to 65535.")
    source = open_checkpoint(args)
    path = args.tokenizer_model or args.load_hf
    if not path:
        raise ConfigError("serve.py needs the model's tokenizer: --tokenizer-model DIR (or --load-hf DIR).")
    tokenizer = HFTokenizer(path).to_transformers()
    eos = end_ids(tokenizer, args.load_hf, args.tokenizer_model)
    options = SamplingOptions(eos=eos, pad=eos[0] if eos else 0, seed=args.seed)
    dims = layout_dims(source, args.expert_model_parallel_size)
    groups = build_groups(dims, experts=bool(source.config.num_experts))
    device = rank_device()
    model = loaded_model(source.config, groups, source.parts, device)
    if args.bf16:
        model = model.to(torch.bfloat16)
    name = args.served_model_name or (args.load_hf or args.load).rstrip("/").split("/")[-1]
    server = Server(args, model, groups, tokenizer, options, name, device)
    started, previous = time.perf_counter(), {}
    if dist_rank() != 0 and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):  # a launcher's signal: these ranks wait for rank 0's stop
            previous[sig] = signal.signal(sig, lambda *_: None)
    if dist_rank() == 0:
        url = server.listen()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, server.stop)
        print(json.dumps({"serving": url, "model": name, "layout": {"tp": groups.tp.size, "pp": groups.pp.size,
                                                                    "dp": groups.dp.size, "ep": groups.ep.size}}),
              flush=True)
        if ready is not None:
            ready(url, server)
    try:
        server.loop()
    finally:
        if server.http is not None:
            server.http.shutdown()
            server.http.server_close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return {**server.stats, "seconds": round(time.perf_counter() - started, 3)}


def main(argv: Optional[list[str]] = None) -> int:
    return script_main(argv, build_parser, run)
