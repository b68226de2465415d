"""Bad input through the real CLI: exit code 2, one line naming the parameter, no
traceback, and no model loaded (everything is checked first)."""

import re
import signal
from pathlib import Path

import pytest

import specdec.api
from specdec.cli import main
from specdec.errors import SpecdecError
from tests.helpers import cli_fed, tiny_model, word_tokenizer


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr(specdec.api, "load_model", refuse)


@pytest.mark.parametrize("argv, names", [
    (["--method", "eagle2", "--opt", "depth=abc"], "depth"),
    (["--method", "eagle2", "--opt", "depth=1.5"], "depth"),
    (["--method", "eagle2", "--opt", "topk=1.5"], "topk"),
    (["--method", "eagle2", "--tree-topk", "0"], "topk"),
    (["--method", "sps", "--draft", "smollm2", "--gamma", "0"], "gamma"),
    (["--method", "pld", "--opt", "num_tokens=-1"], "num_tokens"),
    (["--method", "pld", "--opt", "nonsense=1"], "nonsense"),
    (["--method", "eagle", "--opt", "choices=[[0],[2,0]]"], "choices"),
    (["--threads", "-1"], "threads"),
    (["--threads", "999"], "threads"),
    (["--device", "foo"], "device"),
    (["--backend", "fast"], "backend"),
    (["--seed", "99999999999999999999999"], "seed"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "-1"], "temperature"),
    (["--top-k", "1.5"], "top_k"),
    (["--top-p", "0"], "top_p"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--max-new-tokens", "5.5"], "max_new_tokens"),
    (["--stop", ""], "stop"),
    (["--method", "telepathy"], "auto"),  # the list of methods names auto too
])
def test_generate_rejects_in_one_line_before_loading(argv, names, no_load, capsys):
    assert main(["generate", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error:") and err.count("\n") == 1, err
    assert names in err and "Traceback" not in err


@pytest.mark.parametrize("prompt, raw", [("", False), ("   ", True), ("caf\udce9", True), ("\udcff\udcfe", False)])
def test_empty_or_undecodable_prompts_are_refused(prompt, raw, no_load, capsys):
    assert main(["generate", prompt, *(["--raw"] if raw else [])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prompt" in err and "Traceback" not in err


def test_a_tiny_temperature_is_valid_and_greedy(tmp_path, capsys):
    tok = word_tokenizer([f"w{i}" for i in range(5)])
    tiny_model("llama", vocab_size=7).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    base = ["generate", "w1 w2", "--raw", "--model", str(tmp_path), "--max-new-tokens", "6", "--method", "pld"]
    assert main(base) == 0
    greedy = capsys.readouterr().out
    assert main([*base, "--temperature", "1e-45", "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy


def _tiny_dir(tmp_path):
    tok = word_tokenizer([f"w{i}" for i in range(5)])
    tiny_model("llama", vocab_size=7).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return str(tmp_path)


def _cli(args, **kw):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "specdec.cli", "generate", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def subprocess_devnull():
    import subprocess

    return subprocess.DEVNULL


def _generate_fed(argv, stdin, monkeypatch, capsys):
    return cli_fed(["generate", *argv], stdin, monkeypatch, capsys)


def test_a_piped_prompt_is_the_prompt_and_dash_reads_stdin(tmp_path, monkeypatch, capsys):
    model = _tiny_dir(tmp_path)
    base = ["--raw", "--model", model, "--max-new-tokens", "6", "--method", "pld"]
    run = lambda argv, stdin: _generate_fed(argv, stdin, monkeypatch, capsys)
    want = run(["w1 w2 w3", *base], None)
    assert want[0] == 0, want[2]
    piped, dash = run(base, "w1 w2 w3"), run(["-", *base], "w1 w2 w3")
    assert piped[0] == dash[0] == 0 and piped[1] == dash[1] == want[1]
    default = run(base, None)  # nothing piped: the demo prompt, and it says so
    assert default[0] == 0 and "no prompt given" in default[2]
    code, _, err = run(["-", *base], "  \n")
    assert code == 2 and err.count("\n") == 1 and "stdin gave no text" in err


@pytest.mark.slow
def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path):
    """`specdec generate ... | head -1`: no BrokenPipeError traceback."""
    import subprocess
    import sys

    model = _tiny_dir(tmp_path)
    p = subprocess.Popen([sys.executable, "-m", "specdec.cli", "generate", "w1 w2", "--raw", "--model", model,
                          "--max-new-tokens", "300", "--method", "vanilla"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first token (loading takes longer than this)
    _, err = p.communicate(timeout=300)
    assert b"Traceback" not in err and b"BrokenPipe" not in err
    assert p.returncode == 141


def test_json_output_is_one_object_with_the_text_ids_and_stats(tmp_path, capsys):
    import json

    model = _tiny_dir(tmp_path)
    base = ["generate", "w1 w2 w3", "--raw", "--model", model, "--max-new-tokens", "7", "--method", "pld"]
    assert main(base) == 0
    streamed = capsys.readouterr().out
    assert main([*base, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one line: a JSON object and nothing else
    rec = json.loads(out)
    assert streamed == rec["text"] + "\n"  # the same answer (streamed text ends its line)
    assert len(rec["token_ids"]) == rec["stats"]["new_tokens"] == 7
    assert rec["stats"]["tau"] >= 1.0 and rec["stats"]["target_forwards"] >= 1 and rec["finish_reason"] == "length"


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("specdec ")


def test_datagen_without_gsm8k_suggests_self_prompts(tmp_path):
    from specdec.training.datagen import Plan, check_run

    with pytest.raises(SpecdecError, match="--sources self"):
        check_run(tmp_path / "o", 1, Plan(sources=["gsm8k"]), 4, tmp_path / "missing.jsonl", None, "float16")


def _busy_process():
    import subprocess
    import sys
    import time

    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.3)  # running at full speed
    return p


@pytest.mark.slow
def test_threads_follow_the_cpus_another_process_leaves_free(tmp_path, monkeypatch, capsys):
    """Beside a busy process the default thread count drops to the free CPUs, and says so; an explicit
    --threads stays as given."""
    from specdec.runtime.cpus import free_cpus, usable_cpus
    from specdec.runtime.loading import Runtime

    n = usable_cpus()
    if n < 2:
        pytest.skip("needs two usable CPUs")
    torch_threads = __import__("torch").get_num_threads()
    __import__("torch").set_num_threads(n)  # all of them, so that leaving one out shows
    p = _busy_process()
    try:
        assert free_cpus() <= n - 1  # fewer still where other processes than ours keep CPUs busy
        note = Runtime().apply()
        assert __import__("torch").get_num_threads() <= n - 1 and "another process" in note
        model = _tiny_dir(tmp_path)
        code, _, err = _generate_fed(["w1 w2", "--raw", "--model", model, "--max-new-tokens", "40", "--method",
                                      "vanilla"], None, monkeypatch, capsys)
        assert code == 0 and re.search(rf"another process is keeping \d+ of {n} CPUs", err)
    finally:
        p.kill()
        __import__("torch").set_num_threads(torch_threads)
    assert Runtime(threads=1).apply() is None and __import__("torch").get_num_threads() == 1
    __import__("torch").set_num_threads(torch_threads)


def test_the_stats_line_says_when_another_load_disturbed_the_answer(tmp_path, monkeypatch, capsys):
    import specdec.cli

    model = _tiny_dir(tmp_path)
    argv = ["generate", "w1 w2", "--raw", "--model", model, "--max-new-tokens", "6", "--method", "vanilla",
            "--threads", "1"]
    monkeypatch.setattr(specdec.cli.ContentionMeter, "result", lambda self: {"other_cpu_frac": 0.1})
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "other processes used" not in err
    # which kernels the target ran on: the streaming kernel, or a fallback that is slower for the same tokens
    assert re.search(r"\[vanilla, fp32 weights, (stream\+fused|stream|onednn|torch)(\+gemv)? kernels\]", err)
    monkeypatch.setattr(specdec.cli.ContentionMeter, "result", lambda self: {"other_cpu_frac": 0.6})
    assert main(argv) == 0
    assert "other processes used 60% of the CPUs" in capsys.readouterr().err.splitlines()[-1]


def _sigint_held_back(pid: int) -> bool:
    """Whether the process's main thread blocks SIGINT (the CLI does while torch imports)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return bool(int(re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.M).group(1), 16) >> (signal.SIGINT - 1) & 1)


def _maps(pid: int, path: Path) -> bool:
    return str(path) in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="watches the process through /proc")
@pytest.mark.parametrize("phase", ["importing torch", pytest.param("loading the model", marks=pytest.mark.slow)])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(phase):
    """The interrupt is sent once the process is seen in that phase (through /proc, not after a guessed
    delay: on a busy or pinned machine start-up takes many times longer)."""
    import subprocess
    import sys
    import time

    from specdec.runtime.loading import resolve

    gguf = resolve("smollm2").resolve()
    reached = {"importing torch": _sigint_held_back, "loading the model": lambda pid: _maps(pid, gguf)}[phase]
    # SIGINT handled as in a shell's foreground job, even where the suite runs with it ignored (a background
    # job of a non-interactive shell: its children inherit the ignoring through exec)
    p = subprocess.Popen([sys.executable, "-m", "specdec.cli", "generate", "hi", "--threads", "1"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        end = time.monotonic() + 300
        while not reached(p.pid):
            if p.poll() is not None or time.monotonic() > end:
                p.kill()
                pytest.fail(f"never seen {phase}: {p.communicate()}")
            time.sleep(0.005)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()  # gone already, unless it ignored the signal: then it must not decode on beside later tests
        p.wait()
    assert (p.returncode, err, out) == (130, "specdec: interrupted\n", "")


@pytest.mark.slow
def test_quiet_prints_nothing_on_stderr_and_the_default_only_our_lines(tmp_path, monkeypatch, capsys):
    model = _tiny_dir(tmp_path)
    base = ["w1 w2", "--raw", "--model", model, "--max-new-tokens", "6", "--method", "pld"]
    # fresh processes: library noise (a warning shown once, the `Loading weights` bar) is what a process
    # starting up prints, which this one, having loaded models already, would not show again
    quiet, normal = _cli([*base, "-q"], stdin=subprocess_devnull()), _cli(base, stdin=subprocess_devnull())
    assert quiet.returncode == normal.returncode == 0
    assert quiet.stderr == "" and quiet.stdout == normal.stdout
    # no library noise (the `Loading weights` bar, warnings): the statistics line and our notes
    assert all(line.startswith(("[pld, ", "specdec: ")) for line in normal.stderr.splitlines()), normal.stderr
    # what -v adds, and -q with -v refused, are the command's own: checked in this process
    code, out, err = _generate_fed([*base, "-v"], None, monkeypatch, capsys)
    assert code == 0 and out == normal.stdout and "alpha by depth" in err.splitlines()[-1]
    with pytest.raises(SystemExit) as e:
        main(["generate", *base, "-q", "-v"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


# ---- every other command: paths, output places and option combinations before any model loads ----

HEADS = __import__("pathlib").Path(__file__).resolve().parents[1] / "src/specdec/heads"


@pytest.fixture
def no_model_load(monkeypatch):
    """Every loader a command reaches, refusing: an error raised after one of them was called fails the test."""
    import specdec.bench.cli
    import specdec.cli.interop
    import specdec.cli.medusa
    import specdec.training.datagen_cli
    import specdec.training.train_cli
    import specdec.tune.cli

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")
    for mod, name in ((specdec.api, "load_model"), (specdec.bench.cli, "load_model"),
                      (specdec.cli.interop, "load_model"), (specdec.cli.medusa, "load_model"),
                      (specdec.training.datagen_cli, "load_model"), (specdec.training.train_cli, "load_target"),
                      (specdec.training.train_cli, "materialize"), (specdec.tune.cli, "load_model")):
        monkeypatch.setattr(mod, name, refuse)


def _one_line_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error:") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "shard-00000.safetensors").write_bytes(b"")  # listed, never read: the checks stop before
    return str(d)


@pytest.mark.parametrize("kind", ["eagle", "fspad", "eagle3", "medusa"])
@pytest.mark.parametrize("case, names", [
    ("missing data", "--data"),
    ("data without shards", "no data shards"),
    ("out not writable", "--out"),
    ("out a file", "--out"),
    ("init-from missing", "--init-from"),
    ("ship-to not writable", "--ship-to"),
    ("model missing", "--model"),
])
def test_train_checks_its_paths_before_the_target_loads(kind, case, names, tmp_path, no_model_load, capsys):
    data, out = _data_dir(tmp_path), str(tmp_path / "run")
    argv = {"missing data": ["--data", str(tmp_path / "nowhere")],
            "data without shards": ["--data", str(tmp_path)],
            "out not writable": ["--data", data, "--out", "/proc/specdec-run"],
            "out a file": ["--data", data, "--out", data + "/shard-00000.safetensors"],
            "init-from missing": ["--data", data, "--init-from", str(tmp_path / "no-head")],
            "ship-to not writable": ["--data", data, "--ship-to", "/proc/specdec-ship"],
            "model missing": ["--data", data, "--model", str(tmp_path / "no-model")]}[case]
    if "--out" not in argv:
        argv += ["--out", out]
    assert names in _one_line_error(["train", kind, *argv], capsys)


def test_train_refuses_a_resume_with_other_settings_before_the_target_loads(tmp_path, no_model_load, capsys):
    import torch

    from specdec.training.train import TrainConfig

    data, out = _data_dir(tmp_path), tmp_path / "run"
    ck = out / "checkpoints" / "step-0000010"
    ck.mkdir(parents=True)
    torch.save({"config": TrainConfig(data=data, out=str(out), lr=0.01).model_dump(), "step": 10}, ck / "state.pt")
    err = _one_line_error(["train", "eagle", "--data", data, "--out", str(out), "--lr", "0.02"], capsys)
    assert "lr=0.01" in err and "0.02" in err


@pytest.mark.parametrize("argv, names", [
    (["datagen", "--out", "/proc/specdec-data", "--shards", "1", "--sources", "self"], "--out"),
    (["datagen", "--out", "{tmp}/o", "--shards", "1", "--sources", "self", "--model", "{tmp}/no-model"], "--model"),
    (["datagen", "--out", "{tmp}/o", "--shards", "1", "--exclude-dir", "{tmp}/nowhere", "--sources", "self"],
     "--exclude-dir"),
    (["tune", "--out", "{tmp}"], "--out"),
    (["tune", "--out", "/proc/specdec-tune/t.json"], "--out"),
    (["tune", "--model", "{tmp}/no-model"], "--model"),
    (["tune", "--head", "{tmp}/no-head"], "--head"),
    (["tune", "--top", "0"], "--top"),
    (["import-head", f"{HEADS}/smollm2-135m-instruct-eagle", "--out", "/proc/specdec-head"], "--out"),
    (["import-head", f"{HEADS}/smollm2-135m-instruct-eagle", "--out", "{tmp}/h", "--model", "{tmp}/no-model"],
     "--model"),
    (["export-head", f"{HEADS}/smollm2-135m-instruct-eagle", "--to", "vllm", "--out", "/proc/specdec-head"], "--out"),
    (["export-head", f"{HEADS}/smollm2-135m-instruct-eagle", "--to", "vllm", "--out", "{tmp}/h", "--model",
      "{tmp}/no-model"], "--model"),
    (["export-head", f"{HEADS}/smollm2-135m-instruct-eagle", "--to", "llamacpp", "--out", "/proc/x/h.gguf", "--model",
      "smollm2"], "--out"),
    (["medusa", "convert", f"{HEADS}/smollm2-135m-instruct-medusa", "/proc/specdec-medusa"], "DST"),
    (["medusa", "convert", f"{HEADS}/smollm2-135m-instruct-medusa", "{tmp}/m", "--model", "{tmp}/no-model"],
     "--model"),
    (["bench", "--model", "{tmp}/no-model", "--weights", "fp32", "--out", "{tmp}/b"], "--model"),
    (["bench", "--draft", "{tmp}/no-model", "--out", "{tmp}/b"], "--draft"),
    (["bench", "serve", "--model", "{tmp}/no-model", "--out", "{tmp}/b"], "--model"),
    (["bench", "merge", "{tmp}/nowhere"], "nowhere"),
    (["serve", "--prefill-stall", "0.5"], "prefill_stall"),
])
def test_commands_check_before_any_model_loads(argv, names, tmp_path, no_model_load, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert names in _one_line_error(argv, capsys)
