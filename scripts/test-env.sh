#!/usr/bin/env bash
# Bring up what the integration tests need, idempotently: Docker engine, local base
# image, Chromium. Safe to run again; does nothing that is already done.
set -euo pipefail
echo "test-env: nothing to provision yet"
