"""`specdec tune`: the EAGLE-2 tree budget (depth, top-k, m) that maximises tokens/s on this machine,
and the same with a prompt-lookup chain in the tree (`lookup`, for `auto`).

Acceptance is measured offline, exactly for greedy decoding. The target's greedy continuation of a
few calibration prompts is known, so at every root position the draft tree is matched against it:
the root path spelling the next tokens is what greedy verification accepts, no target forward
needed per configuration. One expansion per top-k at the largest depth serves every (depth, m): the
EAGLE-2 tree of a smaller depth is that expansion cut at the depth, and its m nodes are the top m by
V (stable, shallow first) of that prefix, exactly as build_dynamic_tree reranks. Replaying the
engine's steps (accepted + 1 tokens at a time) over the per-position lengths gives the τ the engine
reports. Costs are timed here: t(N) of the target, propose() per configuration, and the drafter's
per-step update. A lookup chain of L tokens joins the tree as in UnionDrafter: greedy accepts the longer
of the two matched paths (a path through both shares the chain's prefix), and the tree grows by the
chain's nodes that the EAGLE tree does not already hold.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch

from specdec.drafters.base import DecodeContext
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.target.base import chain_mask
from specdec.tree import DraftTree
from specdec.verify import Verdict

DEPTHS = range(2, 8)
TOPKS = range(1, 7)
SIZES = (2, 3, 4, 6, 8, 10, 12, 16, 20)
LOOKUPS = (4, 8, 12, 16, 24)
TUNED = ("depth", "topk", "total_tokens")
SHIPPED_HEADS = Path(__file__).resolve().parent / "heads"

# generic chat requests; none is a Spec-Bench / MT-bench / HumanEval prompt (those are for measuring)
CALIBRATION_PROMPTS = (
    "Explain how the gears on a bicycle make it easier to ride up a hill.",
    "Write a short, polite email asking a colleague to move our Tuesday meeting to Thursday.",
    "Give me five tips for keeping houseplants healthy, one sentence each.",
    "What is the difference between a list and a tuple in Python? Show a small example.",
    "Describe the water cycle so that a ten-year-old can follow it.",
    "Write a Python function that reads a CSV file and returns the average of one of its columns.",
    "What are the advantages and drawbacks of working from home? Answer in one paragraph.",
    "Give me a simple recipe for pancakes, with quantities.",
)


class Config(NamedTuple):
    depth: int
    topk: int
    total_tokens: int


def candidates(depths=DEPTHS, topks=TOPKS, sizes=SIZES) -> list[Config]:
    # m beyond what the expansion makes is impossible; m < depth gives the same tree as depth m
    # (the top-m set is connected, so no deeper than m) at the price of more head steps
    return [Config(d, k, m) for d in depths for k in topks for m in sizes if d <= m <= k + (d - 1) * k * k]


# ---- acceptance ----

def matched_path(tree: DraftTree, truth: Sequence[int]) -> list[int]:
    """The nodes greedy verification accepts when the target's next tokens are `truth` (siblings are
    distinct tokens, so the path is unique; same walk as verify._verify_greedy)."""
    children, toks = tree.children(), tree.tokens.tolist()
    path: list[int] = []
    row = 0
    while len(path) < len(truth):
        nxt = next((c for c in children[row] if toks[c] == truth[len(path)]), None)
        if nxt is None:
            break
        path.append(nxt)
        row = nxt + 1
    return path


def accepted_lengths(full: DraftTree, truth: Sequence[int], configs: Sequence[Config],
                     budget: int = 1 << 30) -> dict[Config, int]:
    """Greedy accepted length of each config's EAGLE-2 tree, read off `full`: the expansion of the same
    top-k at a depth >= every config's, every node kept, in build order (so depth-sorted).
    budget = the engine's ctx.max_nodes (the drafter caps depth and m by it)."""
    path = matched_path(full, truth)
    path_ranks: dict[int, list[int]] = {}  # depth -> rank by V of each path node within that depth
    out = {}
    for c in configs:
        d, m = min(c.depth, budget), min(c.total_tokens, budget)
        if d not in path_ranks:
            nd = int((full.depth <= d).sum())
            order = torch.argsort(-full.scores[:nd], stable=True)
            pos = torch.empty(nd, dtype=torch.long)
            pos[order] = torch.arange(nd)
            path_ranks[d] = [int(pos[i]) for i in path if i < nd]
        out[c] = sum(r < m for r in path_ranks[d])  # the kept set is closed under parents
    return out


