"""fmoe-serve under load on localhost: throughput and latency at 1, 4 and 8 concurrent clients, per policy.

    python -m benchmarks.serve_load [--model fmoe-tiny-mixtral] [--requests 32] [--new-tokens 16]

For each policy (resident, on_demand_lru, fmoe at a 25 % expert cache) the real CLI runs in a subprocess
(`--warmup`, and `--max-batch` as given: above 1, greedy requests are served by continuous batching; 1 serves
each request alone); clients in threads stream greedy completions with the official `openai` client, each
client sending its next request as soon as the last one ends, `--requests` requests per level. Every answer
is checked against a single-request reference: with `--max-batch 1`, the same prompt generated alone in this
process (`fmoe_jax.generate`, resident); above 1, the same prompt served alone by the same server before the
load starts (continuous batching gives a request the tokens it gets alone, which in bfloat16 are not always
`generate`'s; how many differ from `generate` is reported too). A dropped, failed or different answer is
counted and makes the script exit 1, as does any program compiled during a level (the server's
`fmoe_compilations`). Latency is client-side, request sent to `[DONE]`; TTFT to the first text; throughput
is generated tokens over the level's wall time. The hit rate is the server's since it started (its warm-up
included).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, colours, print_table, save, save_png, saved

NAME = "serve_load"
CLIENTS = (1, 4, 8)
POLICIES = ("resident", "on_demand_lru", "fmoe")
PROMPTS = [  # at most 16 tokens each on the shipped models' tokenizer
    "Once upon a time",
    "KING HENRY:\nWhat say you, lords, to",
    "def fibonacci(n):\n    ",
    "The best way to keep your garden healthy is",
    "Die Stadt liegt am Ufer des",
    "It was late in the evening when",
    "In this paper we propose",
    "ROMEO:\nBut soft",
    "import numpy as np\n",
    "She opened the door and",
    "Customers who bought this",
    "class Stack:\n    def",
]


class ServerProcess:
    """`python -m fmoe_jax.serve` on a free localhost port; its log in a temporary file."""

    def __init__(self, model: str, options: list[str], timeout: float = 600):
        self.log = tempfile.NamedTemporaryFile("w+", prefix="fmoe-serve-", suffix=".log")
        command = [sys.executable, "-m", "fmoe_jax.serve", model, "--port", "0", "--warmup"]
        self.proc = subprocess.Popen(command + options, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while (
            found := re.search(r"serving .+? on (http://\S+)", Path(self.log.name).read_text())
        ) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"fmoe-serve did not start:\n{Path(self.log.name).read_text()[-3000:]}")
            time.sleep(0.2)
        self.url = found[1]

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=30).read().decode()
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(found[1]) if found else 0.0

    def stop(self) -> int:
        self.proc.terminate()
        code = self.proc.wait(120)
        self.log.close()
        return code


def complete(url: str, model: str, prompt: str, new_tokens: int) -> str:
    """One greedy completion, alone (no other request in flight)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=new_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def run_level(url: str, model: str, clients: int, count: int, new_tokens: int, reference: dict) -> dict:
    """`count` streamed greedy requests from `clients` threads; latencies and the answers' check."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    lock, next_index = threading.Lock(), iter(range(count))
    results: list[dict] = []

    def one(prompt: str) -> dict:
        start, first, text = time.perf_counter(), None, ""
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=new_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
                text += chunk.choices[0].text
        end = time.perf_counter()
        return dict(latency=end - start, ttft=(first or end) - start, ok=text == reference[prompt])

    def worker() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            try:
                result = one(PROMPTS[i % len(PROMPTS)])
            except Exception as err:  # noqa: BLE001 - a failed request is counted, the load goes on
                result = dict(latency=float("nan"), ttft=float("nan"), ok=False, error=repr(err))
            with lock:
                results.append(result)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for future in [pool.submit(worker) for _ in range(clients)]:
            future.result()
    wall = time.perf_counter() - start
    latency = np.array([r["latency"] for r in results if r["ok"]])
    ttft = np.array([r["ttft"] for r in results if r["ok"]])
    good = len(latency)

    def percentile(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q) * 1e3) if len(values) else float("nan")

    return dict(
        clients=clients,
        requests=count,
        answered_correctly=good,
        wrong_or_failed=count - good,
        errors=sorted({r["error"] for r in results if "error" in r})[:3],
        wall_s=wall,
        tokens_per_s=good * new_tokens / wall,
        requests_per_s=good / wall,
        latency_p50_ms=percentile(latency, 50),
        latency_p99_ms=percentile(latency, 99),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--model", default="fmoe-tiny-mixtral", help="a shipped model (or checkpoint directory)"
    )
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens per request (EOS ignored)")
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS), help="concurrency levels")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES, help="policies")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=4,
        help="fmoe-serve --max-batch (>1: continuous batching; 1: each request alone)",
    )
    parser.add_argument("--budget", type=float, default=0.25, help="fraction of experts the cache holds")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and PNG results")
    args = parser.parse_args()

    import fmoe_jax as fj

    with fj.load_model(args.model) as resident:
        reference = {
            p: fj.generate(resident, p, max_new_tokens=args.new_tokens, stop_at_eos=False).texts[0]
            for p in PROMPTS
        }
        cfg = resident.config
    slots = max(1, round(args.budget * cfg.num_moe_layers * cfg.num_experts))
    name = Path(args.model).name
    rows = []
    for policy in args.policies:
        options = [] if policy == "resident" else ["--policy", policy, "--cache-experts", str(slots)]
        if policy == "fmoe":
            options += ["--prefetch-distance", "1"]  # the shipped 8-layer models' best (benchmarks/README.md)
        server = ServerProcess(args.model, options + ["--max-batch", str(args.max_batch)])
        try:
            expected = reference
            if args.max_batch > 1:  # each prompt served alone by this server
                expected = {p: complete(server.url, name, p, args.new_tokens) for p in PROMPTS}
            for clients in args.clients:
                compiled = server.metric("fmoe_compilations")
                compile_s = server.metric("fmoe_compile_seconds_total")
                row = run_level(server.url, name, clients, args.requests, args.new_tokens, expected)
                row.update(
                    policy=policy,
                    compilations=server.metric("fmoe_compilations") - compiled,
                    compile_s=server.metric("fmoe_compile_seconds_total") - compile_s,
                    prompts_unlike_generate=sum(expected[p] != reference[p] for p in PROMPTS),
                )
                row["hit_rate"] = server.metric("fmoe_expert_hit_rate")
                rows.append(row)
                rate, p99 = row["tokens_per_s"], row["latency_p99_ms"]
                print(f"{policy:>14} x{clients}: {rate:.1f} tok/s, p99 {p99:.0f} ms", flush=True)
        finally:
            code = server.stop()
        if code != 0:
            print(f"fmoe-serve ({policy}) exited with {code} after SIGTERM", file=sys.stderr)
    columns = ["policy", "clients", "requests", "wrong_or_failed", "tokens_per_s", "requests_per_s"]
    columns += ["latency_p50_ms", "latency_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "compilations", "hit_rate"]
    columns += ["prompts_unlike_generate"]
    print(
        f"\n{NAME}: {name}, {args.new_tokens} new tokens per request, --max-batch {args.max_batch}, "
        f"cache {slots} experts when offloaded"
    )
    print_table(rows, columns)
    payload = dict(model=name, new_tokens=args.new_tokens, max_batch=args.max_batch, slots=slots, rows=rows)
    save(NAME, payload, args.out)
    plot(saved(NAME, args.out), args.out / f"{NAME}.png")
    if any(r["wrong_or_failed"] for r in rows):
        sys.exit("some requests failed or differed from their single-request reference (see the table)")
    if any(r["compilations"] for r in rows):
        sys.exit("programs compiled while serving (see the table): a shape --warmup did not cover")


def plot(payload: dict, path: Path) -> None:
    """Throughput and p99 latency against concurrent clients, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    colour = colours(policies)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for policy in policies:
        mine = [r for r in rows if r["policy"] == policy]
        x = [r["clients"] for r in mine]
        axes[0].plot(x, [r["tokens_per_s"] for r in mine], "o-", color=colour[policy], label=policy)
        axes[1].plot(x, [r["latency_p99_ms"] for r in mine], "o-", color=colour[policy], label=policy)
    for ax, label in zip(axes, ("generated tokens / s", "p99 latency (ms)"), strict=True):
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r["clients"] for r in rows}))
    axes[0].legend(fontsize=8)
    backend = payload["machine"]["backend"]
    fig.suptitle(
        f"live ({backend}): fmoe-serve on {payload['model']}, {payload['new_tokens']} tokens per request"
    )
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
