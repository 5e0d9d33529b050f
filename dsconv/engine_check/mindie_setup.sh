#!/usr/bin/env bash
# The MindIE part of the engine check: a venv of its own (transformers 4.57, CPU torch; mindie_requirements.txt) and
# MindIE-LLM's Python sources, from MINDIE_LLM_SRC: a MindIE-LLM checkout, the atb_llm of a MindIE installation, or
# a source archive (.tar.gz, unpacked once into the cache).
#   MINDIE_LLM_SRC=... bash dsconv/engine_check/mindie_setup.sh   ->  prints "PYTHON SOURCES" on stdout
# Cached under ${DSCONV_ENGINE_CACHE:-~/.cache/dsconv}/mindie-<hash of this file and the requirements>; ~1 min and
# ~1 GB the first time (PyPI only), instant after.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
say() { echo "mindie setup: $*" >&2; }
src="${MINDIE_LLM_SRC:-}"
if [ -z "$src" ]; then
  say "MINDIE_LLM_SRC is not set: point it at a MindIE-LLM checkout, a MindIE installation's atb_llm, or its source archive"
  exit 3
fi
[ -e "$src" ] || { say "MINDIE_LLM_SRC=$src does not exist"; exit 2; }
cache="${DSCONV_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsconv}"
key=$(cat "$here/mindie_setup.sh" "$here/mindie_requirements.txt" | sha256sum | cut -c1-12)
root="$cache/mindie-$key"
py="$root/venv/bin/python"
if [ ! -f "$root/.ready" ]; then
  rm -rf "$root" && mkdir -p "$root"
  t0=$(date +%s)
  say "creating $root/venv (transformers $(grep '^transformers==' "$here/mindie_requirements.txt" | cut -d= -f3))"
  python3 -m venv "$root/venv"
  "$root/venv/bin/pip" --disable-pip-version-check -q install -r "$here/mindie_requirements.txt" \
    2> >(grep -v "^WARNING: Location" >&2)
  touch "$root/.ready"
  say "ready in $(( $(date +%s) - t0 )) s, $(du -sh "$root" | cut -f1)"
fi
if [ -f "$src" ]; then  # a source archive: unpacked once, keyed by its content
  akey=$(sha256sum "$src" | cut -c1-12)
  dest="$cache/mindie-src-$akey"
  if [ ! -f "$dest/.ready" ]; then
    rm -rf "$dest" && mkdir -p "$dest"
    tar -xzf "$src" -C "$dest"
    touch "$dest/.ready"
    say "unpacked $(basename "$src") into $dest"
  fi
  src="$dest"
fi
echo "$py $(cd "$src" && pwd)"
