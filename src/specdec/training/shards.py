"""Training data: datagen's shards on disk (format, atomic writes, a manifest of their sizes and hashes)
and in memory as one token/feature table, the batches of a step, and the reduced draft vocabulary they
imply."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec.errors import SpecdecError
from specdec.files import atomic_file, atomic_write_text

MANIFEST = "manifest.json"
RANK_MANIFESTS = "manifest.rank-*.json"  # one per process of a run across processes


# ---- shards on disk ----

def pack_shard(seqs: list[list[int]], prompt_lens: list[int], feats: list[torch.Tensor] | None,
               dtype: torch.dtype = torch.float16, hidden_size: int = 0, n_aux: int = 0) -> dict[str, torch.Tensor]:
    """feats: per sequence [len, H * (1 + n_aux)] (f_t, then the aux layers' hidden states); None: a shard of
    token ids alone (training computes the features)."""
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    mask = torch.zeros(offsets[-1], dtype=torch.uint8)
    for s, p in enumerate(prompt_lens):
        mask[offsets[s] + p: offsets[s + 1]] = 1
    tokens = {"input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32), "loss_mask": mask,
              "offsets": torch.tensor(offsets, dtype=torch.int64)}
    if feats is None:
        return tokens
    width = hidden_size * (1 + n_aux)
    f = torch.cat(feats).to(dtype) if feats else torch.zeros(0, width, dtype=dtype)
    if not torch.isfinite(f).all():
        raise SpecdecError(f"target features overflow {dtype}: use --feature-dtype float32")
    out = tokens | {"features": f[:, :hidden_size].contiguous() if n_aux else f.contiguous()}
    if n_aux:
        out["aux_features"] = f[:, hidden_size:].contiguous()
    return out


def write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Atomic (a killed run never leaves a half shard under the real name); returns its manifest entry."""
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in meta.items()})
        entry = file_entry(tmp)
    return entry


def list_shards(data_dir: str | os.PathLike) -> list[Path]:
    return sorted(Path(data_dir).glob("shard-*.safetensors"))


def file_entry(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def read_manifest(data_dir: Path) -> dict[str, dict]:
    """manifest.json with the ranks' own manifests of a run across processes over it (not merged yet)."""
    out: dict[str, dict] = {}
    for f in [Path(data_dir) / MANIFEST, *sorted(Path(data_dir).glob(RANK_MANIFESTS))]:
        # a damaged manifest: every shard is checked by its structure instead
        with contextlib.suppress(ValueError, KeyError, OSError):
            out.update(json.loads(f.read_text())["shards"] if f.is_file() else {})
    return out


def write_manifest(data_dir: Path, shards: dict[str, dict], rank: int | None = None) -> None:
    """manifest.json, or with `rank` that process's own (ranks never write one file together)."""
    name = MANIFEST if rank is None else RANK_MANIFESTS.replace("*", f"{rank:05d}")
    atomic_write_text(Path(data_dir) / name, json.dumps({"shards": dict(sorted(shards.items()))}, indent=1))


def merge_manifests(data_dir: Path) -> int:
    """Fold the ranks' manifests into manifest.json (then removed); returns the shards it lists."""
    data_dir = Path(data_dir)
    ranks = sorted(data_dir.glob(RANK_MANIFESTS))
    merged = read_manifest(data_dir)
    if ranks:
        write_manifest(data_dir, merged)
        for f in ranks:
            f.unlink(missing_ok=True)
    return len(merged)


def shard_problem(path: Path, entry: dict | None) -> str | None:
    """Why a shard on disk cannot be trusted (None: it is sound). With a manifest entry: its size and
    sha256; without one (written before the manifest was, or by an older datagen): the safetensors
    header must account for every byte of the file."""
    if not path.is_file():
        return "the file is missing"
    size = path.stat().st_size
    if entry is not None:
        if size != entry["bytes"]:
            return f"it has {size} bytes, the manifest says {entry['bytes']}"
        return None if file_entry(path)["sha256"] == entry["sha256"] else "its sha256 is not the manifest's"
    try:
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, MemoryError, OverflowError):
        return "its header is unreadable"
    return None if size == 8 + n + end else f"it has {size} bytes, its header says {8 + n + end}"


