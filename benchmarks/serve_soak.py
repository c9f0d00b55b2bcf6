"""fmoe-serve soaked by hostile and careless clients on localhost, for a bounded time.

    python -m benchmarks.serve_soak [--seconds 120] [--clients 32] [--model fmoe-tiny-mixtral]

The real CLI runs in a subprocess (`--warmup`, an API key, fMoE offloading with a 25 % expert cache,
continuous batching over `--max-batch` slots). First each prompt is served alone (greedy, `MAX_TOKENS`
tokens, EOS ignored, on both endpoints): the references. Then `--clients` threads, each with its own seeded
random draw, send requests until `--seconds` have passed: valid greedy requests (either endpoint, whole or
streamed), malformed bodies, bodies over `--max-request-bytes` (with a Content-Length, or chunked), streams
cancelled after their first event, bad parameters and a wrong API key; one more thread probes `/health`.
Every answer is checked: a valid request's text must equal its reference and every other request must get
its 4xx with OpenAI's error JSON; a 5xx, a wrong text, a connection error or a timeout is a failure, and the
server's own request count must equal the requests sent (none lost). Reported: counts by kind and status,
latency of the valid requests (client-side, sent to last byte), /health's latency, the server's resident
memory before and after the soak, and programs compiled during it. Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, HelpFormatter, print_table, save, save_png, saved
from benchmarks.serve_load import PROMPTS, ServerProcess

NAME = "serve_soak"
KEY = "soak-key"
MAX_TOKENS = 12
OVERSIZED_BYTES = 5 << 20  # over fmoe-serve's default --max-request-bytes (4 MiB)
KINDS = {  # what a client sends, and how often
    "valid": 0.5,
    "malformed": 0.1,
    "oversized": 0.06,
    "cancelled": 0.1,
    "bad_parameter": 0.19,
    "wrong_key": 0.05,
}
MALFORMED = [
    b'{"model": "m", "prompt": ',
    b"not json at all",
    b"[1, 2, 3]",
    b"\xff\xfe\x00",
    b"[" * 50_000,
    b'{"prompt": "no model"}',
    b'{"model": 5, "prompt": {"a": 1}}',
]
BAD_PARAMETERS = [  # (fields over a valid completion, expected status, expected param)
    (dict(seed=2**70), 400, "seed"),
    (dict(stop=""), 400, "stop"),
    (dict(temperature=float("nan")), 400, "temperature"),
    (dict(prompt="a\ud800b"), 400, "prompt"),
    (dict(top_k=-5, temperature=0.7), 400, "top_k"),
    (dict(top_p=0.5), 400, "top_p"),
    (dict(n=2), 400, "n"),
    (dict(logprobs=9), 400, "logprobs"),
    (dict(max_tokens=10**9), 400, "prompt"),
    (dict(model="gpt-4"), 404, "model"),
]


class Client:
    """Raw HTTP to the server (what the official client would not send, too)."""

    def __init__(self, url: str, timeout: float):
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port, self.timeout = host, int(port), timeout

    def send(self, path: str, body, headers: dict[str, str], method: str = "POST", cancel: bool = False):
        """(status, body bytes); with `cancel`, the connection closes after the first bytes of the answer."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            connection.request(method, path, body, {"Content-Type": "application/json", **headers})
            response = connection.getresponse()
            data = response.read(16) if cancel else response.read()
            return response.status, data
        finally:
            connection.close()


def completion(name: str, prompt: str, **fields) -> dict:
    return dict(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **fields)


def chat(name: str, prompt: str, **fields) -> dict:
    messages = [{"role": "user", "content": prompt}]
    return dict(
        model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **fields
    )


def answer_text(path: str, data: bytes, stream: bool) -> str | None:
    """The generated text of a 200 answer (None when the stream did not end with [DONE])."""
    if not stream:
        choice = json.loads(data)["choices"][0]
        return choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    events = data.decode().strip().split("\n\n")
    if events[-1] != "data: [DONE]":
        return None
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    if path == "/v1/completions":
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def error_of(data: bytes) -> dict | None:
    try:
        error = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return error if set(error) == {"message", "type", "param", "code"} else None


