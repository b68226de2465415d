"""The routes: /v1/chat/completions, /v1/completions (streamed as SSE or not), /v1/models, /health,
/metrics, and the playground page at /. Requests are checked (fields, model, context) before they are
queued; every error is an OpenAI-style body, and a failure ends its own request only."""

from __future__ import annotations

import asyncio
import bisect
import json
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.resources import files

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.api import Chunk, Decoder, Generation, GenerationParams
from specdec.batch import PREFILL_CHUNK, STALL
from specdec.errors import SpecdecError
from specdec.serve.engine import Engine, Job, QueueFull, make_engine
from specdec.serve.metrics import Metrics
from specdec.serve.protocol import ChatRequest, CompletionRequest, Sampling, error_body

RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type, param, code), headers


def build_app(decoder: Decoder, model_name: str, engine: Engine | None = None, max_queue: int = 64,
              max_batch: int = 1, prefill_chunk: int = PREFILL_CHUNK, prefill_stall: float = STALL) -> FastAPI:
    engine = engine or make_engine(decoder, max_batch, max_queue, prefill_chunk=prefill_chunk,
                                   prefill_stall=prefill_stall)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()  # uvicorn has drained the requests in flight by now

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the body is not valid JSON: {err.get('msg')}", code="json_invalid"),
                                status_code=400)
        param = ".".join(loc) or None
        return JSONResponse(error_body(f"{param or 'body'}: {err.get('msg')}", param=param, code=err.get("type")),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    playground = files("specdec.serve").joinpath("static/playground.html").read_text(encoding="utf-8")

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return playground

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": decoder.runner.max_length,
                                            "specdec": {"method": decoder.method}}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine.running(), engine.waiting(), engine.batch_size(),
                                                engine.steps()),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        return await _serve(req, req.prompt(), "chat.completion")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await _serve(req, req.text(), "text_completion")

    async def _serve(req: Sampling, prompt, kind: str):
        if req.model != model_name:
            raise APIError(404, f"model {req.model!r} is not served here (this server serves {model_name!r})",
                           "not_found_error", "model", "model_not_found")
        if req.n != 1:
            raise APIError(400, f"n must be 1 (one completion per request), got {req.n}", param="n")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        try:
            ids = await asyncio.to_thread(decoder.encode, prompt)
        except SpecdecError as e:
            raise APIError(400, str(e), param="messages" if kind == "chat.completion" else "prompt") from None
        limit = decoder.runner.max_length
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if len(ids) + (asked or 1) > limit:
            raise APIError(400, f"the prompt has {len(ids)} tokens and max_tokens is {asked or 1}: together over "
                           f"the model's context of {limit} tokens", param="max_tokens",
                           code="context_length_exceeded")
        try:
            structure = req.response_format.constraint() if req.response_format is not None else {}
            if structure:  # its own check first: an error there names response_format
                GenerationParams(**structure)
        except (SpecdecError, ValueError) as e:
            raise APIError(400, f"response_format: {str(e).splitlines()[0]}", param="response_format") from None
        try:
            params = GenerationParams(max_new_tokens=asked or limit - len(ids), temperature=req.temperature,
                                      top_p=req.top_p, top_k=max(req.top_k, 0), seed=req.seed, stop=req.stops(),
                                      **structure)
        except (SpecdecError, ValidationError) as e:
            raise APIError(400, str(e).splitlines()[0]) from None
        job = Job(prompt, params)
        try:
            engine.submit(job)
        except QueueFull:
            metrics.request("rejected")
            raise APIError(429, "the server's queue is full: retry later", "rate_limit_error", None, "queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        rid = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}"
        out = Output(job, metrics, len(ids), rid, kind, model_name, decoder.method, Pieces(decoder._text))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(out.sse(include_usage), media_type="text/event-stream")
        return await out.whole()

    return app


class Output:
    """One request's answer, as one response or as server-sent events; it keeps the metrics."""

    def __init__(self, job: Job, metrics: Metrics, prompt_tokens: int, rid: str, kind: str, model: str,
                 method: str, pieces: Pieces) -> None:
        self.job, self.metrics, self.prompt_tokens, self.pieces = job, metrics, prompt_tokens, pieces
        self.rid, self.kind, self.model, self.method = rid, kind, model, method
        self.created = int(time.time())
        self.generated = 0
        self.chat = kind == "chat.completion"

    async def chunks(self) -> AsyncIterator:
        """The job's chunks; the job is cancelled if its reader stops early (a client that left)."""
        outcome, last = "cancelled", None
        try:
            while (chunk := await self.job.next()) is not None:
                if chunk.token_ids:
                    now = time.perf_counter()
                    if last is None:
                        self.metrics.first_token(now - self.job.arrived)
                    else:
                        self.metrics.next_tokens(now - last)
                    last = now
                self.generated += len(chunk.token_ids)
                if chunk.final is not None:
                    self.metrics.speculation(chunk.final.stats)
                    outcome = "finished"
                yield chunk
        except Exception:
            outcome = "failed"
            raise
        finally:
            self.job.cancel()
            self.metrics.request(outcome)
            self.metrics.tokens(self.prompt_tokens, self.generated)

    async def whole(self) -> dict:
        text, final = [], None
        try:
            async for chunk in self.chunks():
                text.append(chunk.text)
                final = chunk.final or final
        except Exception as e:
            raise APIError(500, f"decoding failed: {e}", "server_error") from None
        choice = {"index": 0, "finish_reason": final.finish_reason, "logprobs": None}
        content = "".join(text)
        choice |= {"message": {"role": "assistant", "content": content}} if self.chat else {"text": content}
        return {**self._head(), "choices": [choice], "usage": self._usage(), "specdec": self._extra(final)}

    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.chat:
            yield _event({**self._head(kind), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                           "finish_reason": None}]})
        try:
            async for chunk in self.chunks():
                final = chunk.final
                if chunk.text or final is not None:
                    fin = final.finish_reason if final else None
                    piece = ({"delta": {"content": chunk.text} if chunk.text else {}} if self.chat
                             else {"text": chunk.text, "logprobs": None})
                    event = {**self._head(kind), "choices": [{"index": 0, **piece, "finish_reason": fin}]}
                    extra = self.pieces.split(chunk) | (self._extra(final) if final else {})
                    yield _event(event | ({"specdec": extra} if extra else {}))
        except Exception as e:  # the stream has begun: the error goes in it
            yield _event(error_body(f"decoding failed: {e}", "server_error"))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield _event({**self._head(kind), "choices": [], "usage": self._usage()})
        yield "data: [DONE]\n\n"

    def _head(self, kind: str | None = None) -> dict:
        return {"id": self.rid, "object": kind or self.kind, "created": self.created, "model": self.model}

    def _usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.generated,
                "total_tokens": self.prompt_tokens + self.generated}

    def _extra(self, final: Generation) -> dict:
        s = final.stats
        return {"method": self.method, "drafter": s.drafter, "tau": round(s.tau, 4),
                "tokens_per_second": round(s.tokens_per_second, 2),
                "target_forwards": s.target_forwards, "accepted_tokens_per_position": list(s.depth_accepts),
                "tried_per_position": list(s.depth_tries)}