def replay(accepted: Sequence[int]) -> list[int]:
    """The engine's accept lengths (accepted + 1 per target forward) for a greedy generation whose
    accepted length at root position i (i = 0: the first generated token) is accepted[i]."""
    return [accepted[i] + 1 for i in visited(accepted)]


def visited(accepted: Sequence[int]) -> list[int]:
    """The root positions the engine drafts from (one target forward each)."""
    out, i = [], 0
    while i < len(accepted):
        out.append(i)
        i += accepted[i] + 1
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Walk:
    accepted: dict[Config, list[int]]  # per root position
    draft_s: dict[Config, list[float]]  # propose() wall times at the timed positions
    follow_s: list[float]  # the drafter's update after each step (engine: drafter.accept)
    # (config, lookup L) -> per root position (accepted, nodes) of the EAGLE tree + an L-token lookup chain
    union: dict[tuple[Config, int], list[tuple[int, int]]] = field(default_factory=dict)
    lookup_s: list[float] = field(default_factory=list)  # prompt-lookup propose() wall times


def walk(drafter, target, prompt: list[int], continuation: list[int], configs: Sequence[Config],
         time_every: int = 0, lookups: Sequence[int] = ()) -> Walk:
    """Drive an EagleDrafter along prompt + continuation (the target's greedy output) one token at a
    time, recording every config's accepted length at each root position. time_every > 0: also time
    propose() for every config at every time_every-th position that leaves room for the largest tree.
    lookups: also record each config joined with a prompt-lookup chain of each of these lengths."""
    from specdec.drafters.prompt_lookup import PromptLookupDrafter

    seq = list(prompt) + list(continuation)
    p, n_seq = len(prompt), len(seq)
    if not configs or not continuation:
        raise SpecdecError("nothing to measure: no configurations or an empty continuation")
    target.reset()
    feats = target.forward(torch.tensor(seq), logits_rows=slice(-1, None)).features
    target.rollback()
    ctx = DecodeContext(seq[:p + 1], SamplingParams(), None, p, feats[:p])
    drafter.begin(ctx)
    by_k: dict[int, list[Config]] = {}
    for c in configs:
        by_k.setdefault(c.topk, []).append(c)
    depth_max = max(c.depth for c in configs)
    m_max = max(c.total_tokens for c in configs)
    w = Walk({c: [] for c in configs}, {c: [] for c in configs}, [], {(c, n): [] for c in configs for n in lookups})
    pld = PromptLookupDrafter(num_tokens=max(lookups)) if lookups else None
    warm = True
    for r in range(p, n_seq - 1):
        budget = n_seq - 2 - r  # what the engine allows with max_new_tokens = len(continuation)
        truth = seq[r + 1:]
        chain: list[int] = []
        if pld is not None and budget > 0:
            t = time.perf_counter()
            chain = pld.propose(replace(ctx, max_nodes=budget)).tokens.tolist()
            w.lookup_s.append(time.perf_counter() - t)
        for k, cs in by_k.items():
            if budget == 0:
                found = merged = dict.fromkeys(cs, 0)
            else:
                _set(drafter, Config(depth_max, k, 1 << 30))
                full = drafter.propose(ctx)
                found = accepted_lengths(full, truth, cs, budget)
                if lookups:  # the chain's prefix that the tree already holds
                    merged = accepted_lengths(full, chain, cs, budget)
            for c, a in found.items():
                w.accepted[c].append(a)
                m = min(c.total_tokens, budget)
                for n in lookups:  # UnionDrafter: the chain gets the room the EAGLE tree leaves
                    cut = chain[:max(0, min(n, budget - m))]
                    w.union[(c, n)].append((max(a, common_prefix(cut, truth)),
                                            m + len(cut) - min(merged[c], len(cut))))
        if time_every and (r - p) % time_every == 0 and budget >= m_max:
            passes = 2 if warm else 1  # the very first pass only warms up allocations and caches
            for rep in range(passes):
                for c in configs:
                    _set(drafter, c)
                    t = time.perf_counter()
                    drafter.propose(ctx)
                    if rep == passes - 1:
                        w.draft_s[c].append(time.perf_counter() - t)
            warm = False
        if r == n_seq - 2:
            break
        # follow the text, as the engine does after each verification
        ctx.tokens.append(seq[r + 1])
        ctx.features = feats[r:r + 1]
        t = time.perf_counter()
        drafter.accept(ctx, Verdict([], [seq[r + 1]], seq[r + 1]))
        w.follow_s.append(time.perf_counter() - t)
    return w


