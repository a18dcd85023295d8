#!/bin/sh
# The worker image's entry command: `ephost worker` for EPHOST_EP on EPHOST_LISTEN, options from
# EPHOST_OPTIONS (KEY=VALUE pairs separated by ";"); arguments are passed on (--tls-cert ..., --token-file ...).
set -eu
set -- --ep "${EPHOST_EP:-onnxruntime}" --listen "${EPHOST_LISTEN:-unix:///run/ephost/worker.sock}" "$@"
if [ -n "${EPHOST_OPTIONS:-}" ]; then
    old_ifs=$IFS; IFS=";"
    for option in $EPHOST_OPTIONS; do set -- "$@" --option "$option"; done
    IFS=$old_ifs
fi
exec ephost worker "$@"
