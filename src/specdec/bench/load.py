"""`specdec bench serve`: `specdec serve` under load. For each method and --max-batch limit it starts the
server as a subprocess, then concurrent streaming clients (the official `openai` async client) send
MT-bench first turns, with `--long` prompts of 2-4k tokens (the long-context set's) spread among them.
Reported: total tokens/s, p50/p99 request latency, p50/p99 time to first token, p50/p99 and the largest
wait between two pieces of one answer (a running stream's stall while a long prompt joins), the mean
batch size, the drafts' mean acceptance length and rate (all three from the server's counters over the
run), errors, and the server's RSS before and after. At each limit the methods run in turn (`--repeat`:
several rounds of that), and the table adds each method's tok/s over the first method's, paired within a
round. `--soak`: many short greedy requests, some clients leaving mid-stream and some bodies malformed;
every well-formed answer must equal the same request's answer alone, and the server must stay up."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.bench.data import load_questions
from specdec.bench.load_report import Result, markdown, percentile
from specdec.bench.outdir import check_out_dir
from specdec.drafters import registry
from specdec.errors import SpecdecError
from specdec.options import arg_type
from specdec.runtime.loading import resolve

HI = [{"role": "user", "content": "hi"}]
# bodies the server must refuse with a 4xx: cut-off JSON, and fields of the wrong shape or range
MALFORMED: list[str | dict] = ['{"messages": [', {"messages": "hi"}, {"messages": []},
                               {"messages": HI, "max_tokens": -3}, {"messages": HI, "temperature": "hot"},
                               {"messages": [{"role": "user"}]}]


@dataclass
class Outcome:
    kind: str  # "ok", "left" (the client disconnected on purpose), "malformed", "error"
    prompt: int = -1  # index into the prompts
    latency: float = 0.0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # between successive pieces of the answer
    tokens: int = 0
    text: str = ""
    detail: str = ""


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`specdec serve` in a subprocess on a free port; its output goes to `log`."""

    def __init__(self, model: str | None, method: str, max_batch: int, extra: list[str], log: Path,
                 timeout: float) -> None:
        name, *opts = method.split(":")
        self.port = free_port()
        cmd = [sys.executable, "-m", "specdec.cli", "serve", "--port", str(self.port), "--method", name,
               "--max-batch", str(max_batch), "--max-queue", "4096"]
        cmd += ["--model", model] if model else []
        for o in opts:
            cmd += ["--opt", o]
        self.cmd = cmd + extra
        self.log = log
        with open(log, "w") as f:  # the server writes to it, not we
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait(timeout)
        except BaseException:  # Ctrl-C included: no server is left running
            self.stop()
            raise

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise SpecdecError(f"specdec serve exited with {self.proc.returncode}: {tail[0]}")
            if healthy(self.url, 1.0):
                return
            time.sleep(0.2)
        raise SpecdecError(f"specdec serve did not answer /health within {timeout:g} s (log: {self.log})")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> float:
        return rss_mb(self.proc.pid) if self.alive else 0.0

    def stop(self) -> None:
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _openai():
    try:
        import openai
    except ImportError as e:
        raise SpecdecError(f"specdec bench serve needs the openai client (pip install openai): {e}") from None
    return openai


async def _stream(client, model: str, prompt: str, max_tokens: int, leave_after: int | None) -> Outcome:
    """One streamed greedy chat request; leave_after: close the stream after that many chunks."""
    t0 = last = time.perf_counter()
    ttft, parts, gaps, tokens, chunks = None, [], [], 0, 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for c in stream:
        if c.usage is not None:
            tokens = c.usage.completion_tokens
        if c.choices and c.choices[0].delta.content:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
            parts.append(c.choices[0].delta.content)
        chunks += 1
        if leave_after is not None and chunks >= leave_after:
            await stream.close()
            return Outcome("left", latency=time.perf_counter() - t0)
    return Outcome("ok", latency=time.perf_counter() - t0, ttft=ttft, gaps=gaps, tokens=tokens, text="".join(parts))


async def _malformed(http, url: str, model: str, body: str | dict) -> Outcome:
    if isinstance(body, dict):
        body = json.dumps({"model": model, "max_tokens": 8, **body})
    r = await http.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    ok = 400 <= r.status_code < 500
    return Outcome("malformed" if ok else "error", detail=f"malformed body answered {r.status_code}")


async def drive(url: str, model: str, prompts: list[str], plan: list[tuple[str, int]], clients: int,
                max_tokens: int) -> tuple[list[Outcome], float]:
    """Run `plan` ((kind, prompt index): kind "ok", "left" or "malformed") from `clients` concurrent
    clients: (outcomes in plan order, wall seconds)."""
    openai = _openai()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    out: list[Outcome | None] = [None] * len(plan)
    todo = iter(range(len(plan)))

    async def worker(http) -> None:
        for i in todo:
            kind, p = plan[i]
            try:
                if kind == "malformed":
                    o = await _malformed(http, url, model, MALFORMED[i % len(MALFORMED)])
                else:
                    o = await _stream(client, model, prompts[p], max_tokens, 2 if kind == "left" else None)
            except Exception as e:
                o = Outcome("error", detail=f"{type(e).__name__}: {e}")
            o.prompt = p
            out[i] = o

    async with openai.DefaultAsyncHttpxClient(timeout=60) as http:  # the client's own HTTP library
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    await client.close()
    return out, wall


