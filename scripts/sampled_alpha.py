"""Exact first-draft acceptance of EAGLE heads on the same target-sampled text (a measurement, no timing).

At every answer position of text the target sampled at T (vanilla decoding, seed = question index), the
head reads the target's feature as at draft depth 1, and this prints, pooled over positions:
- alpha_T = sum_x min(p(x), q(x)) = 1 - TV(p, q): the chance that one token drawn from the head's q is
  accepted against the target's p at temperature T (Leviathan et al.), exactly, not sampled;
- top-1 / top-4: how often the target's argmax is the head's first / among its first 4 (what greedy
  decoding accepts at depth 1 with one / four children).
Every head sees the same text, so their differences carry no sampling noise of the decoding itself.

    python scripts/sampled_alpha.py src/specdec/heads/smollm2-135m-instruct-eagle ~/.cache/specdec/runs/tv-eagle/head \
        --dataset mt_bench --questions 80 --tokens 128
"""

from __future__ import annotations

import argparse

import torch

from specdec.api import from_models
from specdec.bench.data import load_questions
from specdec.heads.io import load_head
from specdec.runtime.loading import load_model
from specdec.sampling import SamplingParams, probs_from_logits


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+", help="head directories")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dataset", default="mt_bench")
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--draft-scales", default="1",
                    help="comma list: the head's logits are divided by T x this (1: tempered like the target)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok, _ = load_model(a.model, "cpu", torch.float32)
    emb, lm = model.get_input_embeddings().weight.float(), model.get_output_embeddings().weight.float()
    dec = from_models(model, tok, "vanilla")
    params = SamplingParams(a.temperature if a.temperature > 0 else 1.0)  # T = 0 text: p only ranks
    texts = []
    for i, q in enumerate(load_questions(a.dataset)[:a.questions]):
        messages = [{"role": "user", "content": q.turns[0]}]
        prompt = dec.encode(messages)
        out = dec.generate(messages, max_new_tokens=a.tokens, temperature=a.temperature, seed=i)
        ids = torch.tensor(prompt + out.token_ids)
        h = model.model(ids[None]).last_hidden_state[0]  # the target's features f_t (after its final norm)
        texts.append((ids, h, len(prompt)))
    print(f"{len(texts)} answers, {sum(len(t[0]) - t[2] for t in texts)} answer tokens, T = {a.temperature}")
    for path in a.heads:
        g = torch.Generator().manual_seed(0)  # the same draws for every head and scale
        head = load_head(path, emb.shape[1], emb.shape[0], target_lm_head=lm).eval()
        scales = [float(x) for x in a.draft_scales.split(",")]
        alpha, alpha2, top1, top4, n = [0.0] * len(scales), [0.0] * len(scales), 0.0, 0.0, 0
        for ids, h, start in texts:
            # row t: f_t and the token x_{t+1} after it -> the head's q for x_{t+2}, against p(. | x_{..t+1})
            pred = head(emb[ids[1:]][None], h[:-1][None])[1][0]
            rows = slice(start - 1, None)  # the head's rows that predict answer tokens x_{start+1..}
            logits, p = head.logits(pred, lm).float()[rows], probs_from_logits(h[1:] @ lm.T, params)[rows]
            for j, s in enumerate(scales if a.temperature > 0 else []):  # T = 0: top-1 only
                q = torch.softmax(logits / (a.temperature * s), -1)
                pd = p if head.d2t is None else p[:, head.d2t]  # q is 0 outside the draft vocabulary
                a1 = torch.minimum(pd, q).sum(-1)
                alpha[j] += a1.sum().item()
                alpha2[j] += (a1 + second_sibling(pd, q, a1, g)).sum().item()
            best = logits.topk(4, -1).indices
            best = best if head.d2t is None else head.d2t[best]
            hit = best == p.argmax(-1, keepdim=True)
            top1 += hit[:, 0].sum().item()
            top4 += hit.any(-1).sum().item()
            n += p.shape[0]
        alphas = "" if a.temperature == 0 else "  ".join(
            f"x{s:g}: alpha_T {x / n:.4f}, 2 siblings {y / n:.4f}" for s, x, y in zip(scales, alpha, alpha2))
        print(f"{path}: {alphas}  top-1 {top1 / n:.4f}  top-4 {top4 / n:.4f}  ({n} positions)")


def second_sibling(p: torch.Tensor, q: torch.Tensor, a1: torch.Tensor, g: torch.Generator, draws: int = 32,
                   chunk: int = 32) -> torch.Tensor:
    """Per row, what a second child drawn from q without the first adds under recursive rejection
    (verify.py): E_{x1~q}[(1 - min(1, p(x1)/q(x1))) * sum_x min(r(x), q(x)/(1 - q(x1)))], r = max(0, p - q)
    / (1 - a1) the residual after x1's rejection (x1 itself has r = 0 there); x1 by `draws` samples.
    p over q's vocabulary (unnormalised: the residual's normaliser 1 - a1 counts the mass outside it)."""
    out = []
    for i in range(0, p.shape[0], chunk):
        pp, qq, aa = p[i:i + chunk], q[i:i + chunk], a1[i:i + chunk]
        x1 = torch.multinomial(qq, draws, replacement=True, generator=g)  # [c, m]
        px, qx = pp.gather(1, x1), qq.gather(1, x1)
        rej = 1 - torch.clamp(px / qx, max=1.0)
        r = torch.clamp(pp - qq, min=0) / (1 - aa).clamp_min(1e-12)[:, None]
        s = torch.minimum(r[:, None, :], qq[:, None, :] / (1 - qx).clamp_min(1e-12)[..., None]).sum(-1)
        out.append((rej * s).mean(-1))
    return torch.cat(out)


if __name__ == "__main__":
    main()
