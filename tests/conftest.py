"""Shared fixtures. Browser tests use Debian's Chromium; without it they skip loudly, except
under CI=true, where a missing browser is a failure."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


def chromium_path() -> str | None:
    for candidate in (os.environ.get("DEEPSCOPE_CHROMIUM"), "/usr/bin/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@pytest.fixture(scope="session")
def browser():
    """A headless Chromium driven by Playwright (session-wide)."""
    path = chromium_path()
    if path is None:
        msg = ("NO BROWSER: Debian's Chromium is not installed (apt-get install -y chromium); "
               "browser tests are skipped")
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " — under CI=true this is a failure")
        pytest.skip(msg)
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()
