"""What launch/serve.py's HTTP front and batching cost against the decoder called directly, as JSON.

    python benchmarks/bench_serve.py [--hidden-size 512] [--num-layers 4] [--batch 8] [--new 64] [--repeats 3]

One rank, one process, the same Llama (bench_generate.make_model) and prompts: (a) `generate` on the batch of
`--batch` prompts, greedy, `--new` tokens each (no end token: every row runs to the limit); (b) the same prompts as
`--batch` separate /v1/completions requests sent at once through the `openai` client, held until all are queued
so they decode as one batch (as concurrent agents' requests do); (c) the same requests one after another (no
batching). Tokens/s of each and the ratios to (a); the texts of (b) equal (a)'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "results", "serve_cpu.json"))
    a = p.parse_args()
    import torch
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from bench_generate import make_model, prompts
    from hybrid.conversion.hf import hf_parts, read_hf_config
    from hybrid.evaluation import loaded_model
    from hybrid.model.generate import SamplingOptions, generate
    from hybrid.parallel.groups import ParallelGroups
    from hybrid.serving import build_parser, run
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models
    rows = prompts(a.batch)
    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp, a.hidden_size, a.num_layers)
        # a word-level tokenizer whose eos never comes up (ids in, text out: the prompts are token ids)
        vocab = {f"t{i}": i for i in range(8192)}
        fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                       eos_token="t0", unk_token="t1")
        fast.save_pretrained(tmp)
        config = read_hf_config(tmp, "--load-hf")
        model = loaded_model(config, ParallelGroups.single(), lambda w: hf_parts(tmp, config, w), torch.device("cpu"))
        options = SamplingOptions(max_new_tokens=a.new, eos=(0,), pad=0)  # the model's end id, as the server's
        direct = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            out = generate(model, None, rows, options)
            direct.append(time.perf_counter() - start)
        del model
        result = {}

        def client(url, server):
            import openai
            c = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
            ask = dict(model="m", max_tokens=a.new, temperature=0)
            c.completions.create(prompt=rows[0], **{**ask, "max_tokens": 2})  # warm
            together, alone, texts = [], [], [None] * len(rows)
            for _ in range(a.repeats):
                def one(k):
                    texts[k] = c.completions.create(prompt=rows[k], **ask).choices[0].text
                start = time.perf_counter()
                with server.taking:
                    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(rows))]
                    for t in threads:
                        t.start()
                    while server.jobs.qsize() < len(rows) - 1:
                        time.sleep(0.001)
                for t in threads:
                    t.join()
                together.append(time.perf_counter() - start)
            start = time.perf_counter()
            for k in range(len(rows)):
                c.completions.create(prompt=rows[k], **ask)
            alone.append(time.perf_counter() - start)
            result.update(together=together, alone=alone, texts=texts, batches=server.stats["largest_batch"])
            server.stop()

        def ready(url, server):
            threading.Thread(target=client, args=(url, server), daemon=True).start()

        os.environ.setdefault("WORLD_SIZE", "1")
        run(build_parser().parse_args(["--load-hf", tmp, "--port", "0", "--served-model-name", "m",
                                       "--max-batch-size", str(a.batch)]), ready=ready)
        want = [fast.decode(t, skip_special_tokens=True) for t in out.tokens]
    tokens = sum(len(t) for t in out.tokens)
    best = {"direct": min(direct), "batched_requests": min(result["together"]), "sequential_requests":
            min(result["alone"])}
    report = {"shape": {"hidden": a.hidden_size, "layers": a.num_layers, "requests": a.batch, "new_tokens": a.new},
              "threads": torch.get_num_threads(),
              "tokens_per_s": {k: round(tokens / v, 1) for k, v in best.items()},
              "ratio_to_direct": {k: round(best["direct"] / v, 3) for k, v in best.items() if k != "direct"},
              "largest_batch": result["batches"], "same_text_as_direct": result["texts"] == want}
    print(json.dumps(report, indent=1))
    with open(a.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
