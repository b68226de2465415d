"""The playground page (GET /) in a real headless browser: Playwright drives Debian's chromium against the
app served in-process over a tiny random model (gibberish text, but real tokens and depths)."""

import re
import shutil

import pytest

from specdec.api import from_models
from tests.helpers import tiny_model, word_tokenizer
from tests.test_serve import MODEL, WORDS, Server

pytestmark = pytest.mark.slow

PROMPT = "w3 w7 w1 w9 w3 w7 w2 w3 w7 w1 w9 w3 w7 w2"
MAX_TOKENS = 40
NUMBER = re.compile(r"^\d+(\.\d+)?$")


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server():
    tok = word_tokenizer(WORDS)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    s = Server(from_models(tiny_model("llama"), tok, "pld"))  # prompt lookup: drafts the answer's repeats
    yield s
    s.stop()


def test_the_playground_streams_the_servers_answer_coloured_by_depth(browser, server, tmp_path):
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"http://127.0.0.1:{server.port}/")
    page.wait_for_function("document.getElementById('method').textContent !== '…'")
    assert page.text_content("#model") == MODEL and page.text_content("#method") == "pld"

    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#prompt", PROMPT)
    page.click("#send")
    page.wait_for_selector("#status[data-state=done]", state="attached", timeout=60_000)
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)

    status, body, _ = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
        "temperature": 0})
    assert status == 200
    want = body["choices"][0]["message"]["content"]
    answer = page.locator(".msg.assistant").last
    assert answer.text_content() == want
    spans = answer.locator("span.tok")
    texts = spans.all_text_contents()
    kinds = set(spans.evaluate_all("els => els.map(e => e.className)"))
    assert "".join(texts) == want and len(kinds) >= 2 and "tok d0" in kinds
    assert page.text_content("#tau") == f"{body['specdec']['tau']:.2f}"
    assert NUMBER.match(page.text_content("#tps")) and float(page.text_content("#tps")) > 0
    assert page.text_content("#finish") == body["choices"][0]["finish_reason"]
    assert page.text_content("#ntok") == str(body["usage"]["completion_tokens"])
    assert (tmp_path / "playground.png").stat().st_size > 0
    assert errors == []
