#!/usr/bin/env bash
# Install what the browser test needs, once: Debian's chromium and the playwright package.
# The browser itself is never downloaded (no `playwright install`): Playwright drives the
# system Chromium through executable_path.
#   usage: bash tests/browser/setup.sh [PYTHON]      (default: .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}

if [ -z "${DDPLAB_CHROMIUM:-}" ] && ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing Debian's chromium (apt-get)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "the browser test needs Chromium: run 'sudo apt-get install chromium'," \
             "or set DDPLAB_CHROMIUM to a Chromium binary" >&2
        exit 1
    fi
fi

if ! "$PY" -c "import playwright" 2>/dev/null; then
    echo "installing the playwright Python package (pip)"
    "$PY" -m pip install -q -e ".[browser]"   # pyproject.toml's browser extra
fi