def reference(url: str, model: str, prompt: str, max_tokens: int) -> str:
    """The answer to one non-streamed greedy request, alone on the server."""
    client = _openai().OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or ""


def soak_plan(n: int, clients: int, prompts: int, left: float, malformed: float, seed: int) -> list[tuple[str, int]]:
    """n requests: a `left` share of the clients leave mid-stream (their requests), a `malformed` share
    of the requests carry a bad body; prompts round-robin."""
    rng = random.Random(seed)
    leavers = set(rng.sample(range(clients), max(1, round(left * clients)))) if left > 0 else set()
    plan = []
    for i in range(n):
        kind = "malformed" if rng.random() < malformed else "left" if i % clients in leavers else "ok"
        plan.append((kind, i % prompts))
    return plan


def with_long(plan: list[tuple[str, int]], first: int, count: int, n: int) -> list[tuple[str, int]]:
    """`plan` with n greedy requests for the `count` prompts from index `first` on, in turn, spread evenly
    through it (the j-th after about (j + 1/2) / n of it)."""
    out = list(plan)
    for j in reversed(range(n)):
        out.insert(round((j + 0.5) * len(plan) / n), ("ok", first + j % count))
    return out


def run_one(args, method: str, limit: int, prompts: list[str], out: Path, rnd: int = 1, long: int = 0) -> Result:
    """One server run; the last `long` prompts are the long ones, asked --long times in all."""
    log = out / f"server-{method.replace(':', '_')}-L{limit}{f'-r{rnd}' if rnd > 1 else ''}.log"
    server = ServerProcess(args.model, method, limit, shlex.split(args.server_args), log, args.start_timeout)
    try:
        model = "smollm2" if args.model is None else args.model
        if args.soak:
            plan = soak_plan(args.requests, args.clients, len(prompts) - long, args.leave, args.malformed, args.seed)
        else:
            plan = [("ok", i % (len(prompts) - long)) for i in range(args.requests)]
        plan = with_long(plan, len(prompts) - long, long, args.long)
        # one untimed request: the first forward's one-time costs (kernels, allocations) are not load
        reference(server.url, model, prompts[0], 4)
        before, counts0 = server.rss(), counters(server.url)
        outcomes, wall = asyncio.run(drive(server.url, model, prompts, plan, args.clients, args.max_tokens))
        after = server.rss()
        drafts, drafted, accepted, steps, rows = (b - a for a, b in zip(counts0, counters(server.url)))
        ok = [o for o in outcomes if o.kind == "ok"]
        soak = {}
        if args.soak:
            want = {p: reference(server.url, model, prompts[p], args.max_tokens)
                    for p in sorted({o.prompt for o in ok})}
            bad = [o.prompt for o in ok if o.text != want[o.prompt]]
            soak = {"left": sum(o.kind == "left" for o in outcomes),
                    "malformed_rejected": sum(o.kind == "malformed" for o in outcomes),
                    "checked": len(ok), "mismatched": len(bad), "mismatched_prompts": sorted(set(bad)),
                    "server_alive": server.alive and healthy(server.url), "rss_growth_mb": round(after - before, 1)}
        errors = [o.detail for o in outcomes if o.kind == "error"]
        for e in errors[:3]:
            print(f"specdec bench serve: {method} L={limit}: {e}", file=sys.stderr)
        ttfts, gaps = [o.ttft for o in ok if o.ttft is not None], [g for o in ok for g in o.gaps]
        return Result(method, limit, len(plan), len(ok), len(errors), sum(o.tokens for o in ok) / wall,
                      percentile([o.latency for o in ok], 0.5), percentile([o.latency for o in ok], 0.99),
                      percentile(ttfts, 0.5), rows / steps if steps else None, round(before, 1), round(after, 1),
                      soak, rnd, 1 + accepted / drafts if drafts else None, accepted / drafted if drafted else None,
                      args.long, percentile(ttfts, 0.99), percentile(gaps, 0.5), percentile(gaps, 0.99),
                      max(gaps, default=None))
    finally:
        server.stop()


