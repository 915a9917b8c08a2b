"""The trained run's graph in ZenML's local dashboard shows every step, the evaluation report and the
per-problem table (headless Chromium + Playwright).

The local server is ``zenml login --local --blocking --port PORT`` on the test's throwaway store, in
a child process this test starts and stops. It runs without authentication (the local server's
scheme); its default user only has to have its onboarding survey marked done, or the dashboard
opens the survey instead of the run. Screenshots of the run page and of the evaluation report are
saved under outputs/screenshots/. The dashboard shows an HTML artifact in a sandboxed iframe.
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
REPORT_SCREENSHOT = REPO_ROOT / "outputs" / "screenshots" / "dashboard_evaluation_report.png"
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"]

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
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
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


def _open_visualization(page, artifact: str, which: str | None = None):
    """Click the artifact's node in the run graph, its panel's Visualization tab, pick one of its
    visualizations (``which``) and load the preview."""
    page.get_by_text(artifact, exact=True).first.click(timeout=120_000)
    panel = page.get_by_role("dialog")
    panel.get_by_text("Visualization", exact=True).click(timeout=60_000)
    if which is not None:
        panel.get_by_role("combobox").click(timeout=60_000)
        page.get_by_role("option", name=which).click(timeout=30_000)
    panel.get_by_role("button", name="Load Preview").click(timeout=60_000)
    return panel


def test_run_page_renders_the_evaluation_report_and_the_per_problem_table(dashboard):
    url, run, project = dashboard
    evaluation = run.steps["evaluate"].outputs["evaluation"][0].load()
    table = run.steps["evaluate"].outputs["per_problem"][0].load()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/projects/{project}/runs/{run.id}", wait_until="domcontentloaded")
            _open_visualization(page, "evaluation_report")
            report = page.frame_locator("iframe[title='Secure HTML Content']")
            low, high = evaluation["accuracy_ci"]
            report.get_by_text(f"[{low:.1%}, {high:.1%}]").first.wait_for(timeout=120_000)
            changed = evaluation["changed"]
            report.get_by_text(f"fixed {changed['n_fixed']}, broke {changed['n_broken']}").wait_for(timeout=30_000)
            report.get_by_text("Training curves").wait_for(timeout=30_000)
            page.screenshot(path=str(REPORT_SCREENSHOT), timeout=60_000)

            page.goto(f"{url}/projects/{project}/runs/{run.id}", wait_until="domcontentloaded")
            panel = _open_visualization(page, "per_problem", "sample.csv")
            panel.get_by_text("candidate_correct", exact=True).wait_for(timeout=120_000)
            panel.get_by_text(table["problem_id"].iloc[0], exact=True).wait_for(timeout=30_000)
        finally:
            browser.close()
    assert REPORT_SCREENSHOT.stat().st_size > 10_000