def _set(drafter, c: Config) -> None:
    drafter.depth, drafter.topk, drafter.total_tokens = c


# ---- costs ----

@torch.inference_mode()
def forward_costs(runner, sizes: Sequence[int], reps: int = 10, ctx: int = 200) -> dict[int, float]:
    """Median seconds of a target forward over N new tokens (a chain mask, as a tree would use) after
    `ctx` cached tokens. Sizes are interleaved per repetition so drift on a busy machine hits all alike."""
    runner.reset()
    v = min(runner.vocab_size, 1000)
    runner.forward(torch.randint(0, v, (ctx,)), logits_rows=slice(-1, None))
    runner.commit(range(ctx))
    ts: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(reps + 2):
        for n in sizes:
            xs = torch.randint(0, v, (n,))
            mask = chain_mask(ctx, n) if n > 1 else None
            t = time.perf_counter()
            runner.forward(xs, None, mask)
            runner.rollback()
            if rep >= 2:  # warm-up
                ts[n].append(time.perf_counter() - t)
    runner.reset()
    return {n: statistics.median(x) for n, x in ts.items()}


# ---- the choice ----

@dataclass
class Row:
    config: Config
    tau: float
    draft_s: float
    target_s: float  # t(m + 1): the root and m nodes (with a lookup chain: the mean over the steps)
    follow_s: float
    lookup: int = 0  # tokens of the prompt-lookup chain joined to the tree

    @property
    def tokens_per_second(self) -> float:
        return self.tau / (self.draft_s + self.target_s + self.follow_s)

    def as_dict(self) -> dict:
        return {**self.config._asdict(), **({"lookup": self.lookup} if self.lookup else {}),
                "tau": round(self.tau, 4), "draft_ms": round(self.draft_s * 1e3, 3),
                "target_ms": round(self.target_s * 1e3, 3), "tokens_per_second": round(self.tokens_per_second, 2)}


def rank(rows: Sequence[Row]) -> list[Row]:
    """Best first; ties go to the smaller tree."""
    return sorted(rows, key=lambda r: (-r.tokens_per_second, r.config.total_tokens, r.config.depth, r.config.topk))