def counters(url: str) -> tuple[float, ...]:
    """The server's (drafts, draft tokens, accepted tokens, decode steps, sequences they carried) counters
    so far."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    names = ["spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
             "batch_steps", "batch_sequences"]
    return tuple(float(values[f"specdec:{k}_total"]) for k in names)


def healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


def add_parser(bs) -> None:
    s = bs.add_parser("serve", help="specdec serve under concurrent streaming clients: tokens/s, latency, batch size",
                      description=__doc__)
    s.add_argument("--model", default=None, help="target (default: embedded SmolLM2-135M-Instruct)")
    s.add_argument("--methods", default="vanilla,auto", help="comma list of name[:key=value...] (default vanilla,auto)")
    s.add_argument("--limits", default=None, help="comma list of --max-batch values (default 1,2,4,8; --soak: 8)")
    s.add_argument("--clients", type=arg_type(int, ge=1), default=None, help="concurrent clients (default 16; soak 32)")
    s.add_argument("--requests", type=arg_type(int, ge=1), default=None, help="requests per run (default 64; soak 500)")
    s.add_argument("--max-tokens", type=arg_type(int, ge=1), default=None, help="per request (default 256; soak 32)")
    s.add_argument("--questions", default=None, help="questions file (default: MT-bench's first turns)")
    s.add_argument("--long", type=arg_type(int, ge=0), default=None,
                   help="long-prompt requests spread among the others (default 8; soak 0)")
    s.add_argument("--long-questions", default=None,
                   help="their prompts, in turn (default: the long-context set's 2k and 4k prompts, alternating)")
    s.add_argument("--server-args", default="", help='more `specdec serve` flags, e.g. "--threads 2"')
    s.add_argument("--soak", action="store_true", help="many short greedy requests, some clients leaving mid-stream "
                   "and some bodies malformed: every answer checked against the same request alone")
    s.add_argument("--leave", type=arg_type(float, ge=0, le=1), default=0.1,
                   help="soak: share of clients that leave mid-stream (default 0.1)")
    s.add_argument("--malformed", type=arg_type(float, ge=0, le=1), default=0.05,
                   help="soak: share of requests with a malformed body (default 0.05)")
    s.add_argument("--seed", type=arg_type(int, ge=0), default=0, help="soak: who leaves, which bodies are malformed")
    s.add_argument("--repeat", type=arg_type(int, ge=1), default=1,
                   help="rounds (default 1); each runs every limit with the methods in turn, and the table adds "
                   "each method's tok/s over the first method's, per round and the median")
    s.add_argument("--start-timeout", type=arg_type(float, gt=0), default=600.0, help="seconds for the server to start")
    s.add_argument("--out", dest="load_out", default=None, help="results dir, empty or new: load.json, load.md and "
                   "the servers' logs (default bench-results/serve-<time>)")
    s.set_defaults(func=cmd_load)


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecdecError(f"{flag} expects a comma list of integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SpecdecError(f"{flag} expects integers >= 1, got {text!r}")
    return vals


def long_prompts(path: str | None) -> list[str]:
    """The long prompts: a file's first turns, or the long-context set's 2k and 4k prompts, alternating."""
    if path is not None:
        return [q.turns[0] for q in load_questions(None, path)]
    qs = load_questions("long")
    two, four = ([q.turns[0] for q in qs if q.category.endswith(f"-{n}k")] for n in (2, 4))
    return [p for pair in zip(two, four) for p in pair]


def cmd_load(args) -> int:
    soak = args.soak
    limits = _ints(args.limits or ("8" if soak else "1,2,4,8"), "--limits")
    args.clients = args.clients or (32 if soak else 16)
    args.requests = args.requests or (500 if soak else 64)
    args.max_tokens = args.max_tokens or (32 if soak else 256)
    args.long = (0 if soak else 8) if args.long is None else args.long
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise SpecdecError("--methods is empty")
    for m in methods:  # each server would fail on its own, after its model load
        name, *opts = m.split(":")
        registry.parse(name, dict(o.partition("=")[::2] for o in opts))
    try:
        shlex.split(args.server_args)
    except ValueError as e:
        raise SpecdecError(f"--server-args: {e}") from None
    resolve(args.model)  # each server would say so only after it started
    qs = load_questions("mt_bench" if args.questions is None else None, args.questions)
    prompts = [q.turns[0] for q in qs]
    long = long_prompts(args.long_questions) if args.long else []
    _openai()
    out = Path(args.load_out or f"bench-results/serve-{time.strftime('%Y%m%d-%H%M%S')}")
    check_out_dir(out, overwrite=False)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    runs = [(k, limit, method) for k in range(1, args.repeat + 1) for limit in limits for method in methods]
    for k, limit, method in runs:  # at each limit the methods in turn: they see the same machine
        print(f"specdec bench serve: {method}, --max-batch {limit}: {args.requests} requests"
              f"{f' and {args.long} with a long prompt' if args.long else ''} from {args.clients} clients, "
              f"{args.max_tokens} tokens each"
              f"{' (soak)' if soak else ''}"
              f"{f' (round {k} of {args.repeat})' if args.repeat > 1 else ''}", file=sys.stderr)
        results.append(run_one(args, method, limit, prompts + long, out, k, len(long)))
        (out / "load.json").write_text(json.dumps({"command": "specdec " + shlex.join(sys.argv[1:]),
                                                   "cpu_count": os.cpu_count(),
                                                   "results": [asdict(r) for r in results]}, indent=1))
    md = markdown(results)
    (out / "load.md").write_text(md)
    sys.stdout.write(md)
    failed = any(r.errors for r in results) or any(r.soak and (r.soak["mismatched"] or not r.soak["server_alive"])
                                                   for r in results)
    return 1 if failed else 0
