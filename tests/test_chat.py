"""`specdec chat`: the conversation (history, /reset, provenance of each token) through the API, and the
real command driven through a pseudo-terminal as a user types into it."""

import fcntl
import os
import pty
import re
import signal
import subprocess
import sys
import termios
import threading
import time

import pytest

from specdec.api import GenerationParams, from_models
from specdec.cli.chat import Conversation
from tests.helpers import cli_fed, tiny_model, word_tokenizer

WORDS = [f"w{i}" for i in range(5)]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # each message's words, in order
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _tok():
    tok = word_tokenizer(WORDS)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_chat")
    tiny_model("llama", vocab_size=7).save_pretrained(d)
    _tok().save_pretrained(d)
    return str(d)


def _contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("method", ["vanilla", "pld"])
def test_the_second_turn_is_sent_with_the_first_answer_and_reset_forgets_it(method):
    dec = from_models(tiny_model("llama", vocab_size=7), _tok(), method)
    conv = Conversation(dec, GenerationParams(max_new_tokens=5), system="w4")
    first = conv.ask("w1 w2")
    second = conv.ask("w3")
    assert first.text and _contains(second.prompt_ids, first.token_ids)
    assert _contains(second.prompt_ids, first.prompt_ids)  # the system message and first question too
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant"]
    conv.reset()
    assert conv.messages == [{"role": "system", "content": "w4"}]
    again = conv.ask("w1 w2")
    assert again.prompt_ids == first.prompt_ids and again.token_ids == first.token_ids


def test_a_stopped_answer_keeps_what_was_shown_and_an_unshown_one_drops_the_turn():
    dec = from_models(tiny_model("llama", vocab_size=7), _tok(), "vanilla")
    conv = Conversation(dec, GenerationParams(max_new_tokens=8))
    stream = conv.send("w1 w2")
    shown = next(stream).text
    stream.close()  # what Ctrl-C does in the REPL
    conv.keep(shown)
    assert conv.messages[-1] == {"role": "assistant", "content": shown}
    conv.send("w3").close()
    conv.keep("")
    assert len(conv.messages) == 2


@pytest.mark.parametrize("method, kw", [("pld", {}), ("pld", {"stop": ["w2 w3"]}), ("vanilla", {}),
                                        ("eagle2", {})])
def test_each_token_says_whether_it_was_an_accepted_draft_and_at_which_depth(method, kw, request):
    """Chunks together carry the answer's tokens; their depths count exactly the accepted draft tokens."""
    tiny = request.getfixturevalue("tiny")
    # a trained head drafts trees several tokens deep
    opts = {"head": str(request.getfixturevalue("trained")[1] / "head")} if method == "eagle2" else {}
    dec = from_models(tiny, word_tokenizer([f"w{i}" for i in range(95)]), method, **opts)
    prompt = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2 w3"
    chunks = list(dec.stream(prompt, max_new_tokens=40, **kw))
    gen = chunks[-1].final
    ids = [t for c in chunks for t in c.token_ids]
    depths = [d for c in chunks for d in c.depths]
    assert ids == gen.token_ids and len(depths) == len(ids)
    assert all(d == 0 or d == prev + 1 for prev, d in zip([0, *depths], depths))  # a path goes 1, 2, ...
    if gen.finish_reason == "length":  # nothing accepted was cut off: every accepted draft token is here
        assert sum(d > 0 for d in depths) == sum(a - 1 for a in gen.stats.accept_lengths)
        assert depths.count(0) == 1 + gen.stats.target_forwards  # the first token, then a bonus per forward
    if method == "vanilla":
        assert set(depths) == {0}
    elif not kw:
        assert max(depths) >= 1  # this repetitive prompt is drafted


