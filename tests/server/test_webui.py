"""llama-server's chat page at `/`, used as a person uses it: in a real headless Chromium driven by selenium, against
a server started here with a tiny random checkpoint.

Every reply the page shows is compared with the server's own answer to the same conversation through the
`openai` package, greedy, so nothing depends on what a random model says. The browser tests skip, naming what
is missing, without selenium, Chromium or chromedriver (`.ci/run` installs them). Waits are bounded and
generous: they call a hang a hang, and nothing depends on timing.
"""

import os
import shutil

import httpx
import pytest

openai = pytest.importorskip("openai")

from helpers import write_nonstop  # noqa: E402
from llama.server.http import ServerState, create_app  # noqa: E402
from test_server import KEY, Server  # noqa: E402

MAX_SEQ_LEN = 2048
# A reply that would take minutes on the server without a KV cache (each step feeds the whole prefix, and the
# checkpoint never stops by itself), so the stop button surely comes in the middle of it.
LONG = MAX_SEQ_LEN - 100
WAIT = 180  # seconds: a reply not shown by then is a hang
SYSTEM = "You are a careful assistant. Answer the question in one short sentence, then stop. Be brief and exact."
# WebDriver's key codes: Enter, and Shift+Enter (NULL lets Shift go again).
ENTER, SHIFT_ENTER = "\ue007", "\ue008\ue007\ue000"


