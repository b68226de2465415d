"""`specdec serve`: the app runs in-process (uvicorn in a thread, a random port) over a tiny random model
and is driven by the official `openai` client (what users call it with) and, where a test needs the raw
responses (status codes, SSE framing, disconnects), the stdlib's http.client."""

import http.client
import json
import socket
import threading
import time

import pytest
import uvicorn

from specdec.api import Chunk, from_models
from specdec.serve.app import Pieces, build_app
from tests.helpers import tiny_model, word_tokenizer

WORDS = [f"w{i}" for i in range(95)]
MODEL = "tiny"


@pytest.fixture(scope="module")
def dec():
    tok = word_tokenizer(WORDS)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    return from_models(tiny_model("llama"), tok, "pld")


class Slow:
    """The decoder, each chunk late (so a request is still running when the test acts), and failing on a
    prompt that contains "boom"."""

    def __init__(self, dec, delay=0.05):
        self.dec, self.delay = dec, delay

    def __getattr__(self, name):
        return getattr(self.dec, name)

    def stream(self, prompt, **kw):
        for i, chunk in enumerate(self.dec.stream(prompt, **kw)):
            if "boom" in str(prompt) and i == 1:
                raise RuntimeError("boom")
            time.sleep(self.delay)
            yield chunk


class Server:
    def __init__(self, dec, max_queue=64, max_batch=1):
        self.app = build_app(dec, MODEL, max_queue=max_queue, max_batch=max_batch)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=10))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def conn(self):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def post(self, path, body):
        c = self.conn()
        c.request("POST", path, body if isinstance(body, str) else json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read()), r

    def get(self, path):
        c = self.conn()
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()

    def metric(self, name):
        _, text = self.get("/metrics")
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"specdec:{name}"))

    def stop(self):
        self.server.should_exit = True  # what uvicorn's SIGTERM handler does
        self.thread.join(timeout=20)


@pytest.fixture(scope="module")
def server(dec):
    s = Server(dec)
    yield s
    s.stop()


def sse(resp):
    events = []
    for line in resp:
        line = line.decode().strip()
        if line.startswith("data: "):
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[6:]))
    return events


def stream_request(server, path, body):
    c = server.conn()
    c.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    return c, r


PROMPT = "w3 w7 w1 w9 w3 w7 w2"
MSGS = [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": PROMPT}]


def test_outputs_equal_the_decoders_greedy_text_streamed_or_not(server, dec):
    want = dec.generate(PROMPT, max_new_tokens=24)
    status, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                      "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == want.text
    assert body["choices"][0]["finish_reason"] == want.finish_reason
    assert body["usage"] == {"prompt_tokens": len(want.prompt_ids), "completion_tokens": len(want.token_ids),
                             "total_tokens": len(want.prompt_ids) + len(want.token_ids)}
    extra = body["specdec"]
    assert extra["method"] == "pld" and extra["tau"] == pytest.approx(want.stats.tau, abs=1e-3)
    assert extra["accepted_tokens_per_position"] == want.stats.depth_accepts

    _, r = stream_request(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                      "temperature": 0, "stream_options": {"include_usage": True}})
    events = sse(r)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want.text
    assert events[-1]["choices"] == [] and events[-1]["usage"] == body["usage"]

    chat = dec.generate(MSGS, max_new_tokens=20)
    status, body, _ = server.post("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 20,
                                                           "temperature": 0})
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": chat.text}
    _, r = stream_request(server, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 20,
                                                           "temperature": 0})
    events = sse(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == chat.text
    assert events[-1]["choices"][0]["finish_reason"] == chat.finish_reason and "specdec" in events[-1]


def test_stream_chunks_carry_each_tokens_text_and_depth(server, dec):
    msgs = [{"role": "user", "content": PROMPT * 2}]
    want = dec.generate(msgs, max_new_tokens=40)
    _, r = stream_request(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 40,
                                                           "temperature": 0})
    pieces, depths = [], []
    for e in sse(r)[1:]:
        content = e["choices"][0]["delta"].get("content", "")
        extra = e.get("specdec", {})
        assert "".join(extra.get("tokens", [])) == content
        pieces += extra.get("tokens", [])
        depths += extra.get("depths", [])
    # the word tokenizer: one piece per token, each the token's word
    assert [p.strip() for p in pieces] == [dec.tokenizer.decode([t]) for t in want.token_ids]
    assert 0 in depths and max(depths) >= 1
    # one target token per forward, and the prefill's (the last forward's may be cut by max_tokens)
    assert want.stats.target_forwards <= sum(d == 0 for d in depths) <= want.stats.target_forwards + 1
    final = e["specdec"]
    assert final["tau"] == pytest.approx(want.stats.tau, abs=1e-3) and final["tokens_per_second"] > 0
    assert json.loads(server.get("/v1/models")[1])["data"][0]["specdec"] == {"method": "pld"}