def _own_terminal():
    """In the child: a session of its own whose controlling terminal is the pty, so that Ctrl-C typed
    there is a SIGINT to it, as in a shell; and SIGINT handled as a shell's foreground job has it, even
    when the suite itself runs where it is ignored (a background job of a non-interactive shell, whose
    children inherit the ignoring through exec)."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Session:
    """`specdec chat` on a pseudo-terminal (stdin and stdout, as a user has them); stderr apart. Used with
    `with`: whatever a test asserts, the chat is gone when it leaves (killed if it still runs), and no wait
    is without a limit, so a chat that stops answering fails its test instead of hanging the suite."""

    def __init__(self, *args):
        master, slave = pty.openpty()
        # TERM=dumb: readline writes no escape sequences of its own around the prompt
        self.proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "chat", *args], stdin=slave,
                                     stdout=slave, stderr=subprocess.PIPE, preexec_fn=_own_terminal,
                                     env=dict(os.environ, TERM="dumb"))
        os.close(slave)
        self.master, self.lock, self.got = master, threading.Lock(), {"out": b"", "err": b""}
        # both read all along: a child blocked on a full pipe would look like one that stopped answering
        self.pumps = [threading.Thread(target=self._pump, args=(fd, key), daemon=True)
                      for fd, key in ((master, "out"), (self.proc.stderr.fileno(), "err"))]
        for t in self.pumps:
            t.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()  # a no-op once it has exited
        self.proc.wait()
        self._drain()

    def _pump(self, fd: int, key: str):
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                return
            if not data:
                return
            with self.lock:
                self.got[key] += data

    def _drain(self):
        """After the child has exited: the last of its output read, the terminal closed."""
        for t in self.pumps:
            t.join(10)
        if self.master is not None:
            os.close(self.master)
            self.proc.stderr.close()
            self.master = None

    def text(self, key: str = "out") -> str:
        with self.lock:
            return self.got[key].decode(errors="replace")

    def expect(self, pattern: str, count: int = 1, timeout: float = 240) -> str:
        end = time.monotonic() + timeout
        while self.text().count(pattern) < count:
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"waited for {pattern!r} x{count}; got {self.text()!r}, "
                                     f"stderr {self.text('err')!r}")
            time.sleep(0.05)
        return self.text()

    def send(self, line: str):
        os.write(self.master, line.encode())

    def finish(self, timeout: float = 60):
        """(exit code, stderr) once the chat has ended by itself."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the chat did not end within {timeout} s; got {self.text()!r}, "
                                 f"stderr {self.text('err')!r}") from None
        self._drain()
        return self.proc.returncode, self.text("err")


def _answers(screen: str) -> list[str]:
    """The answers on a chat screen: the lines after each echoed input line."""
    lines = screen.replace("\r\n", "\n").split("\n")
    return [lines[i + 1] for i, line in enumerate(lines[:-1]) if line.startswith(">>> ") and line[4:].strip()
            and not line[4:].startswith("/")]


@pytest.mark.slow
def test_a_conversation_on_a_terminal_keeps_its_history_until_reset_and_ends_at_eof(model_dir):
    with Session("--model", model_dir, "--method", "pld", "--max-new-tokens", "6", "--threads", "1", "-v") as s:
        s.expect(">>> ")
        for n, line in enumerate(["w1 w2", "w3", "/reset", "w1 w2"], 2):
            s.send(line + "\n")
            s.expect(">>> ", n)
        s.send("\x04")  # Ctrl-D
        code, err = s.finish()
    assert code == 0, err
    prompts = [int(n) for n in re.findall(r"prompt (\d+) tokens", err)]
    answers = _answers(s.text())
    assert len(prompts) == len(answers) == 3 and "(history cleared)" in err
    # the second turn was sent with the first question and answer (6 tokens); after /reset, not
    assert prompts[1] == prompts[0] + len(answers[0].split()) + 1 and prompts[2] == prompts[0]
    assert answers[2] == answers[0]
    assert "Traceback" not in err


