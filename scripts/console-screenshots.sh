#!/usr/bin/env bash
# The console's screenshots in the docs, taken from a real headless Chromium (Selenium) by the console's
# own e2e tests: docs/console.png from the digits server, docs/console-incident.png from a server with a
# slow, a failing and a broken model. Needs chromium and chromedriver (scripts/install-test-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
SERVEWELL_CONSOLE_SCREENSHOT=docs/console.png .venv/bin/pytest -q -p no:cacheprovider tests/e2e/test_console.py "$@"
ls -l docs/console.png docs/console-incident.png