def one_request(client: Client, rng: random.Random, name: str, reference: dict) -> dict:
    """Sends one request of a random kind and checks its answer: {kind, status, ok, latency_s, problem}."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    auth = {"Authorization": f"Bearer {'wrong' if kind == 'wrong_key' else KEY}"}
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    prompt = rng.choice(PROMPTS)
    stream = rng.random() < 0.5
    make = completion if path == "/v1/completions" else chat
    body: object = json.dumps(make(name, prompt, stream=stream)).encode()
    expected: tuple[int, str | None] = (200, None)
    if kind == "malformed":
        body, expected = rng.choice(MALFORMED), (400, None)
    elif kind == "oversized":
        big = json.dumps(completion(name, "x" * OVERSIZED_BYTES)).encode()
        chunked = rng.random() < 0.5
        body = (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)) if chunked else big
        path, expected = "/v1/completions", (413, None)
    elif kind == "bad_parameter":
        fields, status, param = rng.choice(BAD_PARAMETERS)
        path, expected = "/v1/completions", (status, param)
        body = json.dumps({**completion(name, prompt), **fields}).encode()
    elif kind == "wrong_key":
        expected = (401, None)
    elif kind == "cancelled":
        body = json.dumps(completion(name, prompt, stream=True)).encode()
        path = "/v1/completions"
    start = time.perf_counter()
    try:
        status, data = client.send(path, body, auth, cancel=kind == "cancelled")
    except (OSError, http.client.HTTPException) as err:
        return dict(kind=kind, status="lost", ok=False, latency_s=None, problem=f"{path}: {err!r}")
    latency = time.perf_counter() - start
    problem = None
    if status != expected[0]:
        problem = f"{kind} {path}: status {status}, expected {expected[0]}: {data[:200]!r}"
    elif kind == "valid":
        text = answer_text(path, data, stream)
        if text != reference[(path, prompt)]:
            problem = f"{path} {prompt!r} (stream={stream}): {text!r}, alone {reference[(path, prompt)]!r}"
    elif kind != "cancelled":
        error = error_of(data)
        if error is None or (expected[1] is not None and error["param"] != expected[1]):
            problem = f"{kind} {path}: not OpenAI's error JSON naming {expected[1]!r}: {data[:200]!r}"
    return dict(kind=kind, status=status, ok=problem is None, latency_s=latency, problem=problem)


def server_counts(client: Client) -> tuple[float, dict[str, float]]:
    """The server's requests answered (all routes and statuses), and a few of its gauges and counters."""
    _, data = client.send("/metrics", None, {"Authorization": f"Bearer {KEY}"}, method="GET")
    text = data.decode()
    total = sum(float(v) for v in re.findall(r"^fmoe_requests_total\{[^}]*\} (\S+)$", text, re.M))
    values = {
        name: float(m[1]) if (m := re.search(rf"^{name} (\S+)$", text, re.M)) else 0.0
        for name in ("fmoe_compilations", "fmoe_queue_depth", "fmoe_running_requests")
    }
    return total, values


def memory_mb(pid: int) -> dict[str, float]:
    """The server process's resident memory now (VmRSS) and at its peak so far (VmHWM), in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+) kB", status, re.M)[1]) / 1024 for k in ("VmRSS", "VmHWM")}


def served_alone(client: Client, name: str) -> dict[tuple[str, str], str]:
    """Each prompt's greedy text on each endpoint, served with nothing else in flight: the references."""
    reference = {}
    for path, make in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        for prompt in PROMPTS:
            status, data = client.send(
                path, json.dumps(make(name, prompt)).encode(), {"Authorization": f"Bearer {KEY}"}
            )
            if status != 200:
                raise RuntimeError(f"{path} {prompt!r} served alone: {status} {data[:300]!r}")
            reference[(path, prompt)] = answer_text(path, data, stream=False)
    return reference


