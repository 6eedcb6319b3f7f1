"""Take docs/webui.png: the chat page in headless Chromium, a two-turn conversation with the default model.

Starts llama-server (the default model, fetched on first use) on a free port, types into the page as a person
would, and saves the screenshot once the second reply is in. Needs selenium, chromium and chromedriver.

    python scripts/webui_screenshot.py [--out docs/webui.png]
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

REPO = Path(__file__).resolve().parent.parent
TURNS = ["What is the capital of France?", "And of Italy? One sentence."]


def start_server() -> tuple:
    proc = subprocess.Popen([sys.executable, "-m", "llama.cli.server", "--port", "0", "--max-seq-len", "1024"],
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    for line in proc.stderr:
        sys.stderr.write(line)
        if "listening on " in line:
            return proc, line.split("listening on ")[1].split()[0]
    raise SystemExit("llama-server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "webui.png"))
    args = parser.parse_args()
    proc, url = start_server()
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("google-chrome")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        driver.get(url + "/")
        wait = WebDriverWait(driver, 600)
        wait.until(lambda d: d.find_element(By.ID, "status").text.startswith("Model:"))
        for field, value in (("system", "You are a helpful assistant. Answer briefly."), ("temperature", "0"),
                             ("max-tokens", "64")):
            driver.find_element(By.ID, field).clear()
            driver.find_element(By.ID, field).send_keys(value, Keys.TAB)
        for n, text in enumerate(TURNS, 1):
            driver.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)
            wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .assistant .stats")) >= n)
        driver.save_screenshot(args.out)
        print(f"saved {args.out}")
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
