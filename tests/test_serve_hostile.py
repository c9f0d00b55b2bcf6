"""fmoe-serve under hostile and careless clients, over HTTP on localhost (the official `openai` client, or raw
HTTP for what it would not send): bodies over the size limit (413), the API key (401), client mistakes (400
naming the parameter, never a 500), `/health` answering while a large body is refused or tokenized, requests
cut off at shutdown (well-formed answers, one log line), and the CLI's one-line start-up errors.

One server (fmoe-tiny-mixtral, resident, requests served alone, an API key) serves the module.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from test_serve import MODEL, PROMPTS, Server, wait_until  # noqa: E402

import fmoe_jax as fj  # noqa: E402
from fmoe_jax.serve import cli  # noqa: E402
from fmoe_jax.serve.app import DEFAULT_MAX_REQUEST_BYTES, create_app  # noqa: E402

KEY = "sk-test-key"
HEALTH_S = 0.5  # the longest /health may take while the server refuses or tokenizes a large body
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def model():
    model = fj.load_model(MODEL)
    yield model
    model.close()


@pytest.fixture(scope="module")
def server(model):
    served = Server(model, api_key=KEY)
    yield served
    served.stop()


def request(
    url: str, path: str, body: bytes | None = None, headers: dict | None = None, method: str = "POST"
):
    """A raw request: (status, headers, parsed JSON body or the raw bytes)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        connection.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    try:
        return response.status, response.headers, json.loads(data)
    except ValueError:
        return response.status, response.headers, data


def authorized(**headers) -> dict:
    return {"Authorization": f"Bearer {KEY}", **headers}


def completion(**fields) -> bytes:
    return json.dumps(
        {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, **fields}
    ).encode()


def health_probes(url: str, busy: concurrent.futures.Future) -> list[float]:
    """Seconds each GET /health took, probing until `busy` is done (at least 3 probes)."""
    times: list[float] = []
    while not busy.done() or len(times) < 3:
        start = time.perf_counter()
        status, _, body = request(url, "/health", method="GET")
        times.append(time.perf_counter() - start)
        assert (status, body) == (200, {"status": "ok"})
        time.sleep(0.02)
    return times


def test_the_api_key_is_required_except_for_health(server):
    status, headers, body = request(server.url, "/v1/completions", completion())
    assert status == 401 and set(body["error"]) == ERROR_KEYS
    assert body["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in body["error"]["message"]
    assert headers["WWW-Authenticate"] == "Bearer"
    assert request(server.url, "/v1/models", method="GET", headers={"Authorization": "Bearer nope"})[0] == 401
    assert request(server.url, "/metrics", method="GET")[0] == 401
    assert request(server.url, "/health", method="GET")[:3:2] == (200, {"status": "ok"})
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert out.choices[0].text == fj.generate(server.model, PROMPTS[0], max_new_tokens=4).texts[0]


def test_a_body_over_the_limit_is_413_while_health_answers(server):
    big = completion(prompt="x" * (10 << 20))  # 10 MB
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(request, server.url, "/v1/completions", big, authorized())
        probes = health_probes(server.url, refused)
        status, _, body = refused.result()
    assert status == 413 and set(body["error"]) == ERROR_KEYS
    assert body["error"]["code"] == "request_too_large"
    assert f"over {DEFAULT_MAX_REQUEST_BYTES} bytes" in body["error"]["message"]
    assert max(probes) < HEALTH_S, probes
    # A body sent in chunks, with no Content-Length to refuse it by, is cut at the limit too.
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    chunks = (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20))
    connection.request("POST", "/v1/completions", chunks, authorized(**{"Content-Type": "application/json"}))
    response = connection.getresponse()
    assert (response.status, json.loads(response.read())["error"]["code"]) == (413, "request_too_large")
    connection.close()


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """A prompt just under the body limit takes seconds to tokenize: /health and another client's request
    are answered meanwhile, and the long one gets its 400 (too long for the context)."""
    long = completion(prompt="Once upon a time there was a king. " * 30_000)  # ~1 MB
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        refused = pool.submit(request, server.url, "/v1/completions", long, authorized())
        wait_until(lambda: server.server.server_state.total_requests >= 1, 10, "the long request")
        short = pool.submit(request, server.url, "/v1/completions", completion(), authorized())
        probes = health_probes(server.url, refused)
        assert short.done() and short.result()[0] == 200  # answered before the long one's 400
        status, _, body = refused.result()
    assert (status, body["error"]["code"], body["error"]["param"]) == (
        400,
        "context_length_exceeded",
        "prompt",
    )
    assert max(probes) < HEALTH_S, probes


