#!/usr/bin/env bash
# Runs a device script with its OUT in a scratch folder, then packs every file it wrote into
# $OUT/results.tgz beside a copy of its log (the device tool brings back at most 8 files from $OUT).
#   usage on the device: OUT=... [VAR=...] bash experiments/device_packed.sh experiments/h100_....sh
scratch=/tmp/packed_out
rm -rf "$scratch" && mkdir -p "$scratch"
OUT=$scratch timeout ${PACKED_S:-36000} bash "$@"  # (PACKED_S: a limit that still leaves time to pack)
rc=$?
tar czf "${OUT:?set OUT}/results.tgz" -C "$scratch" .
cp "$scratch/log.txt" "$OUT/log.txt" 2>/dev/null
exit $rc