def soak(url: str, name: str, reference: dict, clients: int, seconds: float, seed: int) -> dict:
    """`clients` threads sending random requests for `seconds`, and a /health prober; their results."""
    results: list[dict] = []
    health: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        rng, client = random.Random(seed * 1000 + index), Client(url, timeout=300)
        while time.monotonic() < deadline:
            result = one_request(client, rng, name, reference)
            with lock:
                results.append(result)

    def probe() -> None:
        client = Client(url, timeout=60)
        while time.monotonic() < deadline:
            start = time.perf_counter()
            status, _ = client.send("/health", None, {}, method="GET")
            health.append(time.perf_counter() - start if status == 200 else float("inf"))
            time.sleep(0.25)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    threads.append(threading.Thread(target=probe))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return dict(results=results, health=health)


def settle(client: Client, sent: float, before: float, timeout: float = 60) -> float:
    """Waits until the server has counted every request sent (cancelled streams are counted when it notices
    the client left) and nothing is queued or running; returns its count since `before`."""
    deadline = time.monotonic() + timeout
    while True:
        total, values = server_counts(client)
        idle = values["fmoe_queue_depth"] == 0 and values["fmoe_running_requests"] == 0
        if (total - before >= sent and idle) or time.monotonic() > deadline:
            return total - before
        time.sleep(0.5)


def summary(results: list[dict], health: list[float]) -> tuple[list[dict], dict]:
    rows = []
    for kind in KINDS:
        mine = [r for r in results if r["kind"] == kind]
        latency = np.array([r["latency_s"] for r in mine if r["latency_s"] is not None])
        statuses = Counter(str(r["status"]) for r in mine)
        rows.append(
            dict(
                kind=kind,
                sent=len(mine),
                failed=sum(not r["ok"] for r in mine),
                statuses=" ".join(f"{s}:{n}" for s, n in sorted(statuses.items())),
                latency_p50_ms=float(np.percentile(latency, 50) * 1e3) if len(latency) else float("nan"),
                latency_p99_ms=float(np.percentile(latency, 99) * 1e3) if len(latency) else float("nan"),
            )
        )
    valid = np.array([r["latency_s"] for r in results if r["kind"] == "valid" and r["ok"]])
    overall = dict(
        requests=len(results),
        failed=sum(not r["ok"] for r in results),
        server_errors=sum(isinstance(r["status"], int) and r["status"] >= 500 for r in results),
        lost=sum(r["status"] == "lost" for r in results),
        valid_latency_p50_ms=float(np.percentile(valid, 50) * 1e3) if len(valid) else float("nan"),
        valid_latency_p99_ms=float(np.percentile(valid, 99) * 1e3) if len(valid) else float("nan"),
        health_probes=len(health),
        health_max_ms=float(max(health) * 1e3) if health else float("nan"),
        health_p99_ms=float(np.percentile(health, 99) * 1e3) if health else float("nan"),
        problems=[r["problem"] for r in results if r["problem"]][:10],
    )
    return rows, overall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--model", default="fmoe-tiny-mixtral", help="a shipped model or checkpoint directory"
    )
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients")
    parser.add_argument("--seconds", type=float, default=120.0, help="how long the clients send requests")
    parser.add_argument("--max-batch", type=int, default=4, help="fmoe-serve --max-batch")
    parser.add_argument("--budget", type=float, default=0.25, help="fraction of experts the cache holds")
    parser.add_argument("--seed", type=int, default=0, help="seeds the clients' random draws")
    parser.add_argument("--note", default="", help="recorded with the results (e.g. 'machine shared')")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and PNG results")
    args = parser.parse_args()

    import fmoe_jax as fj

    with fj.load_model(args.model) as resident:
        cfg = resident.config
    slots = max(1, round(args.budget * cfg.num_moe_layers * cfg.num_experts))
    name = Path(args.model).name
    options = ["--policy", "fmoe", "--cache-experts", str(slots), "--prefetch-distance", "1"]
    options += ["--max-batch", str(args.max_batch), "--max-queue", str(4 * args.clients), "--api-key", KEY]
    server = ServerProcess(args.model, options)
    try:
        client = Client(server.url, timeout=300)
        reference = served_alone(client, name)
        counted_before, values = server_counts(client)
        compiled_before, memory_before = values["fmoe_compilations"], memory_mb(server.proc.pid)
        started = time.perf_counter()
        outcome = soak(server.url, name, reference, args.clients, args.seconds, args.seed)
        wall = time.perf_counter() - started
        counted = settle(client, len(outcome["results"]), counted_before)
        _, values = server_counts(client)
        memory_after = memory_mb(server.proc.pid)
    finally:
        code = server.stop()
    rows, overall = summary(outcome["results"], outcome["health"])
    overall.update(
        wall_s=wall,
        server_counted=counted,
        unaccounted=len(outcome["results"]) - counted,
        compilations=values["fmoe_compilations"] - compiled_before,
        rss_before_mb=memory_before["VmRSS"],
        rss_after_mb=memory_after["VmRSS"],
        rss_peak_mb=memory_after["VmHWM"],
        exit_code=code,
    )
    print(
        f"\n{NAME}: {name}, fmoe with {slots} expert slots, --max-batch {args.max_batch}, {args.clients} "
        f"clients for {args.seconds:.0f} s, {MAX_TOKENS} tokens per valid request"
        + (f" ({args.note})" if args.note else "")
    )
    print_table(rows)
    shown = {k: v for k, v in overall.items() if k != "problems"}
    print_table([shown], list(shown))
    for problem in overall["problems"]:
        print("  problem:", problem)
    payload = dict(
        model=name,
        slots=slots,
        max_batch=args.max_batch,
        clients=args.clients,
        seconds=args.seconds,
        max_tokens=MAX_TOKENS,
        seed=args.seed,
        note=args.note,
        kinds=KINDS,
        rows=rows,
        overall=overall,
        valid_latencies_ms=sorted(
            r["latency_s"] * 1e3 for r in outcome["results"] if r["kind"] == "valid" and r["ok"]
        ),
    )
    save(NAME, payload, args.out)
    plot(saved(NAME, args.out), args.out / f"{NAME}.png")
    bad = overall["failed"] or overall["unaccounted"] or overall["server_errors"] or code != 0
    if bad:
        sys.exit("the soak found failures, 5xx answers, lost requests or an unclean exit (see above)")


