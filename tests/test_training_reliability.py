"""Training tools fail early and clearly, resume soundly, and write files like every other file."""

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from specdec.errors import SpecdecError
from specdec.training import datagen, datagen_cli, train_cli
from specdec.training.datagen import Plan, run_datagen
from specdec.training.train import TrainConfig, train_eagle
from tests.helpers import make_head, tiny_model, word_tokenizer

WORDS = ["user", "bot", "end", "what", "is", "two", "plus", "three", "four", "five", "six", "seven", "zebra", "the",
         "answer"]
GSM = [{"question": f"what is {a} plus {b}", "answer": f"{a} plus {b} is the answer #### {c}"}
       for a, b, c in [("two", "three", "five"), ("three", "four", "seven"), ("two", "four", "six"),
                       ("four", "two", "six")]]
BENCH_Q = "what is zebra plus zebra"  # a "benchmark" question hidden among the GSM8K rows


def chat_tokenizer():
    tok = word_tokenizer(WORDS)
    tok.chat_template = ("{% for m in messages %}user {{ m['content'] }} end {% endfor %}"
                         "{% if add_generation_prompt %}bot {% endif %}")
    return tok


@pytest.fixture(scope="module")
def chat():
    tok = chat_tokenizer()
    return tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id), tok


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOLD = Plan(shard_size=4, sources=["gsm8k-gold"], temperatures=[0.0])  # teacher forcing only: fast


def parser():
    ap = argparse.ArgumentParser(prog="specdec")
    sub = ap.add_subparsers(dest="command", required=True)
    datagen_cli.add_parser(sub)
    train_cli.add_parser(sub)
    return ap


# ---- arguments: one line, exit 2, before any model loads ----

