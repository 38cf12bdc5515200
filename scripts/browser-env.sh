#!/usr/bin/env bash
# Makes sure headless Chromium and its WebDriver are there for the web console's browser tests
# (sdk/python/tests/test_console.py): Debian's `chromium` and `chromium-driver`, installed with
# apt-get (which needs root) when either is missing. Prints nothing when both are present.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
echo "installing chromium and chromium-driver (apt-get) for the console's browser tests" >&2
DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >&2