class Pieces:
    """Cuts a stream's text into the pieces its tokens produced, each with its depth (Chunk.depths), so a
    client can colour the answer by how each token was produced. A chunk's pieces concatenate to its text."""

    WINDOW = 6  # tokens of left context decoded with each new token: enough for its text, and no O(n^2)

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.depths: list[int] = []
        self.ends: list[int] = []  # where each token's text ends in the answer
        self.pos = 0  # characters of the answer cut so far
        self.off = False

    def _len(self, ids: list[int]) -> int:
        return len(self.decode(ids).rstrip("\ufffd")) if ids else 0  # an incomplete character counts once whole

    def split(self, chunk: Chunk) -> dict:
        """{"tokens": [text, ...], "depths": [depth, ...]} for this chunk; {} if it has no text or no depths."""
        if len(chunk.depths) != len(chunk.token_ids):
            self.off = True  # an engine that does not tell depths: the positions after this are unknown
        if self.off or not (self.ids or chunk.token_ids):
            self.pos += len(chunk.text)
            return {}
        for tok, depth in zip(chunk.token_ids, chunk.depths):
            start = max(0, len(self.ids) - self.WINDOW)
            before = self._len(self.ids[start:])
            self.ids.append(tok)
            self.depths.append(depth)
            grown = max(0, self._len(self.ids[start:]) - before)
            self.ends.append((self.ends[-1] if self.ends else 0) + grown)
        texts, depths, owner = [], [], None
        for i, ch in enumerate(chunk.text, self.pos):
            k = max(0, min(bisect.bisect_right(self.ends, i), len(self.depths) - 1))
            if k != owner:
                texts.append("")
                depths.append(self.depths[k])
                owner = k
            texts[-1] += ch
        self.pos += len(chunk.text)
        return {"tokens": texts, "depths": depths} if texts else {}


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def serve(decoder: Decoder, model_name: str, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 64,
          max_batch: int = 1, prefill_chunk: int = PREFILL_CHUNK, prefill_stall: float = STALL) -> None:
    """Serve until SIGINT/SIGTERM: then stop accepting, finish the requests in flight, return.

    The engine decodes on this thread, the one that loaded the model, and HTTP runs on another. Why: libgomp's
    idle workers spin only while it manages no more threads than CPUs; a second thread's OpenMP team (the
    load's, then a decoding thread's) made each kernel call wait ~50 us for sleeping workers: forwards 2.7x
    slower on 2 cores."""
    engine = make_engine(decoder, max_batch, max_queue, thread=False, prefill_chunk=prefill_chunk,
                         prefill_stall=prefill_stall)
    server = uvicorn.Server(uvicorn.Config(build_app(decoder, model_name, engine, max_queue, max_batch), host=host,
                                           port=port, log_level="info"))

    def http() -> None:
        try:
            server.run()
        finally:  # stopped, or could not start: the engine ends too
            engine.close()

    def stop(signum, frame) -> None:
        if server.should_exit:  # a second signal: stop without waiting for the requests in flight
            server.force_exit = True
        server.should_exit = True

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="specdec-serve-http")
    try:
        thread.start()
        engine.run()
    finally:  # also when decoding itself failed: the HTTP thread stops, or the process would never exit
        server.should_exit = True
        thread.join()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if not server.started:
        raise SpecdecError(f"specdec serve could not listen on {host}:{port} (the line above says why)")
