#!/usr/bin/env bash
# Set up ./.venv (first run only) and run `potluck demo` with any arguments given.
source "$(dirname "$0")/venv.sh" demo
exec potluck demo "$@"
