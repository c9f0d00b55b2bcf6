"""fmoe-serve over HTTP with the official `openai` client: OpenAI's routes, streaming, batching, errors, a
full queue, cancellation, metrics, and SIGTERM on the real CLI in a subprocess.

One server (fmoe-tiny-mixtral with fMoE offloading and continuous batching over `max_batch=4` slots, warmed
up) is shared by the module; a second one without batching (`max_batch=1`) serves exactly what `generate`
does. Every request asks for `MAX_TOKENS` tokens from a prompt of at most 16 tokens. Tests that need
requests to wait hold the model (`Model.serving`) so that the scheduler blocks: the queue then fills
deterministically, without timing.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import fmoe_jax as fj  # noqa: E402
from fmoe_jax.serve import cli  # noqa: E402
from fmoe_jax.serve.app import StopCut, create_app  # noqa: E402
from fmoe_jax.serve.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

MODEL = "fmoe-tiny-mixtral"
MAX_TOKENS = 8
MAX_QUEUE = 16
OFFLOAD = dict(policy="fmoe", cache_experts=16, prefetch_distance=1)
PROMPTS = [  # 2 to 16 tokens each
    "Once upon a time",
    "KING HENRY:\nWhat say you, lords, to",
    "def fibonacci(n):\n    ",
    "The best way to keep your garden healthy is",
    "Die Stadt liegt am Ufer des",
    "It was late in the evening when",
    "In this paper we propose",
    "The",
    "ROMEO:\nBut soft",
    "import numpy as np\n",
    "The history of the city",
    "She opened the door and",
    "Customers who bought this",
    "First Citizen:\nBefore we proceed",
    "Der Fluss",
    "class Stack:\n    def",
]
CHAT = [{"role": "user", "content": "Hi"}]  # 16 tokens through the chat template


class Server:
    """fmoe-serve's app under uvicorn on a free localhost port, in a thread of this process."""

    def __init__(self, model: fj.Model, **options):
        self.model = model
        self.app = create_app(model, model_name=MODEL, **options)
        self.scheduler = self.app.state.scheduler
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 60, "the server to start")
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def client(self, timeout: float = 120) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.01)


def settled(server: Server) -> None:
    """Waits until the scheduler is idle: its last batch's statistics are in the metrics (a client may have
    its answer a moment before)."""
    wait_until(lambda: server.scheduler.idle, 60, "the scheduler to idle")