SURROGATE_PROMPT = b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 4}' % MODEL.encode()
SURROGATE_CHAT = b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % MODEL.encode()
NAN_TEMPERATURE = b'{"model": "%s", "prompt": "Hi", "temperature": NaN}' % MODEL.encode()
CASES = [  # (path, body, status, param, part of the message)
    ("/v1/completions", completion(seed=2**70), 400, "seed", "less than 9223372036854775808"),
    ("/v1/completions", SURROGATE_PROMPT, 400, "prompt", r"holds '\ud800' at character 1, a lone surrogate"),
    ("/v1/chat/completions", SURROGATE_CHAT, 400, "messages", "lone surrogate"),
    ("/v1/completions", NAN_TEMPERATURE, 400, "temperature", "temperature: Input should be a finite number"),
    ("/v1/completions", completion(stop=""), 400, "stop", "stop must be a non-empty string"),
    ("/v1/completions", completion(stop=["x", ""], stream=True), 400, "stop", "stop must be a non-empty"),
    ("/v1/completions", completion(top_k=-5, temperature=0.5), 400, "top_k", "top_k must be an int >= 0"),
    ("/v1/completions", completion(top_p=0.5), 400, "top_p", "temperature=0 means greedy decoding"),
    ("/v1/completions", completion(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", completion(logprobs=9), 400, "logprobs", "less than or equal to 5"),
    ("/v1/completions", completion(prompt=[1.5, 2]), 400, "prompt", "prompt"),
    ("/v1/completions", completion(prompt=[5, 10**6]), 400, "prompt", "outside [0, "),
    ("/v1/completions", completion(model="gpt\ud800"), 404, "model", r"'gpt\ud800' does not exist"),
    ("/v1/completions", b'{"model": "%s", "prompt": ' % MODEL.encode(), 400, None, "not valid JSON"),
    ("/v1/completions", b"[" * 100_000, 400, None, "not valid JSON"),
    ("/v1/completions", b"\xff\xfe{}", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "Input should be a valid dictionary"),
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": []}).encode(),
        400,
        "messages",
        "at least 1",
    ),
]


@pytest.mark.parametrize("path, body, status, param, message", CASES)
def test_client_mistakes_are_openai_errors_naming_the_parameter(server, path, body, status, param, message):
    got, headers, answer = request(server.url, path, body, authorized())
    assert got == status, answer
    assert headers["Content-Type"] == "application/json" and set(answer["error"]) == ERROR_KEYS
    assert answer["error"]["param"] == param
    assert message in answer["error"]["message"], answer["error"]["message"]


def test_values_that_restrict_nothing_are_accepted(server):
    status, _, body = request(server.url, "/v1/completions", completion(top_k=0), authorized())
    alone = fj.generate(server.model, PROMPTS[0], max_new_tokens=4).texts[0]
    assert (status, body["choices"][0]["text"]) == (200, alone)
    status, _, body = request(server.url, "/v1/completions", completion(stop=[]), authorized())
    assert (status, body["choices"][0]["text"]) == (200, alone)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_requests_cut_off_at_shutdown_get_well_formed_answers(model):
    """Shutdown with the model held: the running request and the queued ones (whole and streamed) cannot
    finish within the grace period: each gets a 503, or an error event then [DONE]; one log line, no
    traceback, and no task left for uvicorn to cancel."""
    app = create_app(model, model_name=MODEL, max_queue=8)
    config = uvicorn.Config(app, log_level="info", log_config=None, timeout_graceful_shutdown=0.5 + 10)
    sock = cli.bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    served = cli.uvicorn_server(config, app.state.server, 0.5, "up")
    records = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "fmoe_jax", "asyncio")]
    for logger in loggers:
        logger.addHandler(records)
    thread = threading.Thread(target=served.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    scheduler = app.state.scheduler
    try:
        wait_until(lambda: served.started, 60, "the server to start")
        chat = json.dumps(
            dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True)
        ).encode()
        with concurrent.futures.ThreadPoolExecutor(4) as pool, model.serving():
            running = pool.submit(request, url, "/v1/completions", completion())
            wait_until(lambda: scheduler.running == 1, 30, "the first request to run")
            waiting = [
                pool.submit(request, url, "/v1/completions", completion()),
                pool.submit(request, url, "/v1/completions", completion(stream=True)),
                pool.submit(request, url, "/v1/chat/completions", chat),
            ]
            wait_until(lambda: scheduler.depth == 3, 30, "three requests to queue")
            served.should_exit = True
            wait_until(lambda: all(f.done() for f in waiting), 30, "the queued requests' answers")
        answers = [f.result() for f in [running, *waiting]]
        thread.join(30)
    finally:
        served.should_exit = True
        thread.join(30)
        for logger in loggers:
            logger.removeHandler(records)
    for status, _, body in answers[:2]:
        assert (status, body["error"]["code"], body["error"]["type"]) == (
            503,
            "shutting_down",
            "server_error",
        )
    for status, _, body in answers[2:]:
        events = body.decode().strip().split("\n\n")
        assert status == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert not thread.is_alive()
    cut = [r for r in records.records if "not finished after --shutdown-timeout" in r.getMessage()]
    assert len(cut) == 1 and "4 request(s)" in cut[0].getMessage()
    assert not [r for r in records.records if r.levelno >= logging.ERROR or r.exc_info], [
        r.getMessage() for r in records.records
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no-such-model"], "fmoe-serve: no-such-model is neither an existing path nor a shipped model name"),
        ([MODEL, "--max-batch", "0"], "fmoe-serve: error: argument --max-batch: must be >= 1, got 0"),
        ([MODEL, "--port", "70000"], "fmoe-serve: error: argument --port: must be a port in [0, 65535]"),
        ([MODEL, "--api-key", " "], "fmoe-serve: the API key (--api-key or $FMOE_SERVE_API_KEY) is empty"),
    ],
)
def test_cli_start_up_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    said = str(exit_.value.code) if isinstance(exit_.value.code, str) else capsys.readouterr().err
    assert said.strip().startswith(message) and "\n" not in said.strip(), said


def test_cli_refuses_a_port_in_use_before_loading():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(
            SystemExit, match=rf"^fmoe-serve: cannot listen on 127.0.0.1:{port}: Address already"
        ):
            cli.main([MODEL, "--port", str(port)])
