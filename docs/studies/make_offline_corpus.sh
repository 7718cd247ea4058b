#!/usr/bin/env bash
# The offline English corpus of docs/results-2026-12-01.md, as JSONL ({"text": ...} per line), from two Debian packages: the
# GCIDE dictionary (one document per 40 entries) and the Linux kernel's reStructuredText documentation (one document
# per file); documents under 200 characters are dropped, and the order is shuffled with seed 0 (the val split is
# the first documents, and the packages would otherwise put all of one kind first). About 68 MB, 6,640 documents.
# Narrow, real text: not FineWeb.    Usage: bash docs/studies/make_offline_corpus.sh OUT.jsonl   (needs apt-get)
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ] || [ $# -ne 1 ]; then
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
    [ $# -eq 1 ] && exit 0 || exit 2
fi
out=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download() { (cd "$work" && apt-get download -q dict-gcide linux-doc-6.12 >/dev/null); }
# a machine without package lists (a fresh container) knows no package until `apt-get update`
download 2>/dev/null || { apt-get update -qq >/dev/null 2>&1 || true; download; }
for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/root"; done
python3 - "$work/root" "$out" <<'PY'
import gzip, json, pathlib, random, re, sys

root, out = pathlib.Path(sys.argv[1]), sys.argv[2]
docs = [gzip.open(p, "rt", encoding="utf-8", errors="replace").read()
        for p in sorted((root / "usr/share/doc").glob("linux-doc-*/Documentation/**/*.rst.gz"))]
dictionary = gzip.open(root / "usr/share/dictd/gcide.dict.dz", "rt", encoding="utf-8", errors="replace").read()
entries = re.split(r"\n(?=\S)", dictionary)  # an entry begins on a line that is not indented
docs += ["\n".join(entries[i:i + 40]) for i in range(0, len(entries), 40)]
docs = [json.dumps({"text": d.strip()}, ensure_ascii=False) for d in docs if len(d.strip()) > 200]
random.Random(0).shuffle(docs)
pathlib.Path(out).write_text("\n".join(docs) + "\n", encoding="utf-8")
print(f"{out}: {len(docs)} documents")
PY