def tune(decoder, prompts: Sequence[list[int]], tokens: int = 256, configs: Sequence[Config] | None = None,
         reps: int = 7, time_every: int = 24, log: Callable[[str], None] = lambda s: None,
         lookups: Sequence[int] = LOOKUPS) -> dict:
    """Measure and choose for an eagle2 Decoder (api.from_models) on token-id prompts. Returns the record
    that save_tuning writes; its depth / topk / total_tokens are the choice for `eagle2`, its "auto" the
    best of those and of every tree joined with a lookup chain of each length in `lookups`."""
    from specdec.drafters.base import NoDrafter
    from specdec.drafters.eagle import EagleDrafter
    from specdec.engine import Stats, decode

    drafter, target = decoder.drafter, decoder.runner
    if not isinstance(drafter, EagleDrafter) or not drafter.dynamic:
        raise SpecdecError("tune needs an eagle2 decoder (an EAGLE head)")
    if not prompts or tokens < 2:
        raise SpecdecError("tune needs at least one prompt and --tokens >= 2")
    configs = list(configs or candidates())
    steps: dict[Config, list[int]] = {c: [] for c in configs}  # accept lengths the engine would record
    draft_s: dict[Config, list[float]] = {c: [] for c in configs}
    follow_s: list[float] = []
    lookup_s: list[float] = []
    union_steps: dict[tuple[Config, int], list[tuple[int, int]]] = {(c, n): [] for c in configs for n in lookups}
    positions = 0
    for i, prompt in enumerate(prompts):
        if len(prompt) + tokens + 1 > target.max_length:
            raise SpecdecError(f"calibration prompt {i} + {tokens} tokens exceed the context of {target.max_length}")
        cont = [t for step in decode(target, NoDrafter(), prompt, SamplingParams(), tokens, decoder.eos_ids,
                                     Stats()) for t in step]
        saved = Config(drafter.depth, drafter.topk, drafter.total_tokens)
        try:
            w = walk(drafter, target, prompt, cont, configs, time_every, lookups)
        finally:
            _set(drafter, saved)
        for c in configs:  # each prompt is its own generation: replay it separately, pool the steps
            steps[c] += replay(w.accepted[c])
            draft_s[c] += w.draft_s[c]
        for key, per_pos in w.union.items():
            union_steps[key] += [(per_pos[i][0] + 1, per_pos[i][1]) for i in visited([a for a, _ in per_pos])]
        follow_s += w.follow_s
        lookup_s += w.lookup_s
        positions += len(cont) - 1
        log(f"prompt {i + 1}/{len(prompts)}: {len(cont)} tokens walked")
    if not all(draft_s.values()) or not follow_s:
        raise SpecdecError("the continuations are too short to time the drafter: raise --tokens")
    sizes = {c.total_tokens + 1 for c in configs} | {n + 1 for st in union_steps.values() for _, n in st} | {1}
    sizes = sorted(sizes)
    log(f"timing the target forward for N in {sizes}")
    t_target = forward_costs(target, sizes, reps)
    follow = statistics.median(follow_s)
    rows = rank([Row(c, statistics.mean(steps[c]), statistics.median(draft_s[c]), t_target[c.total_tokens + 1],
                     follow) for c in configs])
    best = rows[0]
    look = statistics.median(lookup_s) if lookup_s else 0.0
    both = rank(rows + [Row(c, statistics.mean(a for a, _ in st), statistics.median(draft_s[c]) + look,
                            statistics.mean(t_target[n + 1] for _, n in st), follow, lookup)
                        for (c, lookup), st in union_steps.items()])
    return {
        **best.config._asdict(),
        "tau": round(best.tau, 4),
        "tokens_per_second": round(best.tokens_per_second, 2),
        "vanilla_tokens_per_second": round(1 / t_target[1], 2),  # one forward per token, no drafting
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "calibration": {"prompts": len(prompts), "tokens": tokens, "positions": positions,
                        "forwards_replayed": len(steps[best.config])},
        "target_ms": {str(n): round(t * 1e3, 3) for n, t in t_target.items()},
        "follow_ms": round(follow * 1e3, 3),
        "top": [r.as_dict() for r in rows[:20]],
        # `auto`: the fastest of the trees above and of the trees joined with a prompt-lookup chain
        "auto": {**both[0].config._asdict(), "lookup": both[0].lookup, "tau": round(both[0].tau, 4),
                 "tokens_per_second": round(both[0].tokens_per_second, 2)},
        "lookups_tried": list(lookups),
        "top_with_lookup": [r.as_dict() for r in both[:10]],
    }


def machine() -> dict:
    from specdec.bench.runner import machine_info  # one place reads the CPU model

    return {"cpu": machine_info()["cpu"] or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__}


# ---- where the choice lives ----

def tuning_path(head_dir: str | os.PathLike) -> Path:
    """Where `specdec tune` writes by default: next to the head, unless the head ships inside the
    package or its dir is read-only; then under the cache (SPECDEC_CACHE or ~/.cache/specdec)."""
    from specdec.target.loading import cache_dir

    head_dir = Path(head_dir).resolve()
    if head_dir.parent == SHIPPED_HEADS or not os.access(head_dir, os.W_OK):
        return cache_dir() / "tuning" / f"{head_dir.name}.json"
    return head_dir / "tuning.json"


def load_tuning(head_dir: str | os.PathLike, auto: bool = False) -> dict | None:
    """{depth, topk, total_tokens} for this head: this machine's own `specdec tune` result if there is
    one, else the tuning.json shipped next to the head, else None. auto: the choice for `auto`, which
    adds `lookup` (0 in files written before tune measured lookup chains)."""
    for f in dict.fromkeys([tuning_path(head_dir), Path(head_dir).resolve() / "tuning.json"]):
        if not f.is_file():
            continue
        try:
            raw = json.loads(f.read_text())
            src = raw["auto"] if auto and "auto" in raw else raw
            vals = {k: src[k] for k in TUNED}
            lookup = src.get("lookup", 0) if auto else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SpecdecError(f"{f} is not a valid tuning file ({type(e).__name__}: {e}): "
                               "re-run `specdec tune` or delete it") from None
        if not all(type(v) is int and v >= 1 for v in vals.values()):
            raise SpecdecError(f"{f}: depth, topk and total_tokens must be integers >= 1, got {vals}")
        if auto:
            if type(lookup) is not int or lookup < 0:
                raise SpecdecError(f"{f}: lookup must be an integer >= 0, got {lookup!r}")
            vals["lookup"] = lookup
        return vals
    return None


