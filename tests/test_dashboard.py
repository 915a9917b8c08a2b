"""The trained run's graph in ZenML's local dashboard shows every step (headless Chromium + Playwright).

The local server is ``zenml login --local --blocking --port PORT`` on the test's throwaway store, in
a child process this test starts and stops. It runs without authentication (the local server's
scheme); its default user only has to have its onboarding survey marked done, or the dashboard
opens the survey instead of the run. A screenshot of the run page is saved under
outputs/screenshots/.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_pipeline import REPO_ROOT, STEPS, ZENML_HOME, trained_model, zenml_client

CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
SCREENSHOT = REPO_ROOT / "outputs" / "screenshots" / "dashboard_run.png"

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no Chromium at {CHROMIUM} (apt-get install chromium)"),
    pytest.mark.slow,
]
sync_playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright").sync_playwright


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def dashboard():
    _, (run_id, _) = trained_model()
    client = zenml_client()
    client.update_user(client.active_user.id, updated_email_opt_in=False,
                       updated_metadata={"finished_onboarding_survey": True})
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = ZENML_HOME / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([str(Path(sys.executable).with_name("zenml")), "login", "--local", "--blocking",
                                   "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, cwd=ZENML_HOME,
                                  env={**os.environ, "ZENML_SERVER_AUTO_ACTIVATE": "true"})
    try:
        deadline = time.monotonic() + 180
        while not _up(url):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the local ZenML server did not come up on {url}:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url, client.get_pipeline_run(run_id), client.active_project.name
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_run_page_shows_every_step(dashboard):
    url, run, project = dashboard
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                                                 "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{url}/projects/{project}/runs/{run.id}", wait_until="domcontentloaded")
            for step in STEPS:
                page.get_by_text(step, exact=True).first.wait_for(timeout=120_000)
            page.get_by_text(run.name).first.wait_for(timeout=30_000)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), timeout=60_000)
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