def test_pieces_follow_tokens_across_held_back_text_and_split_characters():
    # bytes as tokens: a character's first byte has no text of its own, its text comes with the last byte
    pieces = Pieces(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    a, b, e1, e2, c = b"ab\xc3\xa9c"
    # text held back (a stop string could begin at "b"): "b" arrives with the next chunk, without tokens
    assert pieces.split(Chunk("a", [a, b], depths=[0, 1])) == {"tokens": ["a"], "depths": [0]}
    assert pieces.split(Chunk("b\u00e9", [e1, e2], depths=[2, 0])) == {"tokens": ["b", "\u00e9"], "depths": [1, 0]}
    assert pieces.split(Chunk("", [], depths=[])) == {}
    assert pieces.split(Chunk("c", [c], depths=[1])) == {"tokens": ["c"], "depths": [1]}
    # an engine that gives no depths: no pieces from there on, the text is unchanged
    assert pieces.split(Chunk("c", [c])) == {} and pieces.split(Chunk("c", [c], depths=[0])) == {}


def test_the_official_openai_client_gets_the_decoders_text(server, dec):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    want = dec.generate(MSGS, max_new_tokens=20)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids) and r.usage.prompt_tokens == len(want.prompt_ids)
    parts, usage = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        parts += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(parts) == want.text and usage.completion_tokens == len(want.token_ids)
    done = dec.generate(PROMPT, max_new_tokens=12)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text \
        == done.text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="n"):
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, n=2)


def test_stop_and_seed_are_the_decoders(server, dec):
    full = dec.generate(PROMPT, max_new_tokens=24).text
    stop = full.split()[3]
    want = dec.generate(PROMPT, max_new_tokens=24, stop=[stop])
    _, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                                 "temperature": 0, "stop": stop})
    assert body["choices"][0]["text"] == want.text and body["choices"][0]["finish_reason"] == "stop"
    sampled = dec.generate(PROMPT, max_new_tokens=16, temperature=0.9, top_p=0.9, top_k=20, seed=3)
    _, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 16,
                                                 "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 3})
    assert body["choices"][0]["text"] == sampled.text


def test_models_health_and_metrics_move(server):
    assert server.get("/health")[0] == 200
    status, text = server.get("/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == MODEL
    before = {n: server.metric(n) for n in ("requests_total", "generation_tokens_total", "prompt_tokens_total",
                                           "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                                           "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                                           "time_to_first_token_seconds_sum")}
    _, body, _ = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT * 3, "max_tokens": 40,
                                                 "temperature": 0})
    assert server.metric("requests_total") == before["requests_total"] + 1
    assert server.metric("generation_tokens_total") == before["generation_tokens_total"] + \
        body["usage"]["completion_tokens"]
    assert server.metric("prompt_tokens_total") == before["prompt_tokens_total"] + body["usage"]["prompt_tokens"]
    assert server.metric("spec_decode_num_drafts_total") > before["spec_decode_num_drafts_total"]
    assert server.metric("spec_decode_num_draft_tokens_total") > before["spec_decode_num_draft_tokens_total"]
    accepted = server.metric("spec_decode_num_accepted_tokens_total")
    assert accepted == server.metric("spec_decode_num_accepted_tokens_per_pos_total") > 0
    assert 'spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in server.get("/metrics")[1]
    # latency histograms: one first-token time per request, a gap per later piece of its answer
    assert server.metric("time_to_first_token_seconds_count") == before["time_to_first_token_seconds_count"] + 1
    assert server.metric("time_to_first_token_seconds_sum") > before["time_to_first_token_seconds_sum"]
    gaps = server.metric("inter_token_latency_seconds_count") - before["inter_token_latency_seconds_count"]
    assert 1 <= gaps < body["usage"]["completion_tokens"]  # drafts accepted: fewer pieces than tokens
    text = server.get("/metrics")[1]
    assert "# TYPE specdec:inter_token_latency_seconds histogram" in text
    inf = 'specdec:time_to_first_token_seconds_bucket{le="+Inf"}'
    assert [float(x.split()[-1]) for x in text.splitlines() if x.startswith(inf)] == \
        [server.metric("time_to_first_token_seconds_count")]