@pytest.mark.slow
def test_color_draft_paints_the_same_text(model_dir, monkeypatch, capsys):
    base = ["--model", model_dir, "--method", "pld", "--max-new-tokens", "12", "--threads", "1"]
    turns = "w1 w2 w1 w2\nw3 w1 w2\n"
    code, plain, _ = cli_fed(["chat", *base], turns, monkeypatch, capsys)  # the uncoloured answers, piped
    assert code == 0 and "\x1b" not in plain
    with Session(*base, "--color-draft") as s:
        s.expect(">>> ")
        for n, line in enumerate(turns.splitlines(), 2):
            s.send(line + "\n")
            s.expect(">>> ", n)
        s.send("/exit\n")
        code, err = s.finish()
    screen = s.text()
    assert code == 0 and "colours:" in err
    assert "\x1b[32m" in screen and "\x1b[33m" in screen  # accepted drafts (depth 1) and target tokens
    assert [ANSI.sub("", a) for a in _answers(screen)] == plain.splitlines()
    # the per-turn statistics count the accepted drafts the colours show
    painted = [len(re.findall(r"\x1b\[3[2-6]m", a)) for a in _answers(screen)]
    accepted = [int(n) for n in re.findall(r"(\d+) draft tokens accepted", err)]
    assert len(accepted) == 2 and all(p >= (a > 0) for p, a in zip(painted, accepted))


@pytest.mark.slow
def test_piped_turns_and_quiet(model_dir):
    """Lines piped in are turns; -q leaves stderr empty; by default only our own lines are there."""
    base = ["chat", "--model", model_dir, "--method", "pld", "--max-new-tokens", "4"]
    run = lambda *a: subprocess.run([sys.executable, "-m", "specdec.cli", *base, *a], input="w1\n\nw2\n",
                                    text=True, capture_output=True, timeout=300)
    quiet, normal = run("-q"), run()
    assert quiet.returncode == normal.returncode == 0
    assert quiet.stderr == "" and quiet.stdout == normal.stdout and len(quiet.stdout.splitlines()) == 2
    assert all(line.startswith(("[pld]", "specdec: another process")) for line in normal.stderr.splitlines())
    assert "Loading weights" not in normal.stderr and "Warning" not in normal.stderr


@pytest.mark.slow
def test_ctrl_c_stops_an_answer_and_returns_to_the_prompt():
    """On the embedded SmolLM2, slow enough to interrupt: the answer stops, the prompt comes back, the
    next turn is answered, Ctrl-C at the prompt leaves cleanly."""
    with Session("--max-new-tokens", "300", "--method", "vanilla", "--threads", "1") as s:
        s.expect(">>> ")
        s.send("Tell me a very long story about a dragon.\n")
        shown = len(s.expect("dragon.\r\n")) + 30  # the echoed line, then some of the answer
        end = time.monotonic() + 240
        while len(s.text()) < shown:
            assert s.proc.poll() is None and time.monotonic() < end, (s.text(), s.text("err"))
            time.sleep(0.05)
        assert s.text().count(">>> ") == 1  # still answering
        s.send("\x03")  # the terminal turns it into SIGINT for the foreground job
        s.expect(">>> ", 2, timeout=60)
        s.send("/reset\n")
        s.expect(">>> ", 3)
        s.proc.send_signal(signal.SIGINT)  # at the prompt: quit
        code, err = s.finish()
    assert code == 0 and "(answer stopped)" in err and "Traceback" not in err
    assert "draft tokens accepted" not in err  # the stopped answer has no statistics line


def test_a_turn_beyond_the_context_or_an_unknown_command_is_one_line_and_the_chat_goes_on(model_dir, monkeypatch,
                                                                                            capsys):
    turns = " ".join(["w1"] * 600) + "\n/nonsense\nw2\n"  # the tiny model's context is 512 tokens
    code, out, err = cli_fed(["chat", "--model", model_dir, "--method", "pld", "--max-new-tokens", "4", "--threads",
                              "1"], turns, monkeypatch, capsys)
    assert code == 0 and len(out.splitlines()) == 1  # only w2 was answered
    errors = [line for line in err.splitlines() if line.startswith("specdec: error:")]
    assert len(errors) == 1 and "context" in errors[0] and "/reset" in errors[0]
    assert sum(line.startswith("unknown command /nonsense") for line in err.splitlines()) == 1
    assert "Traceback" not in err
