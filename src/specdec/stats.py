"""What one request's decoding did: tokens, forwards, acceptance by depth, where the time went."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from specdec.tree import DraftTree


@dataclass
class Stats:
    """tau = tokens emitted per target forward in the decode phase (accepted draft tokens + 1 bonus),
    prefill excluded: Spec-Bench's "mean accepted tokens" convention."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # decode-phase verification forwards
    accept_lengths: list[int] = field(default_factory=list)  # per forward: accepted + 1
    tree_sizes: list[int] = field(default_factory=list)
    depth_tries: list[int] = field(default_factory=list)  # [k-1]: forwards where depth k was tried
    depth_accepts: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    finish_reason: str = ""
    wait_time: float = 0.0  # waiting for another request's turn on a shared Decoder (not in tok/s)
    resumes: int = 0  # times another request took the runner meanwhile and this one rebuilt its state
    acceptance: str = "lossless"  # or the lossy rule that ran (Medusa's typical acceptance at T > 0)
    drafter: str = ""  # what drafted (e.g. what `auto` runs: with a head, or without one and instead)
    costs: str = ""  # how the step costs the drafter chose by were obtained ("": it uses none)
    kernels: str = ""  # the target's kernel path (Runner.kernel_path): the streaming kernel or a fallback
    mask_time: float = 0.0  # seconds a grammar's masks took (within draft and verify time)
    pruned: int = 0  # drafted nodes the grammar forbade (dropped before the verify: drafted blind to it)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        busy = self.total_time - self.wait_time
        return self.new_tokens / busy if busy > 0 else 0.0

    @property
    def overhead_time(self) -> float:
        return max(0.0, self.total_time - self.wait_time - self.prefill_time - self.draft_time - self.verify_time)

    @property
    def alpha_by_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepts, self.depth_tries)]

    @property
    def vanilla_share(self) -> float:
        """Share of decode forwards that verified no draft (a drafter that chose not to draft)."""
        return sum(n == 0 for n in self.tree_sizes) / len(self.tree_sizes) if self.tree_sizes else 0.0

    def tree_size_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.tree_sizes).items()))

    def accept_histogram(self) -> dict[int, int]:
        h: dict[int, int] = {}
        for a in self.accept_lengths:
            h[a] = h.get(a, 0) + 1
        return dict(sorted(h.items()))

    def record(self, tree: DraftTree, path: list[int]) -> None:
        self.target_forwards += 1
        self.accept_lengths.append(len(path) + 1)
        self.tree_sizes.append(len(tree))
        children = tree.children()
        row, k = 0, 0
        while children[row]:  # depth k+1 was tried iff the accepted node at depth k has children
            if len(self.depth_tries) <= k:
                self.depth_tries.append(0)
                self.depth_accepts.append(0)
            self.depth_tries[k] += 1
            if k >= len(path):
                break
            self.depth_accepts[k] += 1
            row, k = path[k] + 1, k + 1

    def summary(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards, "tau": round(self.tau, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "alpha_by_depth": [round(a, 4) for a in self.alpha_by_depth],
            "accept_histogram": self.accept_histogram(),
            "mean_tree_size": round(sum(self.tree_sizes) / max(1, len(self.tree_sizes)), 3),
            "tree_size_histogram": self.tree_size_histogram(), "vanilla_share": round(self.vanilla_share, 4),
            "time": {"total": self.total_time, "prefill": self.prefill_time, "draft": self.draft_time,
                     "verify": self.verify_time, "overhead": self.overhead_time, "wait": self.wait_time,
                     "mask": self.mask_time},
            "finish_reason": self.finish_reason, "resumes": self.resumes, "acceptance": self.acceptance,
            "drafter": self.drafter, "pruned": self.pruned,
        }