@pytest.mark.parametrize("body,param", [
    ('{"model": "tiny", "prompt": ', None),  # malformed JSON
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "best_of": 2}, "best_of"),
    ({"model": MODEL, "prompt": PROMPT, "n": 2}, "n"),
    ({"model": MODEL, "prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 510}, "max_tokens"),  # 7 + 510 over a context of 512
])
def test_bad_requests_are_400_with_an_openai_error_body(server, body, param):
    status, out, _ = server.post("/v1/completions", body)
    assert status == 400 and set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param
    if param == "max_tokens" and body["max_tokens"] == 510:
        assert "512" in out["error"]["message"] and "510" in out["error"]["message"]


def test_unknown_model_is_404(server):
    status, out, _ = server.post("/v1/chat/completions", {"model": "gpt-4", "messages": MSGS})
    assert status == 404 and out["error"]["code"] == "model_not_found"


def test_full_queue_429_disconnect_cancels_failure_is_contained_and_shutdown_drains(dec):
    s = Server(Slow(dec), max_queue=1)
    try:
        # a client that leaves mid-stream: its generation stops long before max_tokens
        c, r = stream_request(s, "/v1/completions", {"model": MODEL, "prompt": PROMPT * 4, "max_tokens": 400,
                                                     "temperature": 0})
        r.readline()
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        deadline = time.time() + 5
        while s.metric('requests_total{outcome="cancelled"}') < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert s.metric('requests_total{outcome="cancelled"}') == 1
        time.sleep(0.3)
        assert s.metric("num_requests_running") == 0 and s.metric("generation_tokens_total") < 100

        # one running, one waiting: the third is refused
        held = [stream_request(s, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 30,
                                                      "temperature": 0}) for _ in range(2)]
        status, out, resp = s.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5})
        assert status == 429 and resp.getheader("Retry-After") == "1" and out["error"]["code"] == "queue_full"
        texts = ["".join(e["choices"][0]["text"] for e in sse(r) if e["choices"]) for _, r in held]
        assert texts[0] == texts[1] == dec.generate(PROMPT, max_new_tokens=30).text

        # a request that fails mid-stream gets an error event; the server goes on
        _, r = stream_request(s, "/v1/completions", {"model": MODEL, "prompt": PROMPT + " boom", "max_tokens": 30,
                                                     "temperature": 0})
        assert "boom" in sse(r)[-1]["error"]["message"]
        status, out, _ = s.post("/v1/completions", {"model": MODEL, "prompt": "w4 boom", "max_tokens": 30,
                                                    "temperature": 0})
        assert status == 500 and out["error"]["type"] == "server_error"
        status, out, _ = s.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                    "temperature": 0})
        assert status == 200 and out["choices"][0]["text"] == dec.generate(PROMPT, max_new_tokens=8).text

        # shutdown (SIGTERM) lets a stream in flight finish
        _, r = stream_request(s, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 20,
                                                     "temperature": 0})
        s.server.should_exit = True
        text = "".join(e["choices"][0]["text"] for e in sse(r) if e["choices"])
        assert text == dec.generate(PROMPT, max_new_tokens=20).text
    finally:
        s.stop()
