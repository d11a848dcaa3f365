#!/usr/bin/env bash
# Set up ./.venv with the test tools (first run only) and run the whole test suite.
source "$(dirname "$0")/venv.sh" test
cd "$ROOT"
exec python -m pytest -p no:cacheprovider "$@"
