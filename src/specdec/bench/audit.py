"""Losslessness audit: at T=0 every method must emit exactly our vanilla's tokens.

Methods in `exclude` (peers on another engine, e.g. llama.cpp, maybe on other weights) are not held to
that; their agreement with the reference is reported instead (share of identical outputs, where the
others first diverge).

On a mismatch, one reference forward of the target (the stock HF module, or the runner of the precision
the method ran at) over prompt + common prefix tells a numerical tie (the two tokens' logits within
`tol`: fp reassociation may flip the argmax) from a bug (the method chose a token the target clearly
ranks lower).

Methods on another weight precision (`weights=` of one method) are audited against the vanilla of
their own precision: losslessness is relative to the target that ran.
"""

from __future__ import annotations

import torch

TIE_TOL = 1e-4


def runner_logits(runner):
    """ids -> the last position's logits from one of our runners (a target at another weight precision)."""

    @torch.inference_mode()
    def logits(ids: list[int]) -> torch.Tensor:
        runner.reset()
        try:
            return runner.forward(torch.tensor(ids), logits_rows=slice(-1, None)).logits[-1]
        finally:
            runner.reset()

    return logits


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    """Index of the first differing token, len of the shorter one if one is a prefix, None if equal."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


@torch.inference_mode()
def logit_gap(model, ids: list[int], a: int | None, b: int | None, tol: float = TIE_TOL) -> dict:
    """Target logits after `ids`: top-2 gap, and the gap between the two tokens that diverged. model: an
    HF causal LM, or a function ids -> the last position's logits."""
    if isinstance(model, torch.nn.Module):
        logits = model(torch.tensor([ids], device=next(model.parameters()).device)).logits[0, -1].float()
    else:
        logits = model(ids).float()
    top = torch.topk(logits, 2)
    (l1, l2), (t1, t2) = top.values.tolist(), top.indices.tolist()
    out = {"top2_tokens": [t1, t2], "top2_logits": [l1, l2], "top2_gap": l1 - l2, "argmax": t1}
    if a is not None and b is not None:
        pair_gap = abs(float(logits[a]) - float(logits[b]))
        out["pair_gap"] = pair_gap
        out["verdict"] = "tie" if pair_gap < tol and {a, b} == {t1, t2} else "bug"
    else:  # one output stopped early without EOS: nothing numerical explains that
        out["verdict"] = "bug"
    return out


def _reference(records: list[dict], reference: str) -> tuple[dict, set]:
    ref, src = {}, set()
    for r in records:
        key = (r["question_id"], r["turn"])
        if r["method"] == reference and key not in ref:
            ref[key] = r["tokens"]
            src.add(id(r))
    return ref, src


def agreement(records: list[dict], reference: str = "vanilla", methods=None) -> dict:
    """{method: {"compared", "identical", "identical_frac", "first_divergence_mean" (over the outputs that
    differ; None if none do), "first_divergence_min"}} against the reference's first repeat."""
    ref, _ = _reference(records, reference)
    pos: dict[str, list] = {m: [] for m in methods or ()}
    for r in records:
        key = (r["question_id"], r["turn"])
        if r["method"] != reference and key in ref and (methods is None or r["method"] in methods):
            pos.setdefault(r["method"], []).append(first_divergence(ref[key], r["tokens"]))
    out = {}
    for m, ps in pos.items():
        div = [p for p in ps if p is not None]
        out[m] = {"compared": len(ps), "identical": len(ps) - len(div),
                  "identical_frac": (len(ps) - len(div)) / len(ps) if ps else None,
                  "first_divergence_mean": sum(div) / len(div) if div else None,
                  "first_divergence_min": min(div) if div else None}
    return out


def audit(records: list[dict], prompts: dict, model, reference: str = "vanilla", tol: float = TIE_TOL,
          exclude=()) -> dict:
    """records: greedy runs (dicts with method, question_id, turn, repeat, tokens); prompts:
    (question_id, turn) -> prompt ids. Compares every run with the reference's first repeat; methods in
    `exclude` only get their agreement measured (result["agreement"])."""
    ref, src = _reference(records, reference)
    checked, mismatches = 0, []
    for r in records:
        key = (r["question_id"], r["turn"])
        if key not in ref or id(r) in src or r["method"] in exclude:
            continue
        checked += 1
        pos = first_divergence(ref[key], r["tokens"])
        if pos is None:
            continue
        a = ref[key][pos] if pos < len(ref[key]) else None
        b = r["tokens"][pos] if pos < len(r["tokens"]) else None
        info = logit_gap(model, list(prompts[key]) + ref[key][:pos], a, b, tol)
        mismatches.append({"method": r["method"], "question_id": r["question_id"], "turn": r["turn"],
                           "repeat": r["repeat"], "position": pos, "reference_token": a, "method_token": b,
                           "reference_len": len(ref[key]), "method_len": len(r["tokens"]), **info})
    bugs = [m for m in mismatches if m["verdict"] == "bug"]
    return {"reference": reference, "checked": checked, "mismatches": mismatches, "ties": len(mismatches) - len(bugs),
            "bugs": len(bugs), "ok": not bugs, "tol": tol, "not_audited": sorted(exclude),
            "agreement": agreement(records, reference, sorted(exclude))}


def audit_groups(records: list[dict], prompts: dict, groups: dict, tol: float = TIE_TOL, exclude=()) -> dict:
    """One audit per weight precision. groups: reference label -> (the labels audited against it, the target
    judging ties: an HF model or ids -> logits); the first group's reference is the main one (e.g. fp32
    `vanilla`). Labels in `exclude` (peers, lossy methods) and those of the other groups get their agreement
    with the main reference reported: for another precision, its token agreement with the main target."""
    refs = list(groups)
    main = refs[0]
    runs, others = [], set()
    for ref, (members, target) in groups.items():
        keep = set(members) | {ref}
        recs = [r for r in records if r["method"] in keep and r["method"] not in exclude]
        runs.append(audit(recs, prompts, target, ref, tol))
        if ref != main:
            others |= keep
    out = dict(runs[0])
    for a, ref in zip(runs[1:], refs[1:]):
        out["checked"] += a["checked"]
        out["mismatches"] = out["mismatches"] + [{**m, "reference": ref} for m in a["mismatches"]]
        out["ties"] += a["ties"]
        out["bugs"] += a["bugs"]
        out["ok"] = out["ok"] and a["ok"]
    out["references"] = {m: ref for ref, (members, _) in groups.items() for m in members if m not in exclude}
    out["not_audited"] = sorted(exclude)
    out["agreement"] = agreement(records, main, sorted(set(exclude) | others))
    return out