def save_tuning(record: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return path


# ---- command line ----

def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="pick the EAGLE-2 tree budget (depth, top-k, m) for this machine")
    p.add_argument("--model", default=None, help="target: HF dir, .gguf, or the embedded default")
    p.add_argument("--head", default=None, help="EAGLE head dir (default: the one shipped for the model)")
    p.add_argument("--prompts", type=int, default=4, help=f"calibration prompts (1-{len(CALIBRATION_PROMPTS)})")
    p.add_argument("--tokens", type=int, default=256,
                   help="greedy tokens generated per prompt (as long as real answers: a small model repeats "
                        "itself late in an answer, which is where a lookup chain pays)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (tune with the count you will use)")
    p.add_argument("--out", default=None, help="result file (default: <head>/tuning.json; for a shipped or "
                   "read-only head ~/.cache/specdec/tuning/<name>.json, where loading also looks)")
    p.add_argument("--top", type=int, default=10, help="table rows to print")
    p.add_argument("--lookups", default=",".join(map(str, LOOKUPS)),
                   help="prompt-lookup chain lengths to try joined with the tree, for `auto` ('' = none)")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    from specdec.api import from_models
    from specdec.heads.eagle import find_shipped_head
    from specdec.target.loading import load_model

    if not 1 <= args.prompts <= len(CALIBRATION_PROMPTS):
        raise SpecdecError(f"--prompts must be 1-{len(CALIBRATION_PROMPTS)}, got {args.prompts}")
    if args.tokens < 2 + max(SIZES):
        raise SpecdecError(f"--tokens must be >= {2 + max(SIZES)} (room to time the largest tree), got {args.tokens}")
    if args.head is not None and not os.path.isdir(args.head):
        raise SpecdecError(f"EAGLE head {args.head!r} is not a directory")
    try:
        lookups = [int(x) for x in args.lookups.split(",") if x.strip()]
    except ValueError:
        raise SpecdecError(f"--lookups must be comma-separated token counts, got {args.lookups!r}") from None
    if any(n < 1 for n in lookups):
        raise SpecdecError(f"--lookups must be >= 1 each, got {args.lookups!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, _ = load_model(args.model, "cpu", torch.float32)
    head = args.head or find_shipped_head(model)
    if head is None:
        raise SpecdecError("no EAGLE head ships for this model: pass --head DIR "
                           "(train one with `specdec datagen` + `specdec train eagle`)")
    dec = from_models(model, tok, "eagle2", head=str(head))  # explicit eagle2: never a union
    prompts = []
    for q in CALIBRATION_PROMPTS[:args.prompts]:
        try:
            prompts.append(dec.encode([{"role": "user", "content": q}]))
        except SpecdecError:  # no chat template: plain completion
            prompts.append(dec.encode(q))
    log = lambda s: print(s, file=sys.stderr, flush=True)
    log(f"tuning {head} on {machine()['cpu']}, {torch.get_num_threads()} threads")
    rec = tune(dec, prompts, args.tokens, log=log, lookups=lookups)
    rec["head"] = str(Path(head).resolve())
    out = save_tuning(rec, args.out or tuning_path(head))
    print(f"{'depth':>5} {'topk':>4} {'m':>3} {'tau':>6} {'draft ms':>9} {'target ms':>9} {'tok/s':>7}")
    for r in rec["top"][:args.top]:
        print(f"{r['depth']:>5} {r['topk']:>4} {r['total_tokens']:>3} {r['tau']:>6.2f} {r['draft_ms']:>9.2f} "
              f"{r['target_ms']:>9.2f} {r['tokens_per_second']:>7.1f}")
    print(f"chosen: depth {rec['depth']}, topk {rec['topk']}, total_tokens {rec['total_tokens']} "
          f"(tau {rec['tau']:.2f}, ~{rec['tokens_per_second']:.1f} tok/s expected vs "
          f"~{rec['vanilla_tokens_per_second']:.1f} vanilla; drafter update {rec['follow_ms']:.2f} ms/step)")
    a = rec["auto"]
    if a.get("lookup"):
        print(f"auto: the same with a {a['lookup']}-token prompt-lookup chain in the tree: depth {a['depth']}, "
              f"topk {a['topk']}, total_tokens {a['total_tokens']} (tau {a['tau']:.2f}, "
              f"~{a['tokens_per_second']:.1f} tok/s expected)")
    else:
        print("auto: eagle2 as chosen (no prompt-lookup chain gained)")
    if rec["tokens_per_second"] < rec["vanilla_tokens_per_second"]:
        print("note: no tree beats plain decoding here: the head's acceptance is too low for its cost")
    print(f"written to {out}")
    return 0