def metrics(url: str) -> dict[tuple, float]:
    """Every sample of GET /metrics by (name, sorted labels)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def requests_counted(url: str, route: str, status: int | str) -> float:
    return metrics(url).get(("fmoe_requests_total", (("route", route), ("status", str(status)))), 0.0)


def post(url: str, path: str, body: bytes) -> tuple[int, dict, dict]:
    """A raw POST (bodies the openai client would not send): status, headers, JSON body."""
    request = urllib.request.Request(url + path, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


@pytest.fixture(scope="module")
def server():
    model = fj.load_model(MODEL, offload=fj.OffloadConfig(**OFFLOAD))
    served = Server(model, max_batch=4, max_queue=MAX_QUEUE, context=64)
    assert served.scheduler.warmup() > 0
    served.compiled = sum(model.engine.programs.compilations.values())
    yield served
    served.stop()
    model.close()


@pytest.fixture(scope="module")
def alone_server():
    model = fj.load_model(MODEL, offload=fj.OffloadConfig(**OFFLOAD))
    served = Server(model, max_queue=MAX_QUEUE)
    yield served
    served.stop()
    model.close()


def complete(client: openai.OpenAI, prompt: str, **kw):
    """A greedy completion of MAX_TOKENS tokens (other arguments: `kw`)."""
    return client.completions.create(
        **{"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}
    )


def test_health_models_and_unknown_routes(server):
    assert json.loads(urllib.request.urlopen(f"{server.url}/health", timeout=30).read()) == {"status": "ok"}
    assert [m.id for m in server.client().models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as err:
        server.client().models.retrieve("gpt-4")
    assert err.value.body["code"] == "model_not_found"


def test_completion_and_chat_match_generate(alone_server):
    server = alone_server
    client = server.client()
    out = complete(client, PROMPTS[0], logprobs=2)
    ref = fj.generate(
        server.model, PROMPTS[0], max_new_tokens=MAX_TOKENS, return_logprobs=True, top_logprobs=2
    )
    choice = out.choices[0]
    assert choice.text == ref.texts[0] and choice.text
    assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[ref.finish_reasons[0]]
    assert out.usage.completion_tokens == len(ref.tokens[0])
    assert out.usage.prompt_tokens == len(server.model.tokenizer(PROMPTS[0])["input_ids"])
    assert len(choice.logprobs.tokens) == len(ref.tokens[0])
    # float64 log-softmax of the same float32 logits, through JSON
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs[0], rel=1e-9, abs=1e-12)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    ref = fj.generate(server.model, [CHAT], max_new_tokens=MAX_TOKENS)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == ref.texts[0] and ref.texts[0]
    assert chat.usage.completion_tokens == len(ref.tokens[0])


def test_streaming_equals_non_streamed_text(server):
    client = server.client()
    for prompt in PROMPTS[:3]:
        whole = complete(client, prompt).choices[0]
        chunks = list(complete(client, prompt, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == whole.text
        assert chunks[-1].choices[0].finish_reason == whole.finish_reason
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    chat = dict(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    whole = client.chat.completions.create(**chat).choices[0].message.content
    streamed = list(
        client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True})
    )
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole
    assert streamed[-1].usage.completion_tokens > 0
    # The wire format ends with OpenAI's sentinel.
    request = urllib.request.Request(
        f"{server.url}/v1/completions",
        json.dumps(
            dict(model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True)
        ).encode(),
        {"Content-Type": "application/json"},
    )
    events = urllib.request.urlopen(request, timeout=60).read().decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


def test_stop_strings_end_the_text_before_them(server):
    client = server.client()
    text = complete(client, PROMPTS[0]).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    expected = text[: text.index(stop)]
    cut = complete(client, PROMPTS[0], stop=[stop]).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop")
    assert (
        "".join(c.choices[0].text for c in complete(client, PROMPTS[0], stop=stop, stream=True)) == expected
    )


def test_stop_cut_streams_what_it_returns_whole():
    pieces = ["Hel", "lo W", "orl"]  # generate ends the row on the piece that completes the stop string
    cut = StopCut(["o Wo", "xyz"])
    streamed = [cut.add(piece, "stop" if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]
    assert streamed == ["", "Hell", ""]  # "o W" held back: it could start a stop string, and it does
    assert StopCut(["o Wo"]).add("".join(pieces), "stop") == "Hell"
    assert StopCut(["o Wo"]).add("Hello", "length") == "Hello"  # held back only until the end
    assert StopCut(None).add("abc", None) == "abc"


def held_queue(server: Server, client: openai.OpenAI, pool, prompts: list[str]):
    """Holds the model, sends a blocker request (which the scheduler takes and waits on) and then `prompts`;
    returns their futures once all are queued. The caller releases the model (`model.serving()` exits)."""
    blocker = pool.submit(complete, client, PROMPTS[0])
    wait_until(lambda: server.scheduler.running == 1, 60, "the blocker to run")
    futures = [pool.submit(complete, client, p) for p in prompts]
    wait_until(lambda: server.scheduler.depth == len(prompts), 60, "the requests to queue")
    return blocker, futures


def test_concurrent_requests_batched_as_served_alone(server):
    client = server.client()
    alone = [complete(client, p).choices[0].text for p in PROMPTS]  # one at a time
    settled(server)  # the last one's statistics are counted a moment after its client has the answer
    full = ("fmoe_decode_steps_total", (("rows", "4"),))
    steps = metrics(server.url).get(full, 0.0)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        with server.model.serving():
            blocker, futures = held_queue(server, client, pool, PROMPTS)
        together = [f.result(timeout=120).choices[0].text for f in futures]
        blocker.result(timeout=120)
    assert together == alone and all(together)
    settled(server)
    after = metrics(server.url)
    assert after[full] - steps >= len(PROMPTS) // 4  # four rows decoded together: batching did happen
    # Nothing compiled since the warm-up, alone or together.
    assert after[("fmoe_compilations", ())] == server.compiled


def test_a_sampled_request_is_served_alone_as_generate_serves_it(server):
    """Continuous batching decodes greedily: a sampled request runs alone, and its seed gives generate's
    tokens."""
    out = complete(server.client(), PROMPTS[0], temperature=0.8, seed=5)
    ref = fj.generate(server.model, PROMPTS[0], max_new_tokens=MAX_TOKENS, temperature=0.8, seed=5)
    assert out.choices[0].text == ref.texts[0]


def test_full_queue_answers_503_with_retry_after(server):
    client = server.client()
    with concurrent.futures.ThreadPoolExecutor(MAX_QUEUE + 1) as pool:
        with server.model.serving():
            blocker, futures = held_queue(server, client, pool, PROMPTS[:MAX_QUEUE])
            with pytest.raises(openai.APIStatusError) as err:
                complete(client, PROMPTS[1])
        assert all(f.result(timeout=120).choices[0].text for f in [blocker, *futures])
    assert err.value.status_code == 503
    assert int(err.value.response.headers["Retry-After"]) >= 1
    assert err.value.body["code"] == "queue_full"


def test_bad_requests_are_400_and_unknown_model_404(server):
    status, _, body = post(server.url, "/v1/completions", b'{"model": "fmoe-tiny-mixtral", "prompt": ')
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    status, _, body = post(server.url, "/v1/completions", json.dumps({"model": MODEL}).encode())
    assert (status, body["error"]["param"]) == (400, "prompt")
    client = server.client()
    cases = {  # OpenAI's fields out of range, generate's own ValueError passed through, unsupported fields
        "temperature": dict(temperature=3.0),
        "greedy decoding": dict(top_p=0.5),  # with temperature=0
        "not supported": dict(n=2),
    }
    for message, kw in cases.items():
        with pytest.raises(openai.BadRequestError, match=message):
            complete(client, PROMPTS[0], **kw)
    too_long = [5] * (server.model.config.max_position_embeddings - 2)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=MAX_TOKENS)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="Hi")
    assert err.value.body["code"] == "model_not_found"
    assert requests_counted(server.url, "/v1/completions", 400) >= 6


def test_a_cancelled_request_frees_its_slot(server):
    """The client goes away while its request waits for the model: the scheduler drops it after its first
    step (a finished request would add a batch) and serves the next one."""
    client = server.client()
    route = "/v1/completions"
    for stream in (True, False):
        settled(server)
        cancelled = requests_counted(server.url, route, "cancelled")
        with server.model.serving():
            if stream:
                complete(client, PROMPTS[0], stream=True).close()  # the response has started: then gone
            else:
                with pytest.raises(openai.APITimeoutError):
                    complete(server.client(timeout=0.5), PROMPTS[0])
            wait_until(
                lambda: requests_counted(server.url, route, "cancelled") == cancelled + 1,  # noqa: B023
                30,
                "the server to see the client go",
            )
            batches = metrics(server.url)[("fmoe_batches_total", ())]
        assert complete(client, PROMPTS[1]).choices[0].text  # served after the cancelled one
        settled(server)
        assert metrics(server.url)[("fmoe_batches_total", ())] == batches + 1


def test_metrics_count_requests_and_experts(server):
    settled(server)
    before = metrics(server.url)
    complete(server.client(), PROMPTS[2])
    settled(server)
    after = metrics(server.url)
    ok = ("fmoe_requests_total", (("route", "/v1/completions"), ("status", "200")))
    assert after[ok] == before.get(ok, 0.0) + 1
    for histogram in ("fmoe_time_to_first_token_seconds_count", "fmoe_time_per_output_token_seconds_count"):
        assert after[(histogram, ())] == before[(histogram, ())] + 1
    assert after[("fmoe_queue_depth", ())] == 0
    assert after[("fmoe_expert_hits_total", ())] + after[("fmoe_expert_misses_total", ())] > 0
    assert 0 < after[("fmoe_expert_hit_rate", ())] <= 1
    assert after[("fmoe_bytes_to_device_total", ())] > 0  # 16 of 64 experts fit: copies happen


def test_openai_sampling_fields_map_to_generate():
    from fmoe_jax.sampling import Greedy, Sample, from_hf_arguments

    def sampling(request):
        options = request.generate_options(4)
        return from_hf_arguments(None, **{k: options[k] for k in ("temperature", "top_p", "top_k")})

    base = dict(model=MODEL, prompt="x")
    assert isinstance(sampling(CompletionRequest(**base)), Sample)  # OpenAI's default temperature is 1
    assert sampling(CompletionRequest(**base, temperature=0, top_p=1)) == Greedy()
    assert sampling(CompletionRequest(**base, temperature=0.5, top_p=0.9, top_k=-1)) == Sample(0.5, 0, 0.9)
    chat = ChatCompletionRequest(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=3, seed=7)
    options = chat.generate_options(4)
    assert (options["return_logprobs"], options["top_logprobs"], options["seed"]) == (True, 3, 7)
    assert CompletionRequest(**base, ignore_eos=True).generate_options(4)["stop_at_eos"] is False


def test_missing_serve_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(SystemExit, match=re.escape('pip install "fmoe-jax[serve]"')):
        cli.require_serve_dependencies()


def test_sigterm_finishes_in_flight_requests_and_saves_the_store(tmp_path):
    """The CLI in a subprocess (fMoE with --store-path, continuous batching, --warmup): SIGTERM while
    requests run and wait; each gets its answer, the process exits 0 and the store is saved."""
    import jax

    store = tmp_path / "store.npz"
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir or ""}
    command = [sys.executable, "-m", "fmoe_jax.serve", MODEL, "--port", "0", "--warmup", "--max-batch", "2"]
    command += [
        "--policy",
        "fmoe",
        "--cache-experts",
        "16",
        "--prefetch-distance",
        "1",
        "--store-path",
        str(store),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any(" on http://" in line for line in lines) or proc.poll() is not None, 120, "up")
        url = re.search(r"http://127\.0\.0\.1:\d+", next(x for x in lines if " on http://" in x))[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        n = 6
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [
                pool.submit(client.completions.create, model=MODEL, prompt=p, max_tokens=16, temperature=0)
                for p in PROMPTS[:n]
            ]
            wait_until(
                lambda: (
                    sum(metrics(url)[(k, ())] for k in ("fmoe_queue_depth", "fmoe_running_requests")) == n
                ),
                60,
                "every request to be in flight",
            )
            proc.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=120) for f in futures]
        assert proc.wait(timeout=60) == 0, "".join(lines)
    finally:
        proc.kill()
        reader.join(10)
    assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
    assert store.exists(), "".join(lines)
    assert any("warm-up compiled" in line for line in lines)