def chromium():
    """A headless Chromium under selenium, or the reason there is none."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no Chromium or chromedriver on PATH (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    # As root in a container: no sandbox, no GPU, and /tmp rather than a small /dev/shm.
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,820"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(driver))


@pytest.fixture(scope="module")
def browser():
    driver = chromium()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_nonstop(tmp_path_factory.mktemp("webui") / "nonstop")


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(ckpt, "--api-key", KEY, "--parallel", "2", max_seq_len=MAX_SEQ_LEN)
    yield s
    assert s.stop() == 0, "\n".join(s.lines[-20:])


@pytest.fixture(scope="module")
def slow_server(ckpt):
    """No KV cache, no API key, one sequence at a time."""
    s = Server(ckpt, "--no-kv-cache", "--parallel", "1", "--shutdown-grace", "1", max_seq_len=MAX_SEQ_LEN)
    yield s
    assert s.stop() == 0, "\n".join(s.lines[-20:])


class Page:
    """The chat page in the browser: its fields, and the replies it shows."""

    def __init__(self, driver, url: str, key: str = None):
        """Open the page afresh (no key remembered from another test), enter `key`, and wait for the model."""
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver, self.By = driver, By
        driver.get(url + "/")
        driver.execute_script("localStorage.clear()")
        driver.refresh()
        self.wait = WebDriverWait(driver, WAIT, poll_frequency=0.05)
        if key is not None:
            self.fill("api-key", key)
            self.wait_ready()

    def wait_ready(self) -> None:
        self.wait.until(lambda d: self.field("status").text.startswith("Model:"))

    def field(self, id: str):
        return self.driver.find_element(self.By.ID, id)

    def fill(self, id: str, value: str) -> None:
        from selenium.webdriver.common.keys import Keys

        element = self.field(id)
        element.clear()
        element.send_keys(value, Keys.TAB)  # leaving the field fires its change event

    def settings(self, system: str, temperature: str, max_tokens: str, cache: bool = True) -> None:
        self.fill("system", system)
        self.fill("temperature", temperature)
        self.fill("max-tokens", max_tokens)
        if self.field("cache-prompt").is_selected() != cache:
            self.field("cache-prompt").click()

    def type(self, *keys) -> None:
        """Type into the message box as a person does (Enter sends, Shift+Enter adds a line)."""
        self.field("prompt").send_keys(*keys)

    def replies(self):
        return self.driver.find_elements(self.By.CSS_SELECTOR, "#messages .assistant")

    def reply(self, i: int = -1) -> dict:
        """A finished reply: its text and what its statistics line says (finish, tokens, cached tokens)."""
        li = self.replies()[i]
        stats = li.find_element(self.By.CSS_SELECTOR, ".stats")
        data = {k: stats.get_attribute(f"data-{k}") for k in ("finish", "prompt-tokens", "cached-tokens",
                                                                 "completion-tokens", "disk-tokens", "drafted-tokens",
                                                                 "accepted-tokens")}
        return {"text": li.find_element(self.By.CSS_SELECTOR, ".content").get_property("textContent"),
                "stats": stats.text, **data}

    def wait_for_replies(self, n: int) -> dict:
        self.wait.until(lambda d: len(d.find_elements(self.By.CSS_SELECTOR, "#messages .assistant .stats")) >= n)
        return self.reply(n - 1)


def api_answer(server, messages, max_tokens: int, **extra):
    r = server.client().chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                                extra_body=extra or None)
    return r.choices[0].message.content, r.usage


# Without a browser: the page's route, the API key and --no-webui.

def test_the_page_is_served_without_the_key_and_the_api_still_needs_it():
    from starlette.testclient import TestClient

    with TestClient(create_app(ServerState(model_id="m", api_key="k"))) as client:
        r = client.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "/v1/chat/completions" in r.text and "<script>" in r.text
        assert "://" not in r.text  # nothing fetched from anywhere else: it works offline
        assert client.get("/v1/models").status_code == 401
        assert client.get("/metrics").status_code == 401


def test_without_the_page_slash_is_an_unknown_url():
    from starlette.testclient import TestClient

    with TestClient(create_app(ServerState(model_id="m", webui=False))) as client:  # as --no-webui makes it
        r = client.get("/")
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with TestClient(create_app(ServerState(model_id="m", api_key="k", webui=False))) as client:
        assert client.get("/").status_code == 401  # an unknown path like any other: the key comes first


@pytest.mark.slow
def test_no_webui_flag_and_the_key_on_a_real_server(server, slow_server, ckpt):
    r = httpx.get(server.url + "/", timeout=30)
    assert r.status_code == 200 and "llama-kv chat" in r.text
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert models["data"][0]["kv_cache"] is True
    assert httpx.get(slow_server.url + "/v1/models", timeout=30).json()["data"][0]["kv_cache"] is False
    plain = Server(ckpt, "--no-webui", "--parallel", "1")
    try:
        r = httpx.get(plain.url + "/", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
        assert not any("chat page" in line for line in plain.lines)
        assert any("chat page at" in line for line in server.lines)
    finally:
        assert plain.stop() == 0


# In the browser.

@pytest.mark.slow
def test_a_typed_message_gets_the_apis_streamed_answer(browser, server):
    page = Page(browser, server.url)
    page.wait.until(lambda d: "API key" in page.field("status").text)  # no key yet: the page says what is wrong
    page.fill("api-key", KEY)
    page.wait_ready()
    assert page.field("status").text.startswith("Model: nonstop")
    page.settings(SYSTEM, "0", "40")
    page.type("What is a list?", SHIFT_ENTER, "Answer briefly.", ENTER)
    first = page.wait_for_replies(1)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a list?\nAnswer briefly."}]
    text, usage = api_answer(server, messages, 40)
    assert first["text"] == text and first["finish"] == "length"
    assert int(first["completion-tokens"]) == usage.completion_tokens == 40
    assert int(first["prompt-tokens"]) == usage.prompt_tokens and "tokens/s" in first["stats"]
    if os.environ.get("LLAMA_WEBUI_SCREENSHOT"):
        browser.save_screenshot(os.environ["LLAMA_WEBUI_SCREENSHOT"])

    page.type("And a dict?", ENTER)  # the second turn carries the first
    second = page.wait_for_replies(2)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And a dict?"}]
    assert second["text"] == api_answer(server, messages, 40)[0]
    assert int(second["cached-tokens"]) > int(first["prompt-tokens"]) // 2  # the first turn, reused
    assert browser.execute_script("return localStorage.getItem('llama-kv.api-key')") == KEY


@pytest.mark.slow
def test_the_cache_switch_off_reuses_nothing_and_gives_the_same_answer(browser, server):
    page = Page(browser, server.url, KEY)
    assert "only the speed changes" in page.field("cache-hint").text
    system = SYSTEM + " Use plain words."
    answers = []
    for cache in (False, True):
        page.field("new-chat").click()
        page.settings(system, "0", "24", cache=cache)
        page.type("Name a prime number.", ENTER)
        answers.append(page.wait_for_replies(1))
    off, on = answers
    assert int(off["cached-tokens"]) == 0 and "0 of" in off["stats"]
    assert int(on["cached-tokens"]) > 0  # the prompt just computed, reused once allowed
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a prime number."}]
    assert off["text"] == on["text"] == api_answer(server, messages, 24)[0]


@pytest.mark.slow
def test_each_reply_says_what_came_from_memory_and_disk_and_what_drafts_were_accepted(browser, ckpt, tmp_path):
    """With --kv-cache-dir and --speculate ngram, a reply's line splits its cached prompt tokens into memory and disk,
    and counts its drafted tokens as the API does; after a restart the same conversation's prompt comes from disk."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say one two three one two three."}]
    shown = []
    for turn in range(2):
        server = Server(ckpt, "--api-key", KEY, "--parallel", "1", "--kv-cache-dir", tmp_path / "blocks",
                        "--speculate", "ngram", max_seq_len=MAX_SEQ_LEN)
        try:
            page = Page(browser, server.url, KEY)
            page.settings(SYSTEM, "0", "32")
            page.type(messages[1]["content"], ENTER)
            reply = page.wait_for_replies(1)
            text, usage = api_answer(server, messages, 32)
        finally:
            assert server.stop() == 0, "\n".join(server.lines[-20:])
        assert reply["text"] == text
        details = usage.completion_tokens_details
        assert int(reply["accepted-tokens"]) == details.accepted_prediction_tokens
        assert int(reply["drafted-tokens"]) == details.accepted_prediction_tokens + details.rejected_prediction_tokens
        assert "drafted tokens accepted" in reply["stats"] or "no token drafted" in reply["stats"]
        cached, disk = int(reply["cached-tokens"]), int(reply["disk-tokens"])
        assert f"({cached - disk} from memory, {disk} from disk)" in reply["stats"]
        shown.append((reply["text"], cached, disk))
    (first, _, first_disk), (again, cached, disk) = shown
    assert first_disk == 0 and disk > 0 and again == first  # the restarted server loaded the prompt's blocks