def resume_shards(out: Path, n_shards: int, say=print, rank: int = 0, world: int = 1) -> tuple[list[int], dict]:
    """The shards still to make and the manifest: a shard that is missing, or whose size or sha256 is
    not the manifest's (e.g. truncated by a full disk), is made again. Across `world` processes, process
    `rank` owns shards i with i % world == rank and its manifest lists only those."""
    known, todo, manifest, changed = read_manifest(out), [], {}, False
    for i in range(rank, n_shards, world):
        name = f"shard-{i:05d}.safetensors"
        if name not in known and not (out / name).exists():
            todo.append(i)
            continue
        why = shard_problem(out / name, known.get(name))
        if why is None:
            manifest[name] = known.get(name) or file_entry(out / name)  # unlisted: written just before a kill
            changed |= name not in known
        else:
            say(f"datagen: {out / name} is damaged or missing ({why}): making it again")
            (out / name).unlink(missing_ok=True)
            todo.append(i)
            changed = True
    if world == 1:
        manifest = {**known, **manifest}
        for i in todo:
            manifest.pop(f"shard-{i:05d}.safetensors", None)
    if changed:
        write_manifest(out, manifest, rank if world > 1 else None)
    return todo, manifest


# ---- shards in memory ----

class ShardData:
    """The shards' tokens and loss masks in memory; their features (fp16: ~1.2 KB per token at H = 576,
    four times that with EAGLE-3's aux layers) memory-mapped and read per batch, so each process of a run
    across processes reads only the rows it trains on and processes on one machine share the page cache.
    A shard of token ids alone (datagen --tokens-only) gets its batches' features from `features`, the
    target's forwards (training.features): online."""

    def __init__(self, data: str | os.PathLike, names: list[str] | None = None, max_len: int = 1024,
                 aux: bool = False, features=None) -> None:
        """data: one datagen dir or several, comma-separated; names: the exact shard files of a run
        being resumed (datagen may have added shards since); aux: also the hidden states of the target
        layers datagen's --aux-layers names (EAGLE-3's inputs): `aux_layers`, and batches carry them;
        features: sequences -> their features [len, H * (1 + aux layers)], for shards that hold none."""
        dirs = [Path(d.strip()).expanduser() for d in str(data).split(",") if d.strip()]
        missing = [str(d) for d in dirs if not d.is_dir()]
        if names is None and missing:  # e.g. a "~" the shell left unexpanded after a comma
            raise SpecdecError(f"data directory not found: {', '.join(missing)}")
        if names is not None:
            files = [Path(n) for n in names]
        else:
            files = [f.resolve() for d in dirs for f in list_shards(d)]
        if not files:
            raise SpecdecError(f"no data shards (shard-*.safetensors) in {data}: run `specdec datagen` first")
        self.names = [str(f) for f in files]
        self.metas = [json.loads((d / "meta.json").read_text()) for d in dirs if (d / "meta.json").is_file()]
        self.aux_layers: tuple[int, ...] = aux_layers_of(data) if aux else ()
        ids, masks, first = [], [], []
        # per trained sequence: its global rows (a, b) and where its features are (shard, first local row)
        self.spans: list[tuple[int, int]] = []
        self._where: list[tuple[int, int]] = []
        self._feats, self._aux = [], []  # per shard: lazy slices of the mapped file
        base, self.n_sequences = 0, 0
        for s, f in enumerate(files):
            if not f.is_file():
                raise SpecdecError(f"data shard {f} is missing (it was there when this run started)")
            try:
                h = safe_open(str(f), framework="pt")
                off, m = h.get_tensor("offsets").tolist(), h.get_tensor("loss_mask")
                ids.append(h.get_tensor("input_ids").long())
                stored = "features" in set(h.keys())
                self._feats.append(h.get_slice("features") if stored else None)
            except Exception as e:
                raise SpecdecError(f"cannot read data shard {f}: {e}") from None
            if not stored:
                if features is None:
                    raise SpecdecError(f"data shard {f} holds token ids only (datagen --tokens-only): its features "
                                       "come from the target, which this caller does not give")
                if aux:
                    self._aux.append(None)
            elif aux:
                if "aux_features" not in set(h.keys()):
                    raise SpecdecError(f"data shard {f} holds no aux_features: re-run datagen with --aux-layers eagle3")
                self._aux.append(h.get_slice("aux_features"))
            for a, b in zip(off[:-1], off[1:]):
                self.n_sequences += 1
                starts = m[a:b].nonzero()
                if len(starts):
                    first.append(int(starts[0]))
                # a row is trained when its input token (row + 1) is an answer token inside max_len:
                # a sequence without one would only add zero-loss rows to a batch
                if m[a + 1: min(b, a + max_len)].any():
                    self.spans.append((base + a, base + min(b, a + max_len)))
                    self._where.append((s, a))
            masks.append(m)
            base += off[-1]
        self.ids, self.mask = torch.cat(ids), torch.cat(masks)
        self.dropped = self.n_sequences - len(self.spans)  # sequences with nothing to train on
        self.first_answer = min(first) if first else None  # the earliest answer token's position
        self.features = features
        widths = {sl.get_shape()[1] for sl in self._feats if sl is not None} | \
            {m["hidden_size"] for m in self.metas if m.get("features") is False}
        if len(widths) != 1:
            raise SpecdecError(f"the shards in {data} hold features of different sizes {sorted(widths)}: "
                               "train on data made with one target" if widths else
                               f"the shards in {data} hold token ids only and no meta.json says the target's size")
        self.hidden_size = widths.pop()
        self.aux_width = len(self.aux_layers) * self.hidden_size
        if aux and any(sl is not None and sl.get_shape()[1] != self.aux_width for sl in self._aux):
            raise SpecdecError(f"the aux_features in {data} are {self.aux_width} wide, not {len(self.aux_layers)} "
                               f"layers x {self.hidden_size}: re-run datagen with --aux-layers eagle3")

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def n_tokens(self) -> int:
        return sum(b - a for a, b in self.spans)

    def token_counts(self, vocab: int) -> torch.Tensor:
        """How often each token is an answer token (what the head must predict)."""
        m = self.mask.bool()
        return torch.bincount(self.ids[m], minlength=vocab)[:vocab]

    def batch(self, seq_idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded (ids [b, T], features fp32 [b, T, H] (with aux: [b, T, H + k H], the aux states
        after f_t), loss mask [b, T] fp32; pads have mask 0)."""
        lens = [self.spans[i][1] - self.spans[i][0] for i in seq_idx]
        t = max(lens)
        h = self.hidden_size
        ids = torch.zeros(len(seq_idx), t, dtype=torch.long)
        feats = torch.zeros(len(seq_idx), t, h + self.aux_width)
        mask = torch.zeros(len(seq_idx), t)
        online = [i for i in seq_idx if self._feats[self._where[i][0]] is None]
        # a prefix's features are those of the whole sequence's first rows (causal): the cut span is enough
        computed = dict(zip(online, self.features([self.ids[slice(*self.spans[i])].tolist() for i in online])
                            if online else []))
        for r, i in enumerate(seq_idx):
            (a, b), (s, la) = self.spans[i], self._where[i]
            ids[r, : b - a] = self.ids[a:b]
            if i in computed:
                feats[r, : b - a] = computed[i][:, : h + self.aux_width]
            else:
                feats[r, : b - a, :h] = self._feats[s][la: la + b - a].float()
                if self.aux_width:
                    feats[r, : b - a, h:] = self._aux[s][la: la + b - a].float()
            mask[r, : b - a] = self.mask[a:b].float()
        return ids, feats, mask


def aux_layers_of(data: str | os.PathLike) -> tuple[int, ...]:
    """The aux layers the meta.json of every datagen dir in `data` (comma-separated) names; they must agree."""
    found = set()
    for d in (Path(x.strip()).expanduser() for x in str(data).split(",") if x.strip()):
        meta = d / "meta.json"
        layers = json.loads(meta.read_text()).get("aux_layers") if meta.is_file() else None
        if not layers:
            raise SpecdecError(f"{d} holds no aux-layer hidden states: re-run datagen with --aux-layers eagle3")
        found.add(tuple(layers))
    if len(found) != 1:
        raise SpecdecError(f"the data dirs in {data} hold different aux layers ({sorted(found)}): use one datagen "
                           "--aux-layers for all")
    return found.pop()


def tokens_only(data: str | os.PathLike) -> bool:
    """Whether a datagen dir in `data` (comma-separated) holds token ids alone (datagen --tokens-only)."""
    metas = [Path(x.strip()).expanduser() / "meta.json" for x in str(data).split(",") if x.strip()]
    return any(m.is_file() and json.loads(m.read_text()).get("features") is False for m in metas)


def global_batch(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Sequence indices of global step `step`: epoch-wise permutations, a pure function of the step."""
    per_epoch = max(1, n // batch_size)
    epoch, pos = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[pos * batch_size:(pos + 1) * batch_size].tolist()

