#!/usr/bin/env bash
# `make device-wheels`: what the lent accelerator machine lacks, into .device/ (ignored; it travels with `carry`):
#  - wheels (CPython 3.12, manylinux x86_64) of the packages its image does not hold, at the versions installed here;
#  - GPT-2's tokenizer (vocab.json, merges.txt) from ../shared/data, which does not travel.
# The total must stay under the 64 MiB a call may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=.device
# the device's image has torch, triton, transformers, tokenizers, safetensors, numpy, tqdm, sentencepiece, pyyaml,
# requests, attrs and pytest; tandem needs these besides (and their own needs)
PACKAGES="xgrammar apache-tvm-ffi llguidance gguf pydantic pydantic_core annotated-types typing-inspection typing_extensions jsonschema jsonschema-specifications referencing rpds-py"
PLATFORMS=""
for n in 17 24 27 28 31 34 35; do PLATFORMS="$PLATFORMS --platform manylinux_${n}_x86_64"; done
PLATFORMS="${PLATFORMS//manylinux_/manylinux_2_} --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
rm -rf "$DEST/wheels" && mkdir -p "$DEST/wheels" "$DEST/tokenizer"
for name in $PACKAGES; do
    version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
        -d "$DEST/wheels" "$name==$version"
done
SHARED=${TANDEM_SHARED_DATA:-../shared/data}
cp "$SHARED/tokenizers/gpt2/vocab.json" "$SHARED/tokenizers/gpt2/merges.txt" "$DEST/tokenizer/"
total=$(( $(du -sb "$DEST" | cut -f1) + $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) ))
echo "device-wheels: $(ls "$DEST/wheels" | wc -l) wheels; .device + tracked files = $((total / 1048576)) MiB of 64"
test "$total" -lt $((64 * 1048576)) || { echo "device-wheels: over the 64 MiB a call carries" >&2; exit 1; }