@pytest.mark.slow
def test_the_stop_button_ends_a_reply_in_progress(browser, slow_server):
    server = slow_server
    page = Page(browser, server.url)
    page.wait_ready()
    page.settings(SYSTEM, "0", str(LONG))
    before = server.metrics()
    page.type("Tell me a long story.", ENTER)
    page.wait.until(lambda d: page.replies() and page.replies()[-1].find_element(
        page.By.CSS_SELECTOR, ".content").get_property("textContent"))
    assert not page.field("stop").get_property("disabled") and page.field("send").get_property("disabled")
    page.field("stop").click()
    stopped = page.wait_for_replies(1)
    assert stopped["finish"] == "stopped" and "Stopped" in stopped["stats"] and stopped["text"]
    assert page.field("stop").get_property("disabled") and not page.field("send").get_property("disabled")
    page.wait.until(lambda d: any("client disconnected" in line for line in server.lines))
    page.wait.until(lambda d: server.metrics()["llama_kv_sequences_running"] == 0)
    generated = server.metrics()["llama_kv_generation_tokens_total"] - before["llama_kv_generation_tokens_total"]
    assert generated < LONG  # cancelled: it would otherwise have run to the end
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me a long story."}]
    start = api_answer(server, messages, 60)[0]  # what was shown is the answer's beginning
    assert start.startswith(stopped["text"]) or stopped["text"].startswith(start)


@pytest.mark.slow
def test_without_a_kv_cache_the_switch_is_off_and_says_why(browser, slow_server):
    page = Page(browser, slow_server.url)
    page.wait.until(lambda d: page.field("cache-prompt").get_property("disabled"))
    assert not page.field("cache-prompt").is_selected() and "--no-kv-cache" in page.field("cache-hint").text
    page.settings(SYSTEM, "0", "8")
    page.type("Say hello.", ENTER)
    reply = page.wait_for_replies(1)
    assert int(reply["cached-tokens"]) == 0 and int(reply["completion-tokens"]) == 8