@pytest.mark.parametrize("argv,flag", [
    (["datagen", "--out", "o", "--shards", "2", "--temperatures", "abc"], "--temperatures"),
    (["datagen", "--out", "o", "--shards", "2", "--temperatures", "0,-1"], "--temperatures"),
    (["datagen", "--out", "o", "--shards", "-1"], "--shards"),
    (["datagen", "--out", "o", "--shards", "2", "--shard-size", "0"], "--shard-size"),
    (["datagen", "--out", "o", "--shards", "2", "--batch-size", "x"], "--batch-size"),
    (["datagen", "--out", "o", "--shards", "2", "--top-p", "0"], "--top-p"),
    (["datagen", "--out", "o", "--shards", "2", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["datagen", "--out", "o", "--shards", "2", "--sources", "gsm8k,bogus"], "--sources"),
    (["datagen", "--out", "o", "--shards", "2", "--aux-layers", "2,x"], "--aux-layers"),
    (["datagen", "--out", "o", "--shards", "2", "--aux-layers", "3,3"], "--aux-layers"),
    (["datagen", "--shards", "2"], "--out"),
    (["train", "eagle", "--data", "d", "--out", "o", "--batch-size", "0"], "--batch-size"),
    (["train", "eagle", "--data", "d", "--out", "o", "--epochs", "0"], "--epochs"),
    (["train", "eagle", "--data", "d", "--out", "o", "--max-len", "1"], "--max-len"),
    (["train", "eagle", "--data", "d", "--out", "o", "--lr", "nan"], "--lr"),
    (["train", "eagle", "--data", "d", "--out", "o", "--steps", "-3"], "--steps"),
    (["train", "eagle", "--data", "d", "--out", "o", "--save-every", "0"], "--save-every"),
    (["train", "eagle", "--data", "d", "--out", "o", "--schedule", "cubic"], "--schedule"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, flag, capsys, monkeypatch):
    monkeypatch.setattr(datagen_cli, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("specdec: error:") and err.count("\n") == 1, err
    assert flag in err and "Traceback" not in err


def test_api_callers_get_the_same_rules():
    with pytest.raises(SpecdecError, match="--temperatures must be a finite number >= 0, got .-1"):
        Plan(temperatures=[0.0, -1.0]).check()
    with pytest.raises(SpecdecError, match="--shard-size"):
        Plan(shard_size=0).check()
    with pytest.raises(SpecdecError, match="--max-len must be an integer >= 2"):
        TrainConfig(data="d", out="o", max_len=1).check()
    with pytest.raises(SpecdecError, match="--batch-size"):
        TrainConfig(data="d", out="o", batch_size=2.5).check()
    TrainConfig(data="d", out="o", lr=0.0).check()


def test_datagen_checks_its_files_before_loading_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr(datagen_cli, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    args = parser().parse_args(["datagen", "--out", str(tmp_path / "d"), "--shards", "1",
                                "--gsm8k", str(tmp_path / "nope.jsonl")])
    with pytest.raises(SpecdecError, match="GSM8K train file not found at .*nope.jsonl"):
        args.func(args)
    assert not (tmp_path / "d").exists()


# ---- datagen: a failed run locks nothing; resume checks every shard; $SPECDEC_DATA ----

def test_failed_datagen_writes_nothing_and_a_stale_meta_does_not_lock(chat, tmp_path):
    model, tok = chat
    gsm, out = write_jsonl(tmp_path / "train.jsonl", GSM), tmp_path / "d"
    with pytest.raises(SpecdecError, match="GSM8K train file not found"):
        run_datagen(model, tok, out, 1, GOLD, gsm8k=tmp_path / "missing.jsonl", progress=False)
    with pytest.raises(SpecdecError, match="--shard-size"):
        run_datagen(model, tok, out, 1, Plan(shard_size=0, sources=["gsm8k-gold"]), gsm8k=gsm, progress=False)
    assert not out.exists()
    # a directory holding the metadata of a run that made no shard (e.g. an older datagen that failed)
    out.mkdir()
    (out / "meta.json").write_text(json.dumps({"target": {"x": 1}, "plan": {"shard_size": 99}}))
    assert run_datagen(model, tok, out, 1, GOLD, gsm8k=gsm, progress=False)["shards"] == 1
    assert json.loads((out / "meta.json").read_text())["plan"]["shard_size"] == 4
    # once it holds data, it is locked
    with pytest.raises(SpecdecError, match="different target, plan or --tokens-only"):
        run_datagen(model, tok, out, 1, Plan(shard_size=2, sources=["gsm8k-gold"]), gsm8k=gsm, progress=False)


def _tensors(path):
    from safetensors.torch import load_file

    return {k: v.clone() for k, v in load_file(str(path)).items()}  # a copy: the file is rewritten in place


def test_datagen_resume_redoes_a_truncated_or_changed_shard(chat, tmp_path, capsys):
    from specdec.training.shards import file_entry

    model, tok = chat
    gsm, out = write_jsonl(tmp_path / "train.jsonl", GSM), tmp_path / "d"
    run_datagen(model, tok, out, 3, GOLD, gsm8k=gsm, progress=False)
    names = [f"shard-{i:05d}.safetensors" for i in range(3)]
    manifest = json.loads((out / "manifest.json").read_text())["shards"]
    assert sorted(manifest) == names
    assert all(manifest[n] == file_entry(out / n) for n in names)
    good = [_tensors(out / n) for n in names]
    data = (out / names[1]).read_bytes()
    (out / names[1]).write_bytes(data[: len(data) // 2])  # a full disk or a kill mid-copy
    flipped = bytearray((out / names[2]).read_bytes())
    flipped[-1] ^= 0xFF  # same size, other bytes
    (out / names[2]).write_bytes(bytes(flipped))
    before = (out / names[0]).stat().st_mtime_ns
    capsys.readouterr()
    assert run_datagen(model, tok, out, 3, GOLD, gsm8k=gsm, progress=False)["shards"] == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and names[1] in err[0] and "bytes" in err[0] and names[2] in err[1] and "sha256" in err[1]
    assert (out / names[0]).stat().st_mtime_ns == before
    for n, g in zip(names, good):
        t = _tensors(out / n)
        assert all(torch.equal(t[k], g[k]) for k in g), n
    # a shard the manifest does not know (older datagen, or a kill before the manifest was written)
    # is checked against its own header
    (out / "manifest.json").unlink()
    data = (out / names[1]).read_bytes()
    (out / names[1]).write_bytes(data[:-10])
    assert run_datagen(model, tok, out, 3, GOLD, gsm8k=gsm, progress=False)["shards"] == 1
    assert "its header says" in capsys.readouterr().err
    assert sorted(json.loads((out / "manifest.json").read_text())["shards"]) == names


@pytest.mark.slow
def test_datagen_finds_its_data_like_the_rest_of_the_package(chat, tmp_path, monkeypatch):
    """$SPECDEC_DATA first, then the package's own copy: the GSM8K file wherever it is found first, and
    benchmark prompts from every root and --exclude-dir (a copy in any of them is excluded)."""
    from specdec.files import packaged_data_dir

    model, tok = chat
    env, other = tmp_path / "env", tmp_path / "other"
    lines = (packaged_data_dir() / "spec_bench" / "question.jsonl").read_text().splitlines()
    shipped = json.loads(lines[100])["turns"][0]  # a benchmark question only the package holds
    write_jsonl(env / "gsm8k" / "train.jsonl", GSM + [{"question": shipped, "answer": "zebra #### two"},
                                                    {"question": BENCH_Q, "answer": "zebra #### four"}])
    write_jsonl(other / "mt_bench" / "question.jsonl", [{"turns": [BENCH_Q]}])
    monkeypatch.setenv("SPECDEC_DATA", str(env))
    monkeypatch.chdir(tmp_path)
    run_datagen(model, tok, tmp_path / "a", 1, Plan(shard_size=6, sources=["gsm8k-gold"]), exclude_dir=other,
                progress=False)
    ids = _tensors(tmp_path / "a" / "shard-00000.safetensors")["input_ids"]
    assert tok.convert_tokens_to_ids("plus") in ids.tolist()  # the GSM8K rows from $SPECDEC_DATA
    assert tok.convert_tokens_to_ids("zebra") not in ids.tolist()  # neither benchmark question is
    # the package's GSM8K train file when $SPECDEC_DATA has none
    (env / "gsm8k" / "train.jsonl").unlink()
    assert run_datagen(model, tok, tmp_path / "b", 1, GOLD, progress=False)["shards"] == 1


# ---- files get the umask's mode ----

def test_atomic_writes_follow_the_umask(tiny, tmp_path):
    from specdec.files import atomic_write_text
    from specdec.heads.io import save_head
    from specdec.training.datagen import pack_shard, write_shard

    head = make_head(tiny)
    old = os.umask(0o022)
    try:
        for mask in (0o022, 0o077):
            os.umask(mask)
            d = tmp_path / f"u{mask:o}"
            save_head(head, d / "head")
            write_shard(d / "shard.safetensors", pack_shard([[1, 2, 3]], [1], [torch.zeros(3, 64)]), {})
            atomic_write_text(d / "meta.json", "{}")
            files = [d / "head" / "model.safetensors", d / "head" / "config.json", d / "shard.safetensors",
                     d / "meta.json"]
            assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(0o666 & ~mask)
                                                                               for f in files}
            assert oct((d / "head").stat().st_mode & 0o777) == oct(0o777 & ~mask)
    finally:
        os.umask(old)


# ---- train eagle: no supervised token, and re-running a finished run ----

def test_max_len_that_cuts_every_answer_is_refused_before_training(tiny, tiny_data, tmp_path, capsys):
    from specdec.training.shards import ShardData

    out = tmp_path / "run"
    with pytest.raises(SpecdecError, match=r"--max-len 2 leaves no answer token in any of the 96 sequences "
                                           r"\(the earliest answer starts at token 3\): raise --max-len"):
        train_eagle(TrainConfig(data=str(tiny_data), out=str(out), steps=2, max_len=2), tiny, progress=False)
    assert not out.exists()
    part = ShardData(str(tiny_data), max_len=6)  # prompts of 3..11 tokens: most answers start later
    assert 2 * part.dropped > part.n_sequences > part.dropped > 0
    capsys.readouterr()
    r = train_eagle(TrainConfig(data=str(tiny_data), out=str(out), steps=1, batch_size=4, max_len=6), tiny,
                    progress=False)
    err = capsys.readouterr().err.splitlines()
    warn = [ln for ln in err if "warning" in ln]
    assert len(warn) == 1 and f"{part.dropped} of the 96 sequences" in warn[0] and "--max-len 6" in warn[0]
    assert r["history"][0]["loss"] > 0
    capsys.readouterr()
    train_eagle(TrainConfig(data=str(tiny_data), out=str(tmp_path / "full"), steps=1, batch_size=4), tiny,
                progress=False)
    assert "warning" not in capsys.readouterr().err


def test_rerunning_a_finished_run_says_so_and_does_nothing(tiny, tiny_data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    kw = dict(data=str(tiny_data), out=str(out), steps=2, batch_size=4, warmup=1, log_every=1)
    train_eagle(TrainConfig(**kw), tiny, progress=False)
    files = [p for p in out.rglob("*") if p.is_file()]
    stamps = {p: p.stat().st_mtime_ns for p in files}
    monkeypatch.setattr(train_cli, "materialize", lambda *a, **k: pytest.fail("the target was loaded"))
    args = parser().parse_args(["train", "eagle", "--data", str(tiny_data), "--out", str(out), "--steps", "2",
                                "--batch-size", "4", "--warmup", "1", "--log-every", "1"])
    capsys.readouterr()
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and "already finished" in printed and str(out / "head") in printed
    assert "nan" not in printed
    again = train_eagle(TrainConfig(**kw), tiny, progress=False)  # through the API: the same, and the head
    assert again["finished"] and again["steps"] == 2 and again["head"] is not None
    assert sorted(p for p in out.rglob("*") if p.is_file()) == sorted(files)
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    # other settings are still refused, not reported as finished
    with pytest.raises(SpecdecError, match="lr="):
        train_eagle(TrainConfig(**(kw | {"lr": 1.0})), tiny, progress=False)


# ---- datagen's --out must be writable; a warmup as long as the run is cut ----

@pytest.mark.parametrize("out", ["/proc/specdec-test/out", "{tmp}/a-file/out"])
def test_datagen_refuses_an_unwritable_out_before_loading_the_model(out, tmp_path, monkeypatch, capsys):
    from specdec.cli import main

    monkeypatch.setattr(datagen_cli, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    (tmp_path / "a-file").write_text("x")
    out = out.format(tmp=tmp_path)
    assert main(["datagen", "--out", out, "--shards", "1", "--sources", "self"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specdec: error: --out {out} is not a writable directory") and err.count("\n") == 1, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_datagen_refuses_a_read_only_out(tmp_path, monkeypatch):
    monkeypatch.setattr(datagen_cli, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    args = parser().parse_args(["datagen", "--out", str(ro / "d"), "--shards", "1", "--sources", "self"])
    with pytest.raises(SpecdecError, match="--out .* is not a writable directory"):
        args.func(args)


def test_the_writability_check_leaves_no_directory_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(datagen_cli, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    datagen.check_writable(tmp_path / "new" / "deeper")
    assert list(tmp_path.iterdir()) == []


def test_a_warmup_as_long_as_the_run_is_cut_with_a_note(tiny, tiny_data, tmp_path, capsys):
    cfg = TrainConfig(data=str(tiny_data), out=str(tmp_path / "run"), steps=3, batch_size=4, lr=1e-2, warmup=100,
                      save_every=1000, log_every=1)
    r = train_eagle(cfg, tiny, progress=False)
    err = capsys.readouterr().err
    assert "--warmup 100 is not shorter than the run's 3 steps" in err and err.count("--warmup") == 1
    lrs = [h["lr"] for h in r["history"]]
    assert lrs[0] > 0.5e-2 and lrs == sorted(lrs, reverse=True)  # near --lr from the start, then decaying


# ---- docs/training.md's toy run: its exact commands, with a tiny model as M ----

def toy_run_commands() -> tuple[dict[str, str], list[list[str]]]:
    """The variables and the `specdec` commands of the code block after the "toy-run" marker."""
    import re
    import shlex

    doc = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    block = re.search(r"<!-- toy-run:.*?-->\s*```bash\n(.*?)```", doc, re.S).group(1)
    vars_, cmds = {}, []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 1 and re.fullmatch(r"\w+=.*", words[0]):
            k, v = words[0].split("=", 1)
            vars_[k] = v
        elif words:
            cmds.append(words)
    return vars_, cmds


def test_the_toy_run_in_the_docs_runs_as_written(tmp_path, monkeypatch, capsys):
    from specdec.cli import main

    variables, cmds = toy_run_commands()
    assert variables == {"M": "smollm2"} and [c[:2] for c in cmds] == [
        ["specdec", "datagen"], ["specdec", "train"], ["specdec", "tune"], ["specdec", "generate"]]
    # the same commands on a tiny model that knows the words of a few GSM8K-like rows
    words = ["what", "is", "two", "three", "four", "five", "six", "seven", "plus", "answer", "the", "12", "30", "?",
             "42"]
    tok = chat_tokenizer_of(words)
    model = tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    write_jsonl(tmp_path / "data" / "gsm8k" / "train.jsonl", GSM * 3)
    monkeypatch.setenv("SPECDEC_DATA", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    for cmd in cmds:
        argv = [w.replace("$M", str(tmp_path / "tiny")) for w in cmd[1:]]
        assert main(argv) == 0, (argv, capsys.readouterr().err)
    head = tmp_path / "toy" / "run" / "head"
    assert (head / "config.json").is_file() and (head / "tuning.json").is_file()
    assert (tmp_path / "toy" / "data" / "shard-00000.safetensors").is_file()
    assert "tau" in capsys.readouterr().err  # generate's statistics line


def chat_tokenizer_of(words):
    tok = word_tokenizer(words)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}answer {% endif %}")
    return tok