def plot(payload: dict, path: Path) -> None:
    """Requests by kind and outcome, and the distribution of the valid requests' latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, overall = payload["rows"], payload["overall"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    kinds = [r["kind"] for r in rows]
    axes[0].bar(kinds, [r["sent"] - r["failed"] for r in rows], color="#2ca02c", label="as expected")
    axes[0].bar(
        kinds,
        [r["failed"] for r in rows],
        bottom=[r["sent"] - r["failed"] for r in rows],
        color="#d62728",
        label="failed",
    )
    axes[0].set_ylabel("requests")
    axes[0].tick_params(axis="x", rotation=30)
    axes[0].legend(fontsize=8)
    latencies = payload["valid_latencies_ms"]
    if latencies:
        axes[1].plot(latencies, np.arange(1, len(latencies) + 1) / len(latencies), color="#1f77b4")
        axes[1].axvline(overall["valid_latency_p99_ms"], color="#7f7f7f", ls="--", label="p99")
        axes[1].legend(fontsize=8)
    axes[1].set_xlabel("valid request latency (ms)")
    axes[1].set_ylabel("fraction of valid requests")
    backend = payload["machine"]["backend"]
    fig.suptitle(
        f"live ({backend}): fmoe-serve soak, {payload['clients']} clients for {payload['seconds']:.0f} s on "
        f"{payload['model']}; RSS {overall['rss_before_mb']:.0f} -> {overall['rss_after_mb']:.0f} MB"
    )
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
